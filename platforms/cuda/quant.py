"""Quantized linear layers on CUDA: FP8 and 4/8-bit weights kept quantized on the GPU.

Per step size (the number of activation rows ``M``):

* ``M <= GEMV_MAX_ROWS`` (decode): ``core_C.quant_gemv`` (csrc/quant), a weight-only GEMV that
  reads each weight once as its 4- or 8-bit code (int4, int8 or fp8 e4m3) and multiplies in
  float32 against unquantized activations;
* larger steps (prefill): FP8 weights go through ``torch._scaled_mm`` (cuBLASLt FP8 tensor
  cores) with activations quantized per token while running (per token and 128 inputs for
  128-input weight groups); integer weights are dequantized once by ``core_C.quant_dequant``
  and multiplied by one dense GEMM.

Which path wins for decode is measured by ``python -m platforms.cuda.quant_bench`` (the
GEMV against ``_scaled_mm`` and against bf16 cuBLAS per Llama-3-8B shape); the crossover is
:data:`GEMV_MAX_ROWS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.quantization.base import QuantizationMethod
from core.quantization.linear import KeptQuantizedLinear
from core.quantization.tensors import FP8_MAX, Fp8Weight, QuantizedWeight
from platforms.cuda.build import load_ops

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
    [K / 128, N] for 128-input groups)."""


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K / 2] bytes, input 2j in the low nibble of byte j."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


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
        return PackedQuant(codes, scales, None, FP8, group, None, scale_b)
    if weight.group % 32:
        return None
    codes = pack_int4_rows(weight.codes) if weight.bits == 4 else weight.codes.view(torch.uint8).contiguous()
    mins = None if weight.mins is None else weight.mins.float().contiguous().to(device)
    perm = None if weight.perm is None else weight.perm.to(device)
    return PackedQuant(codes.to(device), weight.scales.float().contiguous().to(device), mins,
                       INT4 if weight.bits == 4 else INT8, weight.group, perm)


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


def fp8_scaled_mm(p: PackedQuant, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T through torch._scaled_mm; returns bfloat16 [M, N]."""
    block = p.scale_b.shape[0] != 1
    xq, scale_a = quantize_rows_fp8(x, _FP8_GROUP if block else None)
    w = p.codes.view(torch.float8_e4m3fn).t()  # [K, N], column-major, as cuBLASLt wants
    return torch._scaled_mm(xq, w, scale_a=scale_a, scale_b=p.scale_b, out_dtype=torch.bfloat16)


class CudaQuantizedLinear(KeptQuantizedLinear):
    """The CUDA platform's kept-quantized linear method (see the module docstring)."""

    def pack(self, weight: QuantizedWeight, device: torch.device) -> PackedQuant | None:
        return _pack(weight, device)

    def matmul(self, packed: PackedQuant, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        if packed.perm is not None:
            x2 = x2.index_select(1, packed.perm)
        rows = x2.shape[0]
        if rows <= GEMV_MAX_ROWS:
            x2 = x2.contiguous()
            if x2.data_ptr() % 16:  # the kernel reads 16-byte vectors
                x2 = x2.clone()
            y = torch.empty(rows, packed.codes.shape[0], dtype=x.dtype, device=x.device)
            load_ops().quant_gemv(y, x2, packed.codes, packed.scales, packed.mins, packed.code, packed.group)
            if bias is not None:
                y += bias
        elif packed.code == FP8:
            y = fp8_scaled_mm(packed, x2).to(x.dtype)
            if bias is not None:
                y += bias
        else:
            y = F.linear(x2, dequantize_packed(packed, x.dtype), bias)
        return y.view(*x.shape[:-1], y.shape[-1])


def _kept(quant: QuantizationMethod, dtype: torch.dtype) -> CudaQuantizedLinear:
    return CudaQuantizedLinear(quant, dtype)


QUANTIZED_LINEAR = dict.fromkeys(("fp8", "compressed-tensors", "awq", "gptq", "gguf"), _kept)
"""The CUDA platform's answer to ``quantization_methods()``: every built-in method kept
quantized by :class:`CudaQuantizedLinear`."""
