"""The CUDA quantized linears (platforms/cuda/quant.py, csrc/quant) against the plain-torch
reference on fresh random inputs.

* ``core_C.quant_gemv`` (1..16 rows) and ``core_C.quant_dequant`` for int4 (with and without
  mins, groups of 32, 96 and 128), int8 (groups of 32 and 96) and fp8 (per-row and 128-input groups) weights, fp16 /
  bf16 / fp32 activations, on tensor cores (fp8; int4 with integer zero points) and CUDA
  cores, against ``x @ W.T`` with W dequantized by
  :meth:`IntWeight.dequantize` / :meth:`Fp8Weight.dequantize` in float64 (the dequantization
  itself must be exact: fp32 on both sides);
* ``CudaQuantizedLinear`` end to end through ``pack``/``matmul`` for decode and prefill sizes,
  including the ``torch._scaled_mm`` FP8 path (dynamic per-token and per-token-group
  activation scales) and GPTQ act-order;
* a tiny AWQ / GPTQ / fp8-block Llama and the embedded SmolLM2 GGUF through the engine on
  ``--platform cuda``: greedy tokens, and the teacher-forced top-1 token at every prompt
  position, against the same checkpoint on the CPU platform (dequantized, fp32; for fp8-block
  with prompt activations rounded to fp8 as the device's W8A8 prefill does), rates printed.

Run on the GPU machine:
``PYTHONPATH=. python3 -m pytest -q -s tests/cuda/test_cuda_quant.py``.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from core.quantization.fp8 import Fp8Method
from core.quantization.tensors import Fp8Weight, IntWeight, quantize_fp8_rows
from platforms.cuda.quant import FP8, INT4, INT8, CudaQuantizedLinear, _pack, dequantize_packed

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DEV = torch.device("cuda")


def int_weight(rows, cols, bits, group, mins, gen, perm=False) -> IntWeight:
    if bits == 4:
        codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    else:
        codes = torch.randint(-127, 128, (rows, cols), generator=gen).to(torch.int8)
    scales = torch.rand(rows, cols // group, generator=gen) * 0.02 + 0.001
    m = torch.randn(rows, cols // group, generator=gen) * 0.05 if mins else None
    p = torch.randperm(cols, generator=gen) if perm else None
    return IntWeight(bits, codes, scales, m, group, p)


def fp8_weight(rows, cols, group, gen) -> Fp8Weight:
    w = quantize_fp8_rows(torch.randn(rows, cols, generator=gen))
    if group == cols:
        return w
    scales = torch.rand(rows, -(-cols // group), generator=gen) + 0.5
    return Fp8Weight(w.codes, scales, group)


def linear(dtype: torch.dtype) -> CudaQuantizedLinear:
    return CudaQuantizedLinear(Fp8Method.from_config(None), dtype)  # matmul reads only the packed weight


def reference(x: torch.Tensor, w) -> torch.Tensor:
    return x.double() @ w.dequantize(torch.float64).to(x.device).T


def check(got, want, dtype, k):
    assert not torch.isnan(got).any()
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype] * max(1.0, (k / 4096) ** 0.5)
    scale = want.abs().amax().item() + 1e-6
    torch.testing.assert_close(got.double() / scale, want.double() / scale, rtol=0, atol=tol)


CASES = [  # (code, bits, group, mins): 1-8 code vectors per group, and 3 and 6 (not powers of two)
    ("int4-g128-mins", 4, 128, True),
    ("int4-g32-mins", 4, 32, True),
    ("int4-g128-sym", 4, 128, False),
    ("int8-g32", 8, 32, False),
    ("int4-g96-mins", 4, 96, True),
    ("int8-g96", 8, 96, False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,bits,group,mins", CASES)
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_gemv_and_dequant_integer_codes(dtype, name, bits, group, mins, m):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{m}/{dtype}".encode()))
    n, k = 384, 1024 if 1024 % group == 0 else 1152
    w = int_weight(n, k, bits, group, mins, gen)
    packed = _pack(w, DEV)
    assert packed is not None and packed.code == (INT4 if bits == 4 else INT8)
    assert torch.equal(dequantize_packed(packed, torch.float32).cpu(), w.dequantize())
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEV)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    from platforms.cuda.build import load_ops

    load_ops().quant_gemv(out, x, packed.codes, packed.scales, packed.mins, packed.code, packed.group)
    check(out, reference(x, w), dtype, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1024, 128])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_gemv_and_dequant_fp8_codes(dtype, group, m):
    gen = torch.Generator().manual_seed(group + m)
    n, k = 256, 1024
    w = fp8_weight(n, k, group, gen)
    packed = _pack(w, DEV)
    assert packed.code == FP8
    assert torch.equal(dequantize_packed(packed, torch.float32).cpu(), w.dequantize())
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEV)
    y = linear(dtype).matmul(packed, x, None)
    check(y, reference(x, w), dtype, k)


def _gemv(packed, x, tensor_cores: bool, zeros=None) -> torch.Tensor:
    """core_C.quant_gemv on the packed weight (its mins; ``zeros`` as given)."""
    from platforms.cuda.build import load_ops

    out = torch.full((x.shape[0], packed.codes.shape[0]), float("nan"), dtype=x.dtype, device=DEV)
    load_ops().quant_gemv(out, x, packed.codes, packed.scales, packed.mins, packed.code, packed.group, tensor_cores,
                          zeros)
    return out


_fp8_gemv = _gemv


# (n, k, group): an odd number of 16-row tiles (208: the platform packs only n % 16 == 0);
# split K from 1 warp per tile (n = 2048) to 8 (n = 64, k = 14,336); k % 128 != 0 (1,056)
# keeps the CUDA cores.
FP8_GEMV_SHAPES = [(256, 1024, 1024), (256, 1024, 128), (208, 4096, 4096), (2048, 4096, 128),
                   (64, 14336, 14336), (96, 1056, 1056)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group", FP8_GEMV_SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
def test_fp8_gemv_tensor_cores_and_cuda_cores_match_the_reference(dtype, n, k, group, m):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{n}/{k}/{group}/{m}/{dtype}".encode()))
    w = fp8_weight(n, k, group, gen)
    packed = _pack(w, DEV)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEV)
    want = reference(x, w)
    for tensor_cores in (True, False):
        got = _fp8_gemv(packed, x, tensor_cores)
        check(got, want, dtype, k)
    # The split-K sums are added in a fixed order: the same inputs give the same bits.
    assert torch.equal(_fp8_gemv(packed, x, True), _fp8_gemv(packed, x, True))


def test_fp8_gemv_tensor_cores_take_the_range_of_bf16_activations():
    """bf16 activations enter the tensor cores as fp16 times a power of two chosen per 128
    inputs: rows far outside fp16's range (1e6, massive channels of 6,000, a row of 1e-4,
    a row of 1e-30) must come through at the same accuracy as ordinary ones."""
    gen = torch.Generator().manual_seed(7)
    n, k = 256, 4096
    w = fp8_weight(n, k, k, gen)
    packed = _pack(w, DEV)
    x = torch.randn(4, k, generator=gen)
    x[0, ::97] = 6000.0  # a few massive channels
    x[1] *= 1e-4  # a whole row of tiny activations
    x[2, :8] = torch.tensor([1e6, -2e5, 65504.0, 7e4, 1e-3, -3e-3, 2.0**-9, -(2.0**-9)])
    x[3] *= 1e-30
    x = x.to(torch.bfloat16).to(DEV)
    want = reference(x, w)
    got = _fp8_gemv(packed, x, True)
    for row in range(4):  # each row on its own scale
        check(got[row : row + 1], want[row : row + 1], torch.bfloat16, k)


def zero_point_weight(rows, cols, group, gen, zmax=15, scales=None) -> tuple[IntWeight, torch.Tensor]:
    """An AWQ / GPTQ-style int4 weight: codes 0..15, integer zero points z in 0..zmax per
    group and ``min = -z * s`` (exact, as core/quantization/int4.py restates them); and z."""
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    if scales is None:
        scales = torch.rand(rows, cols // group, generator=gen) * 0.02 + 0.001
    z = torch.randint(0, zmax + 1, (rows, cols // group), generator=gen).float()
    return IntWeight(4, codes, scales, -(z * scales), group), z


# (n, k, group): odd numbers of 16-row tiles (208, 96), split K from 1 warp per tile (2,048
# rows) to 8 (64 rows of 14,336), trips not a multiple of the split (4,608: 18 trips over 4
# warps), one group per row (1,024), groups of 256 and of 384 (three half-trips: an inexact
# reciprocal in the group lookup); k % 256 != 0 (1,152) keeps the CUDA cores.
INT4_GEMV_SHAPES = [(384, 1024, 128), (208, 4096, 128), (2048, 4096, 128), (64, 14336, 128), (256, 1024, 1024),
                    (96, 2048, 256), (64, 4608, 128), (96, 3072, 384), (96, 1152, 128),
                    (2176, 8192, 256)]  # > 2^24 codes: tensor cores at one row too (added in session 17,
                                        # after the last GPU run of this file)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group", INT4_GEMV_SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("zeros", ["none", "4-bit", "7-bit"])
def test_int4_gemv_tensor_cores_and_cuda_cores_match_the_reference(dtype, n, k, group, m, zeros):
    """int4 codes with no mins (z = 0), zero points of 4 bits (AWQ, GPTQ) and up to 127 (the
    largest the tensor cores take exactly): the zero points are found at packing, both
    kernels agree with the float64 product, and the tensor cores' split sums are deterministic."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{n}/{k}/{group}/{m}/{dtype}/{zeros}".encode()))
    if zeros == "none":
        w = int_weight(n, k, 4, group, False, gen)
    else:
        w, z = zero_point_weight(n, k, group, gen, zmax=15 if zeros == "4-bit" else 127)
    packed = _pack(w, DEV)
    if zeros != "none" and k % 256 == 0:
        assert packed.zeros is not None and torch.equal(packed.zeros.cpu(), z.to(torch.uint8))
    elif zeros != "none":  # rows of part trips: the tensor cores cannot take them, no zero points kept
        assert packed.zeros is None
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEV)
    want = reference(x, w)
    for tensor_cores in (True, False):
        check(_gemv(packed, x, tensor_cores, packed.zeros), want, dtype, k)
    assert torch.equal(_gemv(packed, x, True, packed.zeros), _gemv(packed, x, True, packed.zeros))
    # the platform's linear takes the same path
    check(linear(dtype).matmul(packed, x, None), want, dtype, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tensor_cores", [True, False])
@pytest.mark.parametrize("n,k", [(256, 2048), (2304, 8192)])
def test_int4_gemv_is_exact_where_the_sums_are(dtype, tensor_cores, n, k):
    """Small integer activations and power-of-two scales make every product and every fp32
    sum exact, so both kernels must return the float64 product rounded once, bit for bit: a
    code multiplied with any other input than its own (the tensor cores pair codes and
    activations by permutation) would show. 2,304 x 8,192 (more than 2^24 codes) takes the
    tensor cores at one row too."""
    gen = torch.Generator().manual_seed(11 + k)
    group = 128
    scales = 2.0 ** -torch.randint(4, 9, (n, k // group), generator=gen).float()
    w, _ = zero_point_weight(n, k, group, gen, scales=scales)
    packed = _pack(w, DEV)
    assert packed.zeros is not None
    for m in (1, 5, 16):
        x = torch.randint(-3, 4, (m, k), generator=gen).to(dtype).to(DEV)
        # every partial sum is a multiple of 2^-8 below k * 15 * 3 * 2^-4 = 23,040 (k 8,192):
        # under 2^24 units, exact in fp32 in any order
        want = reference(x, w)
        got = _gemv(packed, x, tensor_cores, packed.zeros)
        assert torch.equal(got, want.to(dtype)), (m, (got.double() - want).abs().max().item())


@pytest.mark.parametrize("before", ["rms_norm", "torch"])
@pytest.mark.parametrize("kind,m", [("fp8", 1), ("fp8", 4), ("fp8", 16), ("int4", 1), ("int4", 4), ("int4-mins", 4)])
def test_gemv_waits_for_the_kernel_that_writes_x(kind, m, before):
    """Every GEMV is launched to overlap the kernel before it (programmatic dependent launch)
    and reads x only after waiting for it: captured in one CUDA graph after the kernel that
    writes x (core_C's RMSNorm, which lets its dependents start early, or a torch kernel,
    which does not), each replay with new inputs must give that replay's product, never one
    of a stale or half-written x. Covers the CUDA-core kernel (one row; free mins at four
    rows), the fp8 tensor cores at 4 and 16 rows and the int4 ones at 4."""
    from platforms.cuda.ops import rms_norm

    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}/{m}/{before}".encode()))
    n, k, dtype = 1024, 4096, torch.bfloat16
    if kind == "fp8":
        w = fp8_weight(n, k, k, gen)
    elif kind == "int4":
        w, _ = zero_point_weight(n, k, 128, gen)
    else:  # free mins: the CUDA cores at every row count
        w = int_weight(n, k, 4, 128, True, gen)
    packed = _pack(w, DEV)
    norm_w = (torch.rand(k, generator=gen) + 0.5).to(dtype).to(DEV)
    x_in = torch.empty(m, k, dtype=dtype, device=DEV)
    y = torch.empty(m, n, dtype=dtype, device=DEV)
    from platforms.cuda.build import load_ops

    def step():  # the GEMV directly after the kernel that writes x (no allocation between)
        x = rms_norm(x_in, norm_w, 1e-6) if before == "rms_norm" else x_in * 3.0
        load_ops().quant_gemv(y, x, packed.codes, packed.scales, packed.mins, packed.code, packed.group, True,
                              packed.zeros)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x_in.copy_(torch.randn(m, k, generator=gen).to(dtype))
        step()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(20):
        x_in.copy_(torch.randn(m, k, generator=gen).to(dtype).to(DEV))
        graph.replay()
        xr = x_in.float()
        if before == "rms_norm":
            xr = (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.float()).to(dtype)
        else:
            xr = (xr * 3.0).to(dtype)
        check(y, reference(xr, w), dtype, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [2, 9])
def test_int4_tensor_cores_cover_a_partial_last_tile(dtype, m):
    """200 rows (the op takes any row count; the platform packs multiples of 16): the last
    16-row tile's rows past n recompute row n - 1 and are never written."""
    gen = torch.Generator().manual_seed(m)
    k, group = 1024, 128
    w, _ = zero_point_weight(208, k, group, gen)
    packed = _pack(w, DEV)
    n = 200
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEV)
    from platforms.cuda.build import load_ops

    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    load_ops().quant_gemv(out, x, packed.codes[:n], packed.scales[:n], packed.mins[:n], packed.code, group, True,
                          packed.zeros[:n])
    check(out, reference(x, w)[:, :n], dtype, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_int4_tensor_cores_split_k_on_a_wide_grid(dtype, m):
    """12,288 rows of 4,096 inputs: 768 tiles, which the int4 kernel's limit of 8,192 warps
    (kInt4MmaMaxWarps, csrc/quant/quant_gemm.cu) splits over four warps each, where the limit
    of 2,048 kept two (Llama-3-8B's gate/up projection, 1,792 tiles, goes from one to four).
    The split sums against the reference, and added in a fixed order: the same bits twice."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"wide/{m}/{dtype}".encode()))
    n, k, group = 12288, 4096, 128
    w, _ = zero_point_weight(n, k, group, gen)
    packed = _pack(w, DEV)
    assert packed.zeros is not None
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEV)
    got = _gemv(packed, x, True, packed.zeros)
    check(got, reference(x, w), dtype, k)
    assert torch.equal(got, _gemv(packed, x, True, packed.zeros))


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0),
                    reason="the tensor-core kernels need sm_80+ (below, every row takes the CUDA cores)")
def test_int4_tensor_cores_take_the_zero_points_where_they_apply():
    """quant_gemv's zeros restate its mins. Given zeros that contradict the mins, the result
    shows which kernel ran: the tensor cores follow the zeros (fp16 / bf16, k % 256 == 0,
    groups of 128 or more, 2+ rows or more than 2^24 codes), the CUDA cores the mins
    (tensor_cores False, fp32, k % 256 != 0, groups of 32, one row of up to 2^24 codes)."""
    gen = torch.Generator().manual_seed(5)
    for m, n, k, group, dtype, tensor_cores, follows in [
        (2, 128, 1024, 128, torch.bfloat16, True, "zeros"),
        (2, 128, 1024, 128, torch.float16, True, "zeros"),
        (1, 4112, 4096, 128, torch.bfloat16, True, "zeros"),
        (1, 4096, 4096, 128, torch.bfloat16, True, "mins"),
        (1, 128, 1024, 128, torch.bfloat16, True, "mins"),
        (2, 128, 1024, 128, torch.bfloat16, False, "mins"),
        (2, 128, 1024, 128, torch.float32, True, "mins"),
        (2, 128, 1152, 128, torch.bfloat16, True, "mins"),
        (2, 128, 1024, 32, torch.bfloat16, True, "mins"),
    ]:
        w, z = zero_point_weight(n, k, group, gen)
        other = (z + 3) % 16  # contradicts the mins
        w_other = IntWeight(4, w.codes, w.scales, -(other * w.scales), group)
        packed = _pack(w, DEV)
        x = torch.randn(m, k, generator=gen).to(dtype).to(DEV)
        got = _gemv(packed, x, tensor_cores, other.to(torch.uint8).to(DEV))
        check(got, reference(x, w_other if follows == "zeros" else w), dtype, k)


@pytest.mark.parametrize("group", [1024, 128])
@pytest.mark.parametrize("m", [17, 33, 200])
@pytest.mark.parametrize("path", ["platform", "dequantized"])
def test_fp8_prefill_through_scaled_mm(group, m, path):
    """torch._scaled_mm with activations quantized per token (per token and 128 inputs for
    128-input weight groups): within the error of one fp8 rounding of the activations (at
    most 2^-4 relative per element, ~2-3 % over a row). Block-scaled weights take
    _scaled_mm with the rows padded to the alignment the one-time probe found
    (platforms.cuda.quant.block_scaled_rows; the H200 refused 17 unpadded rows), or the
    dequantized GEMM where the probe found none; ``dequantized`` forces that fallback."""
    import dataclasses

    from platforms.cuda.quant import block_scaled_rows

    gen = torch.Generator().manual_seed(m * group)
    n, k = 512, 1024
    w = fp8_weight(n, k, group, gen)
    packed = _pack(w, DEV)
    if group == 128:
        print(f"\nblock-scaled fp8 prefill: row alignment {block_scaled_rows(DEV)} (0: dequantized)")
    if path == "dequantized":
        packed = dataclasses.replace(packed, scale_b=None)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV)
    y = linear(torch.bfloat16).matmul(packed, x, bias)
    assert y.shape == (m, n)
    want = reference(x, w) + bias.double()
    rel = (y.double() - want).norm() / want.norm()
    assert rel < (0.05 if packed.scale_b is not None else 0.01), float(rel)
    if packed.scale_b is not None:
        # the same math on the host: the activations' fp8 codes (per token, and per 128 inputs
        # for block-scaled weights) are exact, so only the GEMM's fp32 accumulation order and
        # the bf16 output differ (~2^-9 per element)
        want = reference(_fp8_activations(x.float().cpu(), 128 if group == 128 else k), w) + bias.double().cpu()
        rel = (y.double().cpu() - want).norm() / want.norm()
        print(f"\nW8A8 group {group}, {m} rows: {float(rel):.2e} from the host's W8A8")
        assert rel < 0.006, float(rel)


def _fp8_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] fp32 rounded to e4m3 per token and ``group`` inputs (scale = max|x| / 448, as
    the format's dynamic activation scales are defined), returned dequantized in fp32."""
    m, k = x.shape
    g = x.view(m, k // group, group)
    scale = g.abs().amax(dim=2, keepdim=True).clamp(min=1e-12) / 448.0
    codes = (g / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (codes.float() * scale).view(m, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("m,k,pad", [(1, 256, 0), (17, 4096, 111), (200, 1024, 56), (64, 14336, 0), (3, 384, 13)])
def test_fused_fp8_activations_match_the_torch_ops(dtype, group, m, k, pad):
    """core_C.quant_fp8_activations against platforms/cuda/quant.py's torch ops: the same
    codes and scales bit for bit, on rows of very different magnitudes (one all zero), from a
    strided view (a fused projection's slice), padding rows included."""
    from platforms.cuda.quant import quantize_rows_fp8, quantize_rows_fp8_fused

    gen = torch.Generator().manual_seed(m * k + (group or 0))
    wide = torch.randn(m, k + 24, generator=gen) * torch.exp(torch.randn(m, 1, generator=gen) * 2).clamp(max=1e3)
    wide[m // 2] = 0.0
    x = wide.to(dtype).to(DEV)[:, 8 : 8 + k]  # rows 16-byte aligned, not contiguous
    codes, scales = quantize_rows_fp8_fused(x, group, m + pad)
    want_codes, want_scales = quantize_rows_fp8(torch.nn.functional.pad(x, (0, 0, 0, pad)), group)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (m + pad, k)
    assert scales.shape == want_scales.shape
    # the same memory layout (strides of size-1 dimensions mean nothing)
    assert [st for n, st in zip(scales.shape, scales.stride()) if n > 1] == \
        [st for n, st in zip(want_scales.shape, want_scales.stride()) if n > 1]
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales)


def test_fused_fp8_activations_refuse_what_they_cannot_take():
    from platforms.cuda.build import load_ops

    ops = load_ops()
    x = torch.randn(4, 200, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="group 128 must be k"):
        ops.quant_fp8_activations(torch.empty(4, 200, dtype=torch.uint8, device=DEV),
                                  torch.empty(4, device=DEV), x, 128)
    with pytest.raises(RuntimeError, match="scales"):
        ops.quant_fp8_activations(torch.empty(4, 200, dtype=torch.uint8, device=DEV),
                                  torch.empty(3, device=DEV), x, 200)


def test_block_scaled_probe_accepts_the_h200():
    """The probe's verdict on this GPU (a regression guard: the H200 should keep the fast
    path once rows are padded; if this fails, prefill still works, dequantized)."""
    from platforms.cuda.quant import block_scaled_rows

    assert block_scaled_rows(DEV) in (4, 16, 128)


@pytest.mark.parametrize("m", [1, 12, 64])
def test_int4_act_order_and_prefill_through_the_linear_method(m):
    gen = torch.Generator().manual_seed(m)
    n, k = 256, 512
    w = int_weight(n, k, 4, 128, True, gen, perm=True)
    packed = _pack(w, DEV)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    y = linear(torch.bfloat16).matmul(packed, x, None)
    check(y, reference(x, w), torch.bfloat16, k)


def test_the_gemv_refuses_what_it_cannot_take():
    from platforms.cuda.build import load_ops

    gen = torch.Generator().manual_seed(1)
    w = int_weight(16, 1024, 8, 32, False, gen)
    packed = _pack(w, DEV)
    x = torch.randn(1, 1024, generator=gen).to(torch.bfloat16).to(DEV)
    out = torch.empty(1, 16, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(RuntimeError, match="mins are taken with int4 codes only"):
        load_ops().quant_gemv(out, x, packed.codes, packed.scales, torch.zeros_like(packed.scales),
                              packed.code, packed.group)
    k, group = 1_572_864, 786_432  # two groups of 1.5 M / 2 inputs: past the 32-bit group lookup
    codes = torch.zeros(16, k, dtype=torch.uint8, device=DEV)
    scales = torch.ones(16, 2, device=DEV)
    with pytest.raises(RuntimeError, match="must stay below 2"):
        load_ops().quant_gemv(out, torch.zeros(1, k, dtype=torch.bfloat16, device=DEV), codes, scales, None,
                              INT8, group)


EPILOGUE_WEIGHTS = [  # (name, kind, group, mins): what a decode row meets at batch 1
    ("awq", "int4", 128, True), ("gguf-q4_0", "int4", 32, True), ("sym-int4", "int4", 128, False),
    ("q8_0", "int8", 32, False), ("fp8-rows", "fp8", None, False), ("fp8-block", "fp8", 128, False),
]


def _epilogue_weight(kind, rows, cols, group, mins, gen):
    if kind == "fp8":
        return fp8_weight(rows, cols, group or cols, gen)
    return int_weight(rows, cols, 4 if kind == "int4" else 8, group, mins, gen)


def _plain(x, p):
    from platforms.cuda.build import load_ops

    out = torch.empty(1, p.codes.shape[0], dtype=x.dtype, device=DEV)
    load_ops().quant_gemv(out, x, p.codes, p.scales, p.mins, p.code, p.group, False, p.zeros)  # CUDA cores
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,kind,group,mins", EPILOGUE_WEIGHTS)
@pytest.mark.parametrize("d", [512, 776])
def test_quant_gemv_silu_and_mul_is_the_kernel_then_silu_and_mul(dtype, name, kind, group, mins, d):
    """One decode row through a [gate | up] quantized weight with SiLU-and-mul in the GEMV's
    epilogue: bit for bit the CUDA-core GEMV (each row summed the same way) followed by the
    platform's silu_and_mul kernel, and within the dtype's rounding of the float64 reference."""
    from platforms.cuda.build import load_ops
    from platforms.cuda.ops import silu_and_mul

    gen = torch.Generator().manual_seed(zlib.crc32(f"silu/{name}/{dtype}/{d}".encode()))
    k = 1024
    w = _epilogue_weight(kind, 2 * d, k, group, mins, gen)
    p = _pack(w, DEV)
    x = (torch.randn(1, k, generator=gen) / (256 if kind == "fp8" else 1)).to(dtype).to(DEV)  # fp8: fp16's range
    got = torch.full((1, d), float("nan"), dtype=dtype, device=DEV)
    load_ops().quant_gemv(got, x, p.codes, p.scales, p.mins, p.code, p.group, True, p.zeros, True)
    assert torch.equal(got, silu_and_mul(_plain(x, p)))
    ref = reference(x, w)
    check(got, torch.nn.functional.silu(ref[:, :d]) * ref[:, d:], dtype, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,kind,group,mins", EPILOGUE_WEIGHTS)
@pytest.mark.parametrize("rot", [128, 64])
def test_quant_gemv_rope_is_the_kernel_then_rotary_embedding(dtype, name, kind, group, mins, rot):
    """One decode row through a fused QKV quantized weight rotating its query and key heads in
    the epilogue: value heads and unrotated features exactly the CUDA-core GEMV's; rotated
    features the platform's rotary_embedding on that GEMV's output to one rounding step (the
    compiler may contract the rotation's products differently), most of them bit for bit."""
    from core.models.rope import cos_sin_table
    from platforms.cuda.build import load_ops
    from platforms.cuda.ops import rotary_embedding

    gen = torch.Generator().manual_seed(zlib.crc32(f"rope/{name}/{dtype}/{rot}".encode()))
    heads, kv_heads, d, k = 4, 2, 128, 1024
    n = (heads + 2 * kv_heads) * d
    p = _pack(_epilogue_weight(kind, n, k, group, mins, gen), DEV)
    x = torch.randn(1, k, generator=gen).to(dtype).to(DEV)
    positions = torch.randint(0, 4096, (1,), generator=gen).to(DEV)
    cs = cos_sin_table(rot, {"rope_type": "default", "rope_theta": 500000.0}, 4096).to(DEV)
    got = torch.full((1, n), float("nan"), dtype=dtype, device=DEV)
    load_ops().quant_gemv_rope(got, x, p.codes, p.scales, p.mins, p.code, p.group, p.zeros, positions, cs,
                               heads + kv_heads, d, rot)
    plain = _plain(x, p)
    q, kk, v = plain.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q_rot, k_rot = rotary_embedding(positions, q.reshape(1, heads, d), kk.reshape(1, kv_heads, d), cs, rot)
    assert torch.equal(got[:, (heads + kv_heads) * d:], v)
    heads_got = got[:, : (heads + kv_heads) * d].reshape(1, heads + kv_heads, d)
    heads_want = torch.cat([q_rot.reshape(1, -1), k_rot.reshape(1, -1)], dim=-1).reshape(1, heads + kv_heads, d)
    assert torch.equal(heads_got[..., rot:], heads_want[..., rot:])
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(heads_got.float(), heads_want.float(), rtol=eps, atol=eps)
    assert (heads_got == heads_want).float().mean() > 0.99


def _awq_weight(rows, cols, gen) -> IntWeight:
    """int4 in groups of 128 with integer zero points (AWQ's form): the tensor cores take it."""
    w = int_weight(rows, cols, 4, 128, False, gen)
    z = torch.randint(0, 16, w.scales.shape, generator=gen).float()
    return IntWeight(4, w.codes, w.scales, -z * w.scales, 128)


def _sliced(p, rows):
    """The first `rows` rows of a packed weight (the op takes any even row count; _pack only
    multiples of 16)."""
    return [None if t is None else t[:rows].contiguous() for t in (p.codes, p.scales, p.mins, p.zeros)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_quant_epilogues_cover_a_last_cta_of_fewer_pairs(dtype, kind):
    """Pairs not a multiple of a CTA's four: 518 SiLU pairs (rows 1,036) and 514 rotary pairs
    (six rotated heads of 128, then 260 value rows); the last CTA's idle warps write nothing.
    SiLU: the plain GEMV's outputs rounded as silu_and_mul_kernel rounds them (torch's exp to one
    rounding step); rope: values and the unrotated tail bit for bit, the rotation as above."""
    from core.models.rope import cos_sin_table
    from platforms.cuda.build import load_ops
    from platforms.cuda.ops import rotary_embedding

    gen = torch.Generator().manual_seed(zlib.crc32(f"tail/{kind}/{dtype}".encode()))
    k, ops = 1024, load_ops()
    p = _pack(_epilogue_weight(kind, 1040, k, 128, kind == "int4", gen), DEV)
    x = torch.randn(1, k, generator=gen).to(dtype).to(DEV)

    def plain(rows):
        codes, scales, mins, zeros = _sliced(p, rows)
        out = torch.empty(1, rows, dtype=dtype, device=DEV)
        ops.quant_gemv(out, x, codes, scales, mins, p.code, p.group, False, zeros)
        return out, (codes, scales, mins, zeros)

    full, (codes, scales, mins, zeros) = plain(1036)
    got = torch.full((1, 1040 // 2), float("nan"), dtype=dtype, device=DEV)
    ops.quant_gemv(got[:, :518], x, codes, scales, mins, p.code, p.group, True, zeros, True)
    assert got[:, 518:].isnan().all()  # nothing past the last pair
    g, u = full[:, :518].float(), full[:, 518:].float()
    want = ((g / (1 + torch.exp(-g))).to(dtype).float() * u).to(dtype)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got[:, :518].float(), want.float(), rtol=eps, atol=eps)
    assert (got[:, :518] == want).float().mean() > 0.99

    full, (codes, scales, mins, zeros) = plain(1028)
    positions = torch.tensor([1234], device=DEV)
    cs = cos_sin_table(128, {"rope_type": "default", "rope_theta": 500000.0}, 4096).to(DEV)
    got = torch.full((1, 1028), float("nan"), dtype=dtype, device=DEV)
    ops.quant_gemv_rope(got, x, codes, scales, mins, p.code, p.group, zeros, positions, cs, 6, 128, 128)
    assert torch.equal(got[:, 768:], full[:, 768:])
    q_rot, k_rot = rotary_embedding(positions, full[:, :512].reshape(1, 4, 128), full[:, 512:768].reshape(1, 2, 128),
                                    cs, 128)
    want = torch.cat([q_rot.reshape(1, -1), k_rot.reshape(1, -1)], dim=-1)
    torch.testing.assert_close(got[:, :768].float(), want.float(), rtol=eps, atol=eps)
    assert (got[:, :768] == want).float().mean() > 0.99


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0),
                    reason="the tensor-core kernels need sm_80+ (below, every row takes the CUDA cores)")
def test_fp8_takes_the_tensor_cores_where_they_measured_faster():
    """fp8 codes with bf16 activations: one row takes the tensor cores only on weights of at
    most 2^24 codes, two rows never (the two-row CUDA-core kernel measured faster on every
    Llama-3-8B layer, H100 2026-12-07), three and more always; each product is the
    reference's, and where the rule says CUDA cores the op's result is the CUDA-core kernel's
    bit for bit (the dispatch follows the rule, not only the query). (That last assertion was
    added after the session-23 GPU run of this test: not yet run on a GPU.)"""
    from platforms.cuda.build import load_ops

    gen = torch.Generator().manual_seed(23)
    ops = load_ops()
    for n, k, small in ((1024, 1024, True), (4224, 4096, False)):  # 2^20 and 17.3 M codes
        w = fp8_weight(n, k, k, gen)
        p = _pack(w, DEV)
        for m, want_tc in ((1, small), (2, False), (3, True), (16, True)):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
            assert ops.quant_gemv_tensor_cores(x, p.codes, p.scales, p.mins, p.code, p.group, p.zeros) == want_tc, (
                n, m)
            got = _fp8_gemv(p, x, True)
            check(got, reference(x, w), torch.bfloat16, k)
            if not want_tc:
                assert torch.equal(got, _fp8_gemv(p, x, False)), (n, m)


def test_quant_epilogues_run_on_the_cuda_cores_where_one_row_takes_the_tensor_cores():
    """An AWQ-form weight (integer zero points) of k = 8,192, whose one plain row takes the int4
    tensor-core kernel, and an fp8 weight of 2^20 codes (the fp8 one at one row): asked for an
    epilogue, the op runs the CUDA-core GEMV, so the result is that kernel's followed by
    silu_and_mul, bit for bit."""
    from platforms.cuda.build import load_ops
    from platforms.cuda.ops import silu_and_mul

    gen = torch.Generator().manual_seed(11)
    for w in (_awq_weight(2304, 8192, gen), fp8_weight(1024, 1024, 1024, gen)):
        p = _pack(w, DEV)
        x = torch.randn(1, w.shape[1], generator=gen).to(torch.bfloat16).to(DEV)
        assert load_ops().quant_gemv_tensor_cores(x, p.codes, p.scales, p.mins, p.code, p.group, p.zeros)
        got = torch.empty(1, w.shape[0] // 2, dtype=torch.bfloat16, device=DEV)
        load_ops().quant_gemv(got, x, p.codes, p.scales, p.mins, p.code, p.group, True, p.zeros, True)
        assert torch.equal(got, silu_and_mul(_plain(x, p)))


def test_the_linear_method_fuses_at_one_row_on_the_cuda_cores_only():
    """CudaQuantizedLinear.apply_silu_and_mul / apply_rope: one bf16 row through fp8 layers of
    more than 2^24 codes (the CUDA-core GEMV's at one row) takes the epilogue (the fused ops'
    result); two rows, a bias, another silu_and_mul than the platform's, or a weight whose one
    row takes a tensor-core kernel (fp8 of at most 2^24 codes, int4 with zero points above
    2^24) run the two ops (apply_rope: None, the caller rotates)."""
    import types

    from core.models.layers import RotaryEmbedding
    from core.ops import Ops
    from platforms.cuda.build import load_ops
    from platforms.cuda.ops import cuda_ops, silu_and_mul

    gen = torch.Generator().manual_seed(7)
    method = CudaQuantizedLinear(Fp8Method.from_config(None), torch.bfloat16)
    k = 4096

    def layer(weight, **attrs):
        module = torch.nn.Module()
        module.__dict__.update(attrs)
        module.packed_weight = method.pack(weight, DEV)
        return module

    mlp = layer(fp8_weight(4224, k, k, gen))  # 17.3 M codes
    qkv = layer(fp8_weight(6144, k, k, gen), head_size=128, num_heads=32, num_kv_heads=8)
    assert mlp.packed_weight.one_row_epilogues and qkv.packed_weight.one_row_epilogues
    small = layer(fp8_weight(1024, 1024, 1024, gen))
    awq = layer(_awq_weight(4224, k, gen))
    assert not small.packed_weight.one_row_epilogues and not awq.packed_weight.one_row_epilogues
    ctx = types.SimpleNamespace(ops=Ops(cuda_ops()), device=DEV)
    rotary = RotaryEmbedding(128, 128, 4096, {"rope_type": "default", "rope_theta": 500000.0}, ctx)
    calls = []

    def other(y):  # not the platform's op object: never fused
        calls.append(y.shape)
        return silu_and_mul(y)

    for m in (1, 2):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
        positions = torch.arange(m, device=DEV) + 7
        fused = method.apply_silu_and_mul(mlp, x, None, silu_and_mul)
        rotated = method.apply_rope(qkv, x, None, positions, rotary)
        assert torch.equal(method.apply_silu_and_mul(mlp, x, None, other), silu_and_mul(method.apply(mlp, x, None)))
        assert method.apply_rope(qkv, x, torch.zeros(6144, dtype=torch.bfloat16, device=DEV), positions, rotary) is None
        assert torch.equal(method.apply_silu_and_mul(awq, x, None, silu_and_mul),
                           silu_and_mul(method.apply(awq, x, None)))
        xs = x[:, :1024].contiguous()
        assert torch.equal(method.apply_silu_and_mul(small, xs, None, silu_and_mul),
                           silu_and_mul(method.apply(small, xs, None)))
        if m == 2:
            assert rotated is None and torch.equal(fused, silu_and_mul(method.apply(mlp, x, None)))
            continue
        p = mlp.packed_weight
        want = torch.empty(1, 2112, dtype=torch.bfloat16, device=DEV)
        load_ops().quant_gemv(want, x, p.codes, p.scales, p.mins, p.code, p.group, True, p.zeros, True)
        assert torch.equal(fused, want)
        p = qkv.packed_weight
        want = torch.empty(1, 6144, dtype=torch.bfloat16, device=DEV)
        load_ops().quant_gemv_rope(want, x, p.codes, p.scales, p.mins, p.code, p.group, p.zeros, positions,
                                   rotary.cos_sin_cache, 40, 128, 128)
        assert torch.equal(rotated, want)
    assert calls == [(1, 4224), (2, 4224)]


def test_the_quant_epilogues_refuse_what_they_cannot_take():
    from platforms.cuda.build import load_ops

    gen = torch.Generator().manual_seed(3)
    p = _pack(int_weight(64, 1024, 4, 128, True, gen), DEV)
    x2 = torch.randn(2, 1024, generator=gen).to(torch.bfloat16).to(DEV)
    with pytest.raises(RuntimeError, match="the epilogue takes one float16 or bfloat16 row"):
        load_ops().quant_gemv(torch.empty(2, 32, dtype=torch.bfloat16, device=DEV), x2, p.codes, p.scales, p.mins,
                              p.code, p.group, True, p.zeros, True)
    x32 = torch.randn(1, 1024, generator=gen).to(DEV)
    with pytest.raises(RuntimeError, match="use quant_gemv, then silu_and_mul"):
        load_ops().quant_gemv(torch.empty(1, 32, device=DEV), x32, p.codes, p.scales, p.mins,
                              p.code, p.group, True, p.zeros, True)
    x = x2[:1].contiguous()
    pos, cs = torch.zeros(1, dtype=torch.int64, device=DEV), torch.zeros(16, 8, device=DEV)
    with pytest.raises(RuntimeError, match="do not fit a weight of 64 rows"):
        load_ops().quant_gemv_rope(torch.empty(1, 64, dtype=torch.bfloat16, device=DEV), x, p.codes, p.scales,
                                   p.mins, p.code, p.group, p.zeros, pos, cs, 5, 16, 8)


def test_shapes_the_kernels_cannot_take_stay_dense():
    gen = torch.Generator().manual_seed(0)
    assert _pack(int_weight(24, 256, 4, 128, True, gen), DEV) is None  # 24 rows: not % 16
    assert _pack(fp8_weight(64, 320, 64, gen), DEV) is None  # 64-input fp8 groups
    # 1.5 M inputs in two groups: beyond the kernels' 32-bit group lookup (quant_gemm.h)
    assert _pack(int_weight(16, 1_572_864, 8, 786_432, False, gen), DEV) is None
    assert _pack(int_weight(16, 1024, 8, 32, True, gen), DEV) is None  # 8-bit codes with mins


# ---- whole models ---------------------------------------------------------------------------


class _PrefillActivationsInFp8:
    """A reference linear method for a block-scaled FP8 checkpoint on the CPU: the CUDA
    platform multiplies prompts (more than ``GEMV_MAX_ROWS`` rows) W8A8, with activations
    quantized per token and 128 inputs to e4m3 (scale = max|x| / 448), and decode rows
    weight-only. This wraps the CPU's own method and rounds the activations the same way in
    float32 before it, so the reference does the same math as the device, not a different one
    (written here from the format's definition, not with the platform's quantizer)."""

    def __init__(self, inner, min_rows: int):
        self.inner, self.min_rows = inner, min_rows

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def apply(self, layer, x, bias):
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > self.min_rows:
            x = _fp8_activations(rows.float(), 128).to(x.dtype).view(x.shape)
        return self.inner.apply(layer, x, bias)

    def apply_silu_and_mul(self, layer, x, bias, silu_and_mul):
        # Not the inner method's (reached through __getattr__), which would skip apply above.
        return silu_and_mul(self.apply(layer, x, bias))


def _llm(path, platform, fp8_prefill_reference=False, **kw):
    from core import LLM
    from core.models.layers import ColumnParallelLinear, RowParallelLinear
    from platforms.cuda.quant import GEMV_MAX_ROWS, block_scaled_rows

    kw.setdefault("dtype", "float32" if platform == "cpu" else "bfloat16")
    llm = LLM(model=str(path), platform=platform, kv_cache_memory="256MiB", **kw)
    if fp8_prefill_reference and block_scaled_rows(DEV):  # else CUDA dequantizes prompts too
        wrapped = 0
        for module in llm.engine.executor.runner.model.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.linear_method = _PrefillActivationsInFp8(module.linear_method, GEMV_MAX_ROWS)
                wrapped += 1
        assert wrapped
    return llm


def _greedy(path, platform, prompts, **kw):
    from core import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in _llm(path, platform, **kw).generate(prompts, sp, use_tqdm=False)]


def _prompt_top1(path, platform, prompts, **kw):
    """Teacher-forced: the most likely next token at every prompt position (one prefill
    step, so every position is an independent comparison, unlike a greedy chain that
    diverges for good at its first near-tie)."""
    from core import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = _llm(path, platform, **kw).generate(prompts, sp, use_tqdm=False)
    return [[min((lp.rank, t) for t, lp in d.items())[1] for d in o.prompt_logprobs[1:]] for o in outs]


def _agreement(a, b) -> float:
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    return same / sum(len(p) for p in a)


FORMATS = ["awq", "gptq-act-order", "gptq-int8", "fp8-block"]


def _tiny_checkpoint(tmp_path, fmt):
    from core.quantization.writers import write_quantized
    from tests.helpers import tiny_llama_dir

    src = tiny_llama_dir(tmp_path, name="src", seed=7, hidden_size=256, intermediate_size=512,
                         num_attention_heads=4, num_key_value_heads=2)
    return write_quantized(src, tmp_path / fmt, fmt)


@pytest.mark.parametrize("fmt,seqs", [("awq", 6), ("gptq-act-order", 6), ("gptq-int8", 6), ("awq", 1)])
def test_tiny_checkpoints_on_cuda_agree_with_cpu(tmp_path, fmt, seqs):
    """Greedy chains of n prompts, CUDA bf16 vs the CPU fp32 run of the same checkpoint (one
    prompt: every decode step is one row, which this tiny AWQ model's layers run on the
    CUDA-core GEMV, the QKV and gate/up ones with their rotary and SiLU epilogues). Not fp8-block:
    its W8A8 prefill rounds activations to 3 mantissa bits, which turns bf16's rounding
    differences into different codes, and on this random model's near-tied logits a chain
    then diverges at its first near-tie — the CPU's own bf16 and fp32 runs of that math agree
    on 0.79 of the teacher-forced positions (2026-12-02) — so it is checked teacher-forced
    below, against that floor."""
    from tests.integration.test_engine_hf import random_prompts

    path = _tiny_checkpoint(tmp_path, fmt)
    prompts = random_prompts(6, 512, seed=3)
    rate = _agreement(_greedy(path, "cuda", prompts, max_num_seqs=seqs), _greedy(path, "cpu", prompts))
    print(f"\n{fmt}, {seqs} sequences a step: cuda bf16 vs cpu fp32 greedy agreement {rate:.3f}")
    assert rate >= 0.5


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiny_checkpoints_teacher_forced_on_cuda(tmp_path, fmt):
    """The most likely next token at every prompt position, CUDA bf16 vs the CPU fp32 run:
    the unquantized model's bf16 run agrees on 0.96 of them (H200, 2026-12-02); a wrong
    scale, layout or dispatch on far fewer. fp8-block's reference rounds prompt activations
    to fp8 like the device's W8A8 prefill, and the bar is what a second implementation of
    that math in bf16 (the CPU platform's) reaches against it, less 0.1; the agreement with
    the plain fp32 model is printed too."""
    from tests.integration.test_engine_hf import random_prompts

    path = _tiny_checkpoint(tmp_path, fmt)
    prompts = random_prompts(12, 512, seed=4)
    fp8 = fmt == "fp8-block"
    reference = _prompt_top1(path, "cpu", prompts, fp8_prefill_reference=fp8)
    rate = _agreement(_prompt_top1(path, "cuda", prompts), reference)
    if not fp8:
        print(f"\n{fmt}: teacher-forced top-1, cuda bf16 vs cpu fp32 {rate:.3f}")
        assert rate >= 0.85
        return
    floor = _agreement(_prompt_top1(path, "cpu", prompts, fp8_prefill_reference=True, dtype="bfloat16"), reference)
    plain = _agreement(_prompt_top1(path, "cuda", prompts), _prompt_top1(path, "cpu", prompts))
    print(f"\n{fmt}: teacher-forced top-1, cuda bf16 vs cpu fp32 W8A8 reference {rate:.3f} "
          f"(cpu bf16 W8A8 vs the same: {floor:.3f}; cuda vs the plain fp32 model: {plain:.3f})")
    assert rate >= floor - 0.1


def test_smollm2_gguf_kept_quantized_on_cuda(tmp_path):
    from core.model_loader import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    prompts = [[1, 504, 3458, 314, 253, 1345, 30, 198], [1, 378, 314, 260, 3575, 282, 4649, 47]]
    rate = _agreement(_greedy(path, "cuda", prompts), _greedy(path, "cpu", prompts, weight_format="dense"))
    print(f"\nSmolLM2 Q4_1 GGUF: cuda (kept quantized, bf16) vs cpu (dequantized, fp32) {rate:.3f}")
    assert rate >= 0.5
