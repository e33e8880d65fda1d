"""The ROCm platform's host-side logic, checked without an AMD GPU: probe (every branch,
through its pure core), KFD topology parsing, offload-arch policy, platform facts, the
backend's composition with the CUDA backend, and plugin registration."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import platforms.cuda.build as cuda_build
import platforms.rocm.build as rocm_build
from core.attention import AttentionSpec
from core.platform import ProbeResult
from platforms.cuda.attention import CudaPagedAttention
from platforms.rocm.attention import RocmPagedAttention
from platforms.rocm.platform import (
    PROBE_SCORE,
    RocmPlatform,
    gfx_name,
    kfd_gpu_archs,
    probe_result,
)

ROOT = Path(__file__).resolve().parents[2]
KERNELS_OK = (True, "prebuilt extension platforms.rocm._C")


@pytest.mark.skipif(torch.version.hip is not None, reason="checks the non-ROCm torch message")
def test_probe_explains_a_torch_without_rocm():
    result = RocmPlatform.probe()
    assert result.score == 0
    assert "torch.version.hip is None" in result.reason
    assert ("CPU-only" if torch.version.cuda is None else "CUDA") in result.reason


def test_probe_does_not_initialise_the_device():
    code = (
        "import torch\n"
        "from platforms.rocm.platform import RocmPlatform\n"
        "RocmPlatform.probe()\n"
        "print(torch.cuda.is_initialized())\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_probe_without_a_visible_gpu():
    result = probe_result("6.2.41133", [], 0, KERNELS_OK)
    assert result.score == 0 and "no AMD GPU is visible" in result.reason


def test_probe_refuses_32_wide_gpus_with_the_reason():
    result = probe_result("6.2.41133", ["gfx1100"], 1, KERNELS_OK)
    assert result.score == 0
    assert "gfx1100" in result.reason and "64-wide wavefronts" in result.reason


def test_probe_reports_missing_kernels():
    why = "no prebuilt core_C extension and no hipcc to JIT-build csrc/"
    assert probe_result("6.2.41133", ["gfx90a"], 1, (False, why)) == ProbeResult(0, why)


def test_probe_accepts_cdna_and_names_what_it_found():
    result = probe_result("6.2.41133", ["gfx90a", "gfx90a"], 2, KERNELS_OK)
    assert result.score == PROBE_SCORE
    assert "2 AMD GPU(s)" in result.reason and "gfx90a" in result.reason
    mixed = probe_result("6.2.41133", ["gfx942", "gfx1100"], 2, KERNELS_OK)
    assert mixed.score == PROBE_SCORE and "HIP_VISIBLE_DEVICES" in mixed.reason


@pytest.mark.parametrize(
    "version,name",
    [(90008, "gfx908"), (90010, "gfx90a"), (90402, "gfx942"), (110000, "gfx1100"),
     (100300, "gfx1030")],
)
def test_gfx_names_from_kfd_target_versions(version, name):
    assert gfx_name(version) == name


def _kfd_node(root: Path, index: int, simds: int, target: int) -> None:
    node = root / str(index)
    node.mkdir(parents=True)
    node.joinpath("properties").write_text(
        f"cpu_cores_count {0 if simds else 64}\nsimd_count {simds}\nmem_banks_count 1\n"
        f"gfx_target_version {target}\nvendor_id {4098 if simds else 0}\n"
    )


def test_kfd_topology_lists_gpus_in_node_order(tmp_path):
    _kfd_node(tmp_path, 0, 0, 0)  # the CPU node
    _kfd_node(tmp_path, 2, 304, 90402)
    _kfd_node(tmp_path, 1, 440, 90010)
    _kfd_node(tmp_path, 10, 192, 110000)
    assert kfd_gpu_archs(tmp_path) == ["gfx90a", "gfx942", "gfx1100"]
    assert kfd_gpu_archs(tmp_path / "absent") == []


def test_offload_archs_must_be_wave64():
    assert rocm_build.check_offload_archs(["gfx90a", " gfx942:xnack-", ""]) == (
        "gfx90a", "gfx942:xnack-")
    with pytest.raises(ValueError, match=r"\['gfx1100'\].*PYTORCH_ROCM_ARCH"):
        rocm_build.check_offload_archs(["gfx90a", "gfx1100"])
    with pytest.raises(ValueError, match="no ROCm offload architecture"):
        rocm_build.check_offload_archs([""])


def test_rocm_builds_the_same_translation_units_as_cuda():
    assert rocm_build.CSRC_DIR == cuda_build.CSRC_DIR
    units = rocm_build.kernel_sources()
    assert units == cuda_build.kernel_sources()
    csrc = cuda_build.CSRC_DIR
    # every .cu of csrc, the op-registration .cpp files, nothing of the CPU extension
    assert set(csrc.rglob("*.cu")) <= set(units)
    assert {p.name for p in units if p.suffix == ".cpp"} >= {"torch_bindings.cpp", "ops_cuda.cpp"}
    assert not [p for p in units if p.relative_to(csrc).parts[0] == "cpu"]


def test_platform_facts():
    p = RocmPlatform()
    assert (p.name, p.device_type, p.dispatch_key) == ("rocm", "cuda", "CUDA")
    assert p.distributed_backend() == "nccl"
    assert p.supported_block_sizes() == (16, 32)
    assert p.supported_dtypes() == (torch.bfloat16, torch.float16, torch.float32)
    assert p.device_visibility_env == "HIP_VISIBLE_DEVICES"
    assert {"graph_capture", "device_memory", "pinned_host_memory"} <= p.capabilities
    assert p.verification == "never run"


def test_attention_backend_choice():
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=128, dtype=torch.bfloat16,
                         block_size=16)
    p = RocmPlatform()
    assert p.attention_backend_class(spec) is RocmPagedAttention
    assert p.attention_backend_class(spec, "rocm_paged") is RocmPagedAttention
    with pytest.raises(ValueError, match="not built into platform 'rocm'"):
        p.attention_backend_class(spec, "flash")


def test_kv_layout_is_the_cuda_kernels_layout():
    assert RocmPagedAttention.kv_cache_shape(7, 16, 8, 128) == (7, 2, 8, 16, 128)
    assert RocmPagedAttention.kv_cache_shape(7, 16, 8, 128) == CudaPagedAttention.kv_cache_shape(
        7, 16, 8, 128)


def test_unsupported_layer_is_refused_before_building_kernels():
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=96, dtype=torch.bfloat16,
                         block_size=16)
    with pytest.raises(ValueError, match="head size 96"):
        RocmPagedAttention(spec)


class RecordingOps:
    """Stands in for torch.ops.core_C and records which op got which tensors."""

    def __init__(self):
        self.calls = []

    def reshape_and_cache(self, *args):
        self.calls.append(("reshape_and_cache", args))


def test_backend_drives_the_cuda_backend_with_the_given_ops():
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float32,
                         block_size=16)
    ops = RecordingOps()
    backend = RocmPagedAttention(spec, ops=ops)
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(3, 2, 64, generator=g), torch.randn(3, 2, 64, generator=g)
    cache = backend.allocate_kv_cache(4, "cpu")
    slots = torch.tensor([17, -1, 40])
    backend.write_kv(key, value, cache, slots)
    assert len(ops.calls) == 1 and ops.calls[0][0] == "reshape_and_cache"
    args = ops.calls[0][1]
    assert args[0] is key and args[1] is value and args[2] is cache and args[3] is slots


def test_plugin_registers_through_the_public_hook():
    import platforms.rocm as plugin
    from core.plugins import Plugins

    plugins = Plugins()
    plugins.register(plugin, "rocm")
    assert plugins.platforms()["rocm"][1] is RocmPlatform


def test_entry_point_is_declared():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'rocm = "platforms.rocm"' in text.split('[project.entry-points."core.platforms"]')[1]
