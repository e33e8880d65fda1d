"""The CUDA platform's host-side logic, checked without a GPU: probe, decode-kernel choice,
KV layout, spec validation and plugin registration."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.attention import AttentionSpec
from platforms.cuda.attention import (
    MIN_PARTITION_TOKENS,
    CudaPagedAttention,
    check_spec,
    choose_decode_partition,
    head_tiles,
)
from platforms.cuda.platform import CudaPlatform


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-only torch message")
def test_probe_explains_cpu_only_torch():
    result = CudaPlatform.probe()
    assert result.score == 0
    assert "CPU-only" in result.reason and "torch.version.cuda is None" in result.reason


def test_probe_does_not_initialise_cuda():
    # A fresh interpreter: in this one, other tests may already have initialised CUDA.
    code = (
        "import torch\n"
        "from platforms.cuda.platform import CudaPlatform\n"
        "CudaPlatform.probe()\n"
        "print(torch.cuda.is_initialized())\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_platform_facts():
    p = CudaPlatform()
    assert (p.name, p.device_type, p.dispatch_key) == ("cuda", "cuda", "CUDA")
    assert p.distributed_backend() == "nccl"
    assert p.supported_block_sizes() == (16, 32)
    assert p.supported_dtypes()[0] is torch.bfloat16
    assert p.device_visibility_env == "CUDA_VISIBLE_DEVICES"
    assert {"graph_capture", "device_memory", "pinned_host_memory"} <= p.capabilities


def test_kv_layout_holds_every_slot_once():
    shape = CudaPagedAttention.kv_cache_shape(7, 16, 8, 128)
    assert shape == (7, 2, 8, 16, 128)
    assert torch.Size(shape).numel() == 2 * 7 * 16 * 8 * 128


@pytest.mark.parametrize(
    "group,tiles", [(1, 1), (2, 1), (4, 1), (5, 1), (6, 1), (8, 1), (12, 2), (16, 2)]
)
def test_head_tiles(group, tiles):
    assert head_tiles(8 * group, 8) == tiles


H200_SMS = 132  # x CTAS_PER_SM = 264 resident decode CTAs


def test_small_batches_split_into_one_full_wave():
    # 1 x 8 kv heads: 33 partitions of 1008 tokens -> 264 CTAs, one per slot
    assert choose_decode_partition(1, 8, 1, 32768, H200_SMS) == 1008
    # 8 x 8: 4 partitions of 1024 -> 256 CTAs
    assert choose_decode_partition(8, 8, 1, 4096, H200_SMS) == 1024
    assert choose_decode_partition(8, 8, 1, 32768, H200_SMS) == 8192


def test_partitions_never_go_below_the_minimum():
    assert choose_decode_partition(1, 8, 1, 4096, H200_SMS) == MIN_PARTITION_TOKENS


def test_batches_that_fill_half_the_chip_take_v1():
    assert choose_decode_partition(64, 8, 1, 4096, H200_SMS) == 0
    assert choose_decode_partition(256, 8, 1, 32768, H200_SMS) == 0
    assert choose_decode_partition(17, 8, 1, 32768, H200_SMS) == 0  # 136 CTAs: 264 // 136 = 1


def test_contexts_within_one_partition_take_v1():
    assert choose_decode_partition(1, 8, 1, MIN_PARTITION_TOKENS, H200_SMS) == 0
    assert choose_decode_partition(1, 8, 1, 200, H200_SMS) == 0


def test_unsupported_spec_is_explained():
    spec = AttentionSpec(num_heads=6, num_kv_heads=4, head_size=96, dtype=torch.float64,
                         block_size=8)
    with pytest.raises(ValueError) as err:
        check_spec(spec)
    msg = str(err.value)
    for part in ("head size 96", "block size 8", "torch.float64", "6 query heads over 4"):
        assert part in msg


def test_bad_decode_partition_is_refused_before_loading_kernels():
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=128, dtype=torch.bfloat16,
                         block_size=16)
    with pytest.raises(ValueError, match="multiple of 16"):
        CudaPagedAttention(spec, decode_partition=100)


def test_plugin_registers_through_the_public_hook():
    import platforms.cuda as plugin
    from core.plugins import Plugins

    plugins = Plugins()
    plugins.register(plugin, "cuda")
    assert plugins.platforms()["cuda"][1] is CudaPlatform


def test_gemma2_is_served_on_gpus_and_head_sizes_still_checked():
    """Gemma 2 was refused on the GPU platforms while its H200 check failed; that failure was
    the reference (transformers 5.17's SDPA path drops the soft-cap), and with HF's eager
    attention as the reference the H200 matches (tests/cuda/test_cuda_gemma.py, 2026-12-02), so
    the GPU platforms take it, capped or not; a head size their kernels lack is still refused."""
    from types import SimpleNamespace

    from platforms.cuda.platform import CudaPlatform
    from platforms.rocm.platform import RocmPlatform

    def config(arch, cap, head=128):
        hf = SimpleNamespace(head_dim=head, attn_logit_softcapping=cap)
        return SimpleNamespace(
            cache=SimpleNamespace(block_size=16),
            model=SimpleNamespace(dtype="bfloat16", weight_format="dense", hf_config=hf,
                                  architecture=arch),
        )

    for platform in (CudaPlatform(), RocmPlatform()):
        for arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
            for cap in (50.0, None):
                assert platform.validate(config(arch, cap)).model.architecture == arch
        with pytest.raises(ValueError, match=r"head size is 16.*--platform cpu"):
            platform.validate(config("Gemma2ForCausalLM", 50.0, head=16))


def test_dense_weights_take_the_platforms_gemv_method_and_cpu_tensors_fall_back_to_torch():
    """The CUDA platform keeps dense weights with CudaDenseLinear (decode rows through
    csrc/gemv.cu, tested on the GPU in tests/cuda/test_cuda_gemv.py); quantized formats are
    untouched; off the GPU its apply is exactly F.linear. Its routing rule, case by case."""
    from platforms.cuda.gemv import CudaDenseLinear, dense_takes_gemv

    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    assert dense_takes_gemv(1, 4096, bf16, False, 9) and dense_takes_gemv(2, 8192, f16, False, 10)
    assert not dense_takes_gemv(3, 4096, bf16, False, 9)      # from 3 rows: cuBLAS
    assert not dense_takes_gemv(0, 4096, bf16, False, 9)      # no rows
    assert dense_takes_gemv(1, 14336, bf16, False, 9)         # down projection: split across warps
    assert not dense_takes_gemv(1, 16392, bf16, False, 9)     # longer inputs never measured: cuBLAS
    assert not dense_takes_gemv(1, 4096, f32, False, 9)       # fp32: cuBLAS
    assert not dense_takes_gemv(1, 4096, bf16, True, 9)       # a bias: cuBLAS rounds once
    assert not dense_takes_gemv(1, 4096, bf16, False, 8)      # no programmatic dependent launch

    method = CudaPlatform().linear_method("dense")
    assert isinstance(method, CudaDenseLinear) and method.name == "dense"
    with pytest.raises(ValueError, match="int4"):
        CudaPlatform().linear_method("int4")
    layer = torch.nn.Module()
    gen = torch.Generator().manual_seed(0)
    layer.weight = torch.nn.Parameter(torch.randn(24, 64, generator=gen).to(torch.bfloat16))
    x = torch.randn(1, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(24, generator=gen).to(torch.bfloat16)
    assert torch.equal(method.apply(layer, x, bias), torch.nn.functional.linear(x, layer.weight, bias))


def test_small_batches_split_sampler_rows_across_blocks():
    """platforms/cuda/sampling.py splits_for: blocks per row for the fused sampler (at most
    one block per SM over the launch, 32 a row, 2,048 vocabulary entries a block; one block
    per row, the whole-row kernel, otherwise)."""
    from platforms.cuda.sampling import splits_for

    llama3, h100 = 128256, 132
    assert [splits_for(r, llama3, h100) for r in (1, 4, 8, 16, 66, 67, 256)] == [32, 32, 16, 8, 2, 1, 1]
    assert splits_for(1, 32000, h100) == 15      # 2,048 entries a block at least
    assert splits_for(1, 3000, h100) == 1        # too small a vocabulary to share
    assert splits_for(0, llama3, h100) == 1
