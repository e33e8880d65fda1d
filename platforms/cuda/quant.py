"""Quantized linear layers on CUDA: FP8 and 4/8-bit weights kept quantized on the GPU.

Per step size (the number of activation rows ``M``):

* ``M <= GEMV_MAX_ROWS`` (decode): ``core_C.quant_gemv`` (csrc/quant), a weight-only GEMV that
  reads each weight once as its 4- or 8-bit code (int4, int8 or fp8 e4m3) and multiplies
  against unquantized activations with float32 sums (fp8, and int4 with integer zero points:
  :func:`integer_zeros`, on tensor cores);
* larger steps (prefill): FP8 weights go through ``torch._scaled_mm`` (cuBLASLt FP8 tensor
  cores) with activations quantized per token while running (per token and 128 inputs for
  128-input weight groups); integer weights are dequantized once by ``core_C.quant_dequant``
  and multiplied by one dense GEMM. Block-scaled FP8 takes ``_scaled_mm`` only where a
  one-time probe of the device found cuBLASLt accepting it (:func:`block_scaled_rows`), with
  the activation rows padded to the alignment the probe found; otherwise it is dequantized
  and multiplied like the integer weights (logged once).

Which path wins for decode is measured by ``python -m platforms.cuda.quant_bench`` (the
GEMV against ``_scaled_mm`` and against bf16 cuBLAS per Llama-3-8B shape); the crossover is
:data:`GEMV_MAX_ROWS`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core.quantization.base import QuantizationMethod
from core.quantization.linear import KeptQuantizedLinear
from core.quantization.tensors import FP8_MAX, Fp8Weight, QuantizedWeight, integer_zero_points
from platforms.cuda.build import load_ops
from platforms.cuda.gemv import fuses_rope, fuses_silu_and_mul

logger = logging.getLogger(__name__)

GEMV_MAX_ROWS = 16
"""Most activation rows multiplied by the GEMV kernel (csrc/quant: kQuantGemvMaxRows)."""
INT4, INT8, FP8 = 0, 1, 2
"""``code`` of the csrc/quant ops."""
_FP8_GROUP = 128
"""The input-group size torch._scaled_mm takes for block-scaled FP8 (1x128 scaling)."""


@dataclass(frozen=True)
class PackedQuant:
    """A weight for csrc/quant (and, for FP8, for torch._scaled_mm)."""

    codes: torch.Tensor
    """[N, K / 2] uint8 (int4, two inputs per byte, low nibble first) or [N, K] int8 / fp8."""
    scales: torch.Tensor
    """[N, K / group] float32."""
    mins: torch.Tensor | None
    """[N, K / group] float32 or None."""
    code: int
    group: int
    perm: torch.Tensor | None
    """GPTQ act-order: the activations' columns are gathered by it first."""
    scale_b: torch.Tensor | None = None
    """FP8 only: the weight scales as torch._scaled_mm takes them ([1, N] per row, or
    [K / 128, N] for 128-input groups); None where prefill dequantizes instead."""
    row_align: int = 1
    """Block-scaled FP8: ``_scaled_mm`` gets its activation rows padded to a multiple of
    this (see :func:`block_scaled_rows`)."""
    zeros: torch.Tensor | None = None
    """int4 only: the mins restated as integer zero points, uint8 [N, K / group]
    (:func:`integer_zeros`), kept only for shapes the tensor-core GEMV takes; None keeps a
    weight with mins on the CUDA cores."""
    one_row_epilogues: bool = False
    """Whether one activation row of the linear method's dtype runs on the CUDA-core GEMV
    (``core_C.quant_gemv_tensor_cores``), whose epilogues (SiLU-and-mul, rotary embedding)
    the method then uses; where one row takes a tensor-core kernel, which measured faster
    there, the layer keeps it and the separate kernel."""


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K / 2] bytes, input 2j in the low nibble of byte j."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


ZERO_LIMIT = 127
"""The largest zero point the int4 tensor-core GEMV takes (csrc/quant/quant_gemm.h: M + z
and q - z must stay exact in bf16, whose unit in the last place is 1 up to 255)."""
INT4_MMA_GROUP, INT4_MMA_TRIP = 128, 256
"""The int4 tensor-core GEMV's shapes (csrc/quant/quant_gemm.cu, int4_mma_applies): groups a
multiple of 128 inputs, rows a multiple of 256; zero points are kept only for those."""


