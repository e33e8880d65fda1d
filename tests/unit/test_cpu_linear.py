"""CPU weight formats (``--weight-format int4 / int8``) in the parallel linear layers.

The references are independent: a plain float64 matmul with the weight dequantized by the
format's documented formula, computed here from the codes this test derives itself, and the
dense layer. Sharded layers (tensor parallel, ranks as threads) must equal one rank.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from core.models.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    load_checkpoint,
)
from platforms.cpu.linear import BucketedDense, Int4Codec, Int8Codec, QuantizedLinear, linear_method
from platforms.cpu.platform import CpuPlatform
from tests.helpers import cpu_context, run_ranks


def rand(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def q4_grid_weight(out_f: int, in_f: int, seed: int) -> torch.Tensor:
    """A weight on a GGUF Q4_1 grid: per 32 inputs, w = d * q + m with q in 0..15 (0 and 15
    both used, as llama.cpp's quantizer guarantees)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_f, in_f // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(out_f, in_f // 32, 1, generator=g) * 0.01 + 0.001
    m = -torch.rand(out_f, in_f // 32, 1, generator=g) * 0.1
    return (d * q + m).view(out_f, in_f)


def ctx(fmt: str, dtype=torch.bfloat16, comm=None):
    return dataclasses.replace(cpu_context(comm=comm, dtype=dtype), weight_format=fmt,
                               linear_method=linear_method(fmt))


def dequantized(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """The weight each format multiplies by, from its documented formula (float64)."""
    if fmt == "int8":  # symmetric per output row, bf16 scale
        scale = w.abs().amax(1, keepdim=True) / 127
        codes = torch.round(w / scale).clamp(-127, 127)
        return codes.double() * scale.bfloat16().double()
    out_f, in_f = w.shape  # int4: (code - 8) * scale + zero per 32 inputs, bf16 scale and zero
    wg = w.view(out_f, in_f // 32, 32)
    low, scale = wg.amin(-1), (wg.amax(-1) - wg.amin(-1)) / 15
    codes = torch.round((wg - low[..., None]) / scale[..., None])
    zero = (low + 8 * scale).bfloat16().double()
    return ((codes.double() - 8) * scale.bfloat16().double()[..., None] + zero[..., None]).view(out_f, in_f)


def test_int4_recovers_a_q4_grid_up_to_bf16_scales() -> None:
    w = q4_grid_weight(64, 128, seed=1)
    assert (dequantized("int4", w) - w.double()).abs().max() < 2e-3
    layer = ColumnParallelLinear(128, 64, ctx("int4", torch.float32))
    layer.load_weight("weight", w)
    x = rand(3, 128, seed=2).bfloat16()
    got = layer(x.float())  # a float32 model: activations go to the kernel as bf16
    want = x.double() @ dequantized("int4", w).T
    torch.testing.assert_close(got.double(), want, atol=1e-2 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_small_steps_use_the_quantized_weight_large_ones_the_dense(fmt: str) -> None:
    w = rand(96, 64, seed=3, scale=0.05)
    b = rand(96, seed=4)
    layer = ColumnParallelLinear(64, 96, ctx(fmt), bias=True)
    layer.load_weight("weight", w)
    layer.load_weight("bias", b)
    dense = ColumnParallelLinear(64, 96, ctx("dense"), bias=True)
    dense.load_weight("weight", w)
    dense.load_weight("bias", b)
    max_rows = layer.linear_method.codec.max_rows
    big = rand(max_rows + 1, 64, seed=5).bfloat16()
    torch.testing.assert_close(layer(big), dense(big), atol=0, rtol=0)  # dense path, bit-equal
    small = rand(2, 1, 64, seed=6).bfloat16()  # any leading shape
    got = layer(small)
    assert got.shape == (2, 1, 96) and got.dtype == torch.bfloat16
    # The format quantizes the dense weight as the layer holds it (bf16 here).
    want = small.double() @ dequantized(fmt, layer.weight.float()).T + b.double()
    # bf16 output rounding of (x W^T) and of the bias add: a few bf16 ulps of the result.
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=1e-2)
    assert not torch.equal(got, dense(small))  # it did not take the dense weight
    assert layer.packed_weight is not None


def test_loading_new_weights_repacks() -> None:
    layer = ColumnParallelLinear(64, 32, ctx("int8"))
    layer.load_weight("weight", rand(32, 64, seed=7))
    x = rand(1, 64, seed=8).bfloat16()
    first = layer(x)
    w2 = rand(32, 64, seed=9)
    layer.load_weight("weight", w2)
    assert layer.packed_weight is None
    second = layer(x)
    assert not torch.equal(first, second)
    want = x.double() @ dequantized("int8", layer.weight.float()).T
    torch.testing.assert_close(second.double(), want, atol=2e-2, rtol=1e-2)


def test_shapes_the_int4_kernel_cannot_pack_stay_dense() -> None:
    w = rand(24, 48, seed=10)  # 48 inputs: not whole groups of 32
    layer = RowParallelLinear(48, 24, ctx("int4"))
    layer.load_weight("weight", w)
    x = rand(1, 48, seed=11).bfloat16()
    torch.testing.assert_close(layer(x), F.linear(x, w.bfloat16()), atol=0, rtol=0)


def test_load_checkpoint_prepares_every_layer() -> None:
    from torch import nn

    class Mlp(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.gate_up_proj = MergedColumnParallelLinear(64, [32, 32], c)
            self.down_proj = RowParallelLinear(32, 64, c)

    class Tiny(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.mlp = Mlp(c)

    model = Tiny(ctx("int4"))
    weights = [("mlp.gate_proj.weight", rand(32, 64, seed=12)), ("mlp.up_proj.weight", rand(32, 64, seed=13)),
               ("mlp.down_proj.weight", rand(64, 32, seed=14))]
    stacked = [(".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1)]
    load_checkpoint(model, weights, stacked=stacked)
    assert model.mlp.gate_up_proj.packed_weight is not None
    assert model.mlp.down_proj.packed_weight is not None


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_tensor_parallel_shards_equal_one_rank(fmt: str) -> None:
    q, k, v = rand(4 * 32, 64, seed=15), rand(2 * 32, 64, seed=16), rand(2 * 32, 64, seed=17)
    down = rand(64, 128, seed=18)
    x = rand(1, 64, seed=19).bfloat16()

    def run(comm):
        qkv = QKVParallelLinear(64, 32, 4, 2, ctx(fmt, comm=comm))
        for shard, t in zip("qkv", (q, k, v)):
            qkv.load_weight("weight", t, shard)
        row = RowParallelLinear(128, 64, ctx(fmt, comm=comm))
        row.load_weight("weight", down)
        h = qkv(x)  # [1, this rank's q | k | v]
        y = row(torch.cat([h, h], dim=-1)[..., : row.input_size_per_rank])
        return h, y

    (h1, y1), = run_ranks(1, run)
    parts = run_ranks(2, run)
    # Rank r holds q heads [2r, 2r+2) and kv head r: the per-row quantization is the same.
    for r, (h, _) in enumerate(parts):
        qs, ks = slice(r * 64, (r + 1) * 64), slice(128 + r * 32, 128 + (r + 1) * 32)
        vs = slice(192 + r * 32, 192 + (r + 1) * 32)
        torch.testing.assert_close(h, torch.cat([h1[..., qs], h1[..., ks], h1[..., vs]], -1), atol=0, rtol=0)
    assert parts[0][1].shape == y1.shape == (1, 64)


def test_platform_offers_the_formats_and_names_them_on_a_bad_one() -> None:
    platform = CpuPlatform()
    assert set(platform.supported_weight_formats()) == {"dense", "int4", "int8"}
    dense = platform.linear_method("dense")
    assert isinstance(dense, BucketedDense) and dense.name == "dense"
    method = platform.linear_method("int4")
    assert isinstance(method, QuantizedLinear) and isinstance(method.codec, Int4Codec)
    assert isinstance(platform.linear_method("int8").codec, Int8Codec)
    with pytest.raises(ValueError, match="weight format 'q4' is not supported by platform 'cpu'; use one of"):
        platform.linear_method("q4")
