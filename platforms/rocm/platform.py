"""The ROCm platform: AMD GPUs through a ROCm build of torch and the hipified csrc/ kernels.

PyTorch's ROCm build exposes HIP devices as torch device type ``cuda`` and drives HIP through
``torch.cuda``, so the device facts, memory logic (KV budget, peak memory), decode graphs and
runtime calls are those of the shared GPU platform (:mod:`platforms.gpu_platform`), which the
CUDA platform uses too. ROCm's own are the probe, the toolchain (hipify + hipcc,
:data:`platforms.rocm.build.HIPCC`) and the attention backend.

Nothing here touches the GPU at import time, and :meth:`RocmPlatform.probe` never
initialises HIP: it reads torch's build info, the kernel driver's topology in sysfs, and
whether the kernels can be loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from core.platform import ProbeResult
from platforms.gpu_platform import GpuPlatform
from platforms.rocm.attention import RocmPagedAttention
from platforms.rocm.build import HIPCC, WAVE64_ARCH_PREFIX

PROBE_SCORE = 100
"""Score when usable: above the CPU platform's. A torch build is either CUDA or ROCm, so this
never ties with the cuda platform."""
KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")
"""The amdgpu kernel driver's topology: one directory per CPU or GPU node."""


def gfx_name(target_version: int) -> str:
    """The gfx target name of KFD's ``gfx_target_version`` (major * 10000 + minor * 100 +
    stepping, minor and stepping written in hex): 90010 -> gfx90a, 110000 -> gfx1100."""
    major, rest = divmod(target_version, 10000)
    minor, stepping = divmod(rest, 100)
    return f"gfx{major}{minor:x}{stepping:x}"


def kfd_gpu_archs(nodes: Path = KFD_NODES) -> list[str]:
    """gfx names of the AMD GPUs the kernel driver lists, in node order; [] without a driver.

    Reads sysfs only. CPU nodes have no SIMDs and are skipped. HIP_VISIBLE_DEVICES is not
    applied: this lists what is installed.
    """
    try:
        entries = [p for p in nodes.iterdir() if p.name.isdigit()]
    except OSError:
        return []
    archs = []
    for node in sorted(entries, key=lambda p: int(p.name)):
        props = _read_properties(node / "properties")
        if props.get("simd_count", 0) > 0 and props.get("gfx_target_version", 0) > 0:
            archs.append(gfx_name(props["gfx_target_version"]))
    return archs


def _read_properties(path: Path) -> dict[str, int]:
    """KFD's ``name value`` lines as a dict; unreadable or non-integer lines are skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    props = {}
    for line in lines:
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            props[key] = int(value)
    return props


def visible_gpu_count(archs: list[str]) -> int:
    """AMD GPUs this process may use, without initialising HIP: amdsmi through torch (which
    honours HIP_VISIBLE_DEVICES) when installed, else every GPU the driver lists."""
    try:
        count = torch.cuda._device_count_amdsmi()
    except Exception:  # torch without the helper, or a broken amdsmi: fall back
        count = -1
    return count if count >= 0 else len(archs)


def probe_result(
    hip_version: str | None, archs: list[str], visible: int, kernels: tuple[bool, str]
) -> ProbeResult:
    """The probe's verdict from the facts it gathered (pure, so every branch is testable).

    :param hip_version: ``torch.version.hip`` (None: not a ROCm build of torch)
    :param archs: gfx names of the installed GPUs (see :func:`kfd_gpu_archs`)
    :param visible: GPUs this process may use
    :param kernels: :func:`platforms.rocm.build.kernels_status`
    """
    if not hip_version:
        build = "CUDA" if torch.version.cuda else "CPU-only"
        return ProbeResult(
            0,
            f"torch {torch.__version__} is a {build} build (torch.version.hip is None); "
            "install a ROCm build of torch to use the rocm platform",
        )
    if visible == 0:
        return ProbeResult(
            0,
            f"torch {torch.__version__} supports ROCm (HIP {hip_version}) but no AMD GPU is "
            "visible (no amdgpu driver, no device, or HIP_VISIBLE_DEVICES hides them)",
        )
    usable = [a for a in archs if a.startswith(WAVE64_ARCH_PREFIX)]
    if archs and not usable:
        return ProbeResult(
            0,
            f"found AMD GPU(s) {archs}, but the csrc/ kernels need 64-wide wavefronts, which "
            "HIP offers on gfx9 (CDNA: MI100/MI200/MI300) only; run with --platform cpu",
        )
    ok, how = kernels
    if not ok:
        return ProbeResult(0, how)
    found = f"{visible} AMD GPU(s) {usable or '(architecture unknown)'}"
    if len(usable) < len(archs):
        others = [a for a in archs if a not in usable]
        found += f"; {others} cannot run the kernels: hide them with HIP_VISIBLE_DEVICES"
    return ProbeResult(
        PROBE_SCORE, f"{found}, torch {torch.__version__} (HIP {hip_version}); kernels: {how}"
    )


class RocmPlatform(GpuPlatform):
    """AMD GPUs (CDNA): the shared GPU platform with the hipified csrc/ kernels."""

    name = "rocm"
    verification = "never run"  # compiled for gfx90a with hipcc only: docs/platforms.md
    device_visibility_env = "HIP_VISIBLE_DEVICES"
    toolchain = HIPCC
    paged_attention = RocmPagedAttention

    @classmethod
    def probe(cls) -> ProbeResult:
        hip = getattr(torch.version, "hip", None)
        if not hip:
            return probe_result(hip, [], 0, (False, ""))
        archs = kfd_gpu_archs()
        return probe_result(hip, archs, visible_gpu_count(archs), cls.toolchain.kernels_status())

    def ops(self) -> dict[str, Any]:
        """None: the hipified twins of the fused element-wise kernels have never run, so
        ROCm keeps core's torch ops."""
        return {}

    @classmethod
    def quantization_methods(cls) -> dict[str, Any]:
        # The CUDA platform's quantized kernels are not built or checked for HIP (its fp8
        # is e4m3fnuz on MI300): quantized checkpoints load dequantized here.
        return dict.fromkeys(("fp8", "compressed-tensors", "awq", "gptq", "gguf"))

    @classmethod
    def kv_cache_dtypes(cls) -> tuple[str, ...]:
        # The fp8 cache kernels are not built for HIP (MI300's native fp8 is e4m3fnuz, not the
        # e4m3fn the cache stores): --kv-cache-dtype fp8 is refused here at start.
        return ()