def integer_zeros(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor | None:
    """The zero points z (uint8) with ``mins == -z * scales`` exactly in float32, or None
    where any group's min is not such a multiple (GGUF Q4_1 and Q4_K have free mins) or z
    falls outside 0..ZERO_LIMIT. AWQ and GPTQ (``min = -z * s``, exact for their fp16 scales:
    core/quantization/int4.py) and GGUF Q4_0 (``-8 d``, d of either sign) have them; with
    them the tensor-core GEMV computes ``(q - z) * s``, where ``q * s + min`` rounds twice."""
    z = integer_zero_points(scales, mins, ZERO_LIMIT)
    return None if z is None else z.to(torch.uint8)


def _pack(weight: QuantizedWeight, device: torch.device) -> PackedQuant | None:
    rows, cols = weight.shape
    if cols % 32 or rows % 16:
        return None  # outside the kernels' (and _scaled_mm's) shape contract: stays dense
    if isinstance(weight, Fp8Weight):
        per_row = weight.scales.shape[1] == 1
        if not per_row and (weight.group != _FP8_GROUP or cols % _FP8_GROUP):
            return None
        scales = weight.scales.float().contiguous().to(device)
        group = cols if per_row else weight.group
        scale_b = scales.t().contiguous()  # [1, N] or [K / 128, N], as _scaled_mm takes it
        codes = weight.codes.contiguous().view(torch.uint8).to(device)
        align = 1 if per_row else block_scaled_rows(torch.device(device))
        if not align:
            scale_b = None  # cuBLASLt refused block scales here: prefill dequantizes
        return PackedQuant(codes, scales, None, FP8, group, None, scale_b, max(align, 1))
    if weight.group % 32 or (weight.bits == 8 and weight.mins is not None):
        return None  # the GEMV takes mins with int4 codes only (GGUF Q8_0, the 8-bit format, has none)
    per = 32 if weight.bits == 4 else 16  # inputs per 16-byte code vector
    if weight.group < cols and (cols // per) * (weight.group // per) >= 2**32:
        return None  # csrc/quant finds a vector's group by a 32-bit multiply-high (quant_gemm.h)
    codes = pack_int4_rows(weight.codes) if weight.bits == 4 else weight.codes.view(torch.uint8).contiguous()
    mins = None if weight.mins is None else weight.mins.float().contiguous().to(device)
    scales = weight.scales.float().contiguous().to(device)
    zeros = None
    if weight.bits == 4 and mins is not None and weight.group % INT4_MMA_GROUP == 0 and cols % INT4_MMA_TRIP == 0:
        zeros = integer_zeros(scales, mins)  # only where the tensor cores can use them (Q4_0's groups of 32 not)
    perm = None if weight.perm is None else weight.perm.to(device)
    return PackedQuant(codes.to(device), scales, mins, INT4 if weight.bits == 4 else INT8, weight.group, perm,
                       zeros=zeros)


def dequantize_packed(p: PackedQuant, dtype: torch.dtype) -> torch.Tensor:
    """The packed weight [N, K] in ``dtype`` (csrc/quant's dequantization)."""
    k = p.codes.shape[1] * (2 if p.code == INT4 else 1)
    out = torch.empty(p.codes.shape[0], k, dtype=dtype, device=p.codes.device)
    load_ops().quant_dequant(out, p.codes, p.scales, p.mins, p.code, p.group)
    return out


def quantize_rows_fp8(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 activations: x [M, K] -> (codes [M, K] fp8, scales as _scaled_mm takes
    them: [M, 1] per token, or [M, K / group] outer-dim-major per token and group)."""
    m, k = x.shape
    xf = x.float()
    if group is None:
        scale = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12) / FP8_MAX
        return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    xg = xf.view(m, k // group, group)
    scale = xg.abs().amax(dim=2).clamp_(min=1e-12) / FP8_MAX  # [M, K / group]
    codes = (xg / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(m, k)
    return codes, scale.t().contiguous().t()


def quantize_rows_fp8_fused(x: torch.Tensor, group: int | None, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows_fp8` in one kernel (``core_C.quant_fp8_activations``, bit for bit
    the same codes and scales), over ``rows >= len(x)`` rows: the ones past ``x`` are the zero
    rows an alignment pads with (codes 0, scale 1e-12 / 448), so ``x`` is never copied."""
    k = x.shape[1]
    codes = torch.empty(rows, k, dtype=torch.uint8, device=x.device)
    if x.stride(1) != 1 or x.stride(0) * x.element_size() % 16 or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # the kernel reads 16-byte rows
    if group is None:
        scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    else:  # outer-dim-major [rows, K / group], as _scaled_mm takes blockwise scales
        scales = torch.empty(k // group, rows, dtype=torch.float32, device=x.device).t()
    load_ops().quant_fp8_activations(codes, scales.t() if group else scales, x, group or k)
    return codes.view(torch.float8_e4m3fn), scales


def _fused_fp8_activations(x: torch.Tensor) -> bool:
    """The fused kernel takes the row (K % 8, 16-byte rows after a copy at worst) on a CUDA
    device; HIP builds have no e4m3 conversion (see csrc/cuda_compat.h)."""
    return x.is_cuda and torch.version.hip is None and x.shape[1] % 8 == 0


def fp8_scaled_mm(p: PackedQuant, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T through torch._scaled_mm; returns bfloat16 [M, N]. The activations are
    quantized by one fused kernel (where it runs: :func:`_fused_fp8_activations`), else by
    :func:`quantize_rows_fp8`'s torch ops, six passes over them."""
    block = p.scale_b.shape[0] != 1
    rows = x.shape[0]
    pad = -rows % p.row_align
    group = _FP8_GROUP if block else None
    if _fused_fp8_activations(x):
        xq, scale_a = quantize_rows_fp8_fused(x, group, rows + pad)
    else:
        if pad:  # zero rows: their scales clamp to 1e-12 / 448 and their outputs are dropped
            x = F.pad(x, (0, 0, 0, pad))
        xq, scale_a = quantize_rows_fp8(x, group)
    w = p.codes.view(torch.float8_e4m3fn).t()  # [K, N], column-major, as cuBLASLt wants
    y = torch._scaled_mm(xq, w, scale_a=scale_a, scale_b=p.scale_b, out_dtype=torch.bfloat16)
    return y[:rows] if pad else y


BLOCK_ROW_ALIGNMENTS = (4, 16, 128)
"""Row alignments :func:`block_scaled_rows` tries, smallest first. On the H200 (torch
2.11+cu130) cuBLASLt refused 1x128-scaled activations of 17 rows
(``CUBLAS_STATUS_NOT_SUPPORTED`` from ``cublasLtMatmulAlgoGetHeuristic``) and took 200; the
activation scales are outer-dim-major ``[M, K / 128]``, so M sets the alignment of each of
their columns, and PyTorch's own tests use only multiples of 128."""


@functools.cache
def block_scaled_rows(device: torch.device) -> int:
    """The row alignment under which ``torch._scaled_mm`` multiplies 1x128-scaled activations
    by 128-input-group-scaled FP8 weights correctly on ``device``, or 0 when it does not.

    Probed once per device, while the weights load (never inside a graph capture): for each
    of :data:`BLOCK_ROW_ALIGNMENTS`, two row counts (1x and 3x the alignment) must run and
    agree with the dequantized product. cuBLASLt's support depends on the GPU, the CUDA and
    cuBLAS versions and the shapes, and its documentation does not list a row constraint, so
    the device is asked instead of a table. A refusal is logged once, and prefill then
    dequantizes the weight and runs one bf16 GEMM (correct, slower)."""
    gen = torch.Generator().manual_seed(0)
    k, n = 2 * _FP8_GROUP, 128
    w = torch.randn(n, k, generator=gen)
    scales = (w.abs().view(n, k // _FP8_GROUP, _FP8_GROUP).amax(dim=2) / FP8_MAX).clamp_(min=1e-12)
    codes = (w / scales.repeat_interleave(_FP8_GROUP, dim=1)).to(torch.float8_e4m3fn)
    dense = codes.float() * scales.repeat_interleave(_FP8_GROUP, dim=1)
    probe = PackedQuant(codes.view(torch.uint8).to(device), scales.to(device), None, FP8, _FP8_GROUP,
                        None, scales.t().contiguous().to(device))
    failure = ""
    for align in BLOCK_ROW_ALIGNMENTS:
        try:
            ok = all(_probe_rows(probe, dense, m, gen) for m in (align, 3 * align))
        except (RuntimeError, ValueError) as e:  # cuBLASLt's refusal, or torch's (not sm_90)
            ok, failure = False, str(e).splitlines()[0]
        if ok:
            logger.info("fp8 block-scaled prefill on %s: torch._scaled_mm, rows padded to a multiple of %d",
                        device, align)
            return align
    logger.warning("fp8 block-scaled prefill on %s: torch._scaled_mm %s for every row alignment in %s; "
                   "block-scaled FP8 layers dequantize to the compute dtype for prefill (slower)",
                   device, f"failed ({failure})" if failure else "gave wrong results", list(BLOCK_ROW_ALIGNMENTS))
    return 0


def _probe_rows(probe: PackedQuant, dense: torch.Tensor, rows: int, gen: torch.Generator) -> bool:
    """Whether the block-scaled product of ``rows`` random rows is within fp8's error of the
    float64 one: relative error below 5 % (one e4m3 rounding of the activations is at most
    2^-4 relative per element, about 2-3 % over a row; a wrong scale layout is off by 100 %)."""
    x = torch.randn(rows, dense.shape[1], generator=gen)
    got = fp8_scaled_mm(probe, x.to(torch.bfloat16).to(probe.codes.device))  # row_align 1: as given
    want = x.to(torch.bfloat16).double() @ dense.double().T
    err = (got.double().cpu() - want).norm() / want.norm()
    return bool(err < 0.05)


class CudaQuantizedLinear(KeptQuantizedLinear):
    """The CUDA platform's kept-quantized linear method (see the module docstring)."""

    def pack(self, weight: QuantizedWeight, device: torch.device) -> PackedQuant | None:
        packed = _pack(weight, device)
        if packed is None or self.dtype not in (torch.float16, torch.bfloat16):
            return packed
        x = torch.empty(1, weight.shape[1], dtype=self.dtype, device=device)
        tensor_cores = load_ops().quant_gemv_tensor_cores(x, packed.codes, packed.scales, packed.mins, packed.code,
                                                          packed.group, packed.zeros)
        return dataclasses.replace(packed, one_row_epilogues=not tensor_cores)

    def matmul(self, packed: PackedQuant, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = _gemv_rows(packed, x)
        rows = x2.shape[0]
        if rows <= GEMV_MAX_ROWS:
            y = torch.empty(rows, packed.codes.shape[0], dtype=x.dtype, device=x.device)
            load_ops().quant_gemv(y, x2, packed.codes, packed.scales, packed.mins, packed.code, packed.group,
                                  True, packed.zeros)
            if bias is not None:
                y += bias
        elif packed.code == FP8 and packed.scale_b is not None:
            y = fp8_scaled_mm(packed, x2).to(x.dtype)
            if bias is not None:
                y += bias
        else:
            y = F.linear(x2, dequantize_packed(packed, x.dtype), bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def _epilogue_rows(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``x`` as the one fp16/bf16 row the GEMV's epilogues take (csrc/quant), for a layer
        kept quantized whose one row runs on the CUDA cores (``one_row_epilogues``) and no
        bias; else None (the two kernels run)."""
        if layer.packed_weight is None:
            self.prepare(layer)
        packed = layer.packed_weight
        if (not isinstance(packed, PackedQuant) or not packed.one_row_epilogues or bias is not None
                or x.numel() != x.shape[-1] or x.dtype != self.dtype or not x.is_cuda):
            return None
        return _gemv_rows(packed, x)

    def apply_silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, silu_and_mul: Callable
    ) -> torch.Tensor:
        """At one row, SiLU-and-mul in the quantized GEMV's epilogue (the values of the GEMV
        followed by the platform's ``silu_and_mul``, one kernel fewer a layer), where
        :func:`~platforms.cuda.gemv.fuses_silu_and_mul` allows; else the two ops."""
        x2 = self._epilogue_rows(layer, x, bias)
        d = layer.packed_weight.codes.shape[0] // 2 if x2 is not None else 0
        if x2 is None or not fuses_silu_and_mul(silu_and_mul, d, x):
            return silu_and_mul(self.apply(layer, x, bias))
        p = layer.packed_weight
        y = torch.empty(1, d, dtype=x.dtype, device=x.device)
        load_ops().quant_gemv(y, x2, p.codes, p.scales, p.mins, p.code, p.group, True, p.zeros, True)
        return y.view(*x.shape[:-1], d)

    def apply_rope(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                   rotary: nn.Module) -> torch.Tensor | None:
        """At one row, the fused QKV GEMV rotating the query and key heads in its epilogue (the
        values of the GEMV followed by the platform's ``rotary_embedding``), where
        :func:`~platforms.cuda.gemv.fuses_rope` allows; else None (the caller rotates)."""
        x2 = self._epilogue_rows(layer, x, bias)
        if x2 is None or not fuses_rope(layer, x2, positions, rotary):
            return None
        p = layer.packed_weight
        y = torch.empty(1, p.codes.shape[0], dtype=x.dtype, device=x.device)
        load_ops().quant_gemv_rope(y, x2, p.codes, p.scales, p.mins, p.code, p.group, p.zeros,
                                   positions.reshape(-1), rotary.cos_sin_cache,
                                   layer.num_heads + layer.num_kv_heads, layer.head_size, rotary.rotary_dim)
        return y.view(*x.shape[:-1], y.shape[-1])


def _gemv_rows(packed: PackedQuant, x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, k] in the weight's input order; at GEMV sizes contiguous and 16-byte
    aligned (the kernel reads 16-byte vectors)."""
    x2 = x.reshape(-1, x.shape[-1])
    if packed.perm is not None:
        x2 = x2.index_select(1, packed.perm)
    if x2.shape[0] <= GEMV_MAX_ROWS:
        x2 = x2.contiguous()
        if x2.data_ptr() % 16:
            x2 = x2.clone()
    return x2


def _kept(quant: QuantizationMethod, dtype: torch.dtype) -> CudaQuantizedLinear:
    return CudaQuantizedLinear(quant, dtype)


QUANTIZED_LINEAR = dict.fromkeys(("fp8", "compressed-tensors", "awq", "gptq", "gguf"), _kept)
"""The CUDA platform's answer to ``quantization_methods()``: every built-in method kept
quantized by :class:`CudaQuantizedLinear`."""
