"""Dense linear layers on CUDA: a bandwidth-bound kernel for decode-sized inputs, cuBLAS above.

At 1-2 rows a linear layer reads its whole weight for one or two outputs per feature, and
cuBLAS's tiles leave bandwidth unused on the narrower projections. The kernel
(``core_C.gemv``, csrc/gemv.cu, 1-8 rows) measured faster than cuBLAS on the H200 only there
(docs/benchmarks/cuda_gemv.md): at 1-2 rows with a reduction of at most ``ROUTE_MAX_K``
(Llama-3-8B's QKV, output and gate/up projections and the LM head; not the 14,336-wide down
projection), and slower at 4-8 rows. So :class:`CudaDenseLinear` routes exactly those inputs
to it and everything else, or any layout the kernel does not take, to
``torch.nn.functional.linear``. Same contract as :class:`core.models.layers.LinearMethod`'s
dense format; results agree with cuBLAS to float32-accumulation rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.models.layers import LinearMethod
from platforms.cuda.build import load_ops

GEMV_MAX_ROWS = 8
"""Largest row count the kernel takes (csrc/gemv.h, kGemvMaxRows)."""

ROUTE_MAX_ROWS = 2
"""Inputs of at most this many rows go to the kernel (where it beat cuBLAS)."""
ROUTE_MAX_K = 8192
"""... and reductions of at most this many features (above it cuBLAS's split-K wins)."""

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rows_per_warp(n: int) -> int:
    """Output features per warp for an ``n``-feature layer (from the H200 sweep in
    docs/benchmarks/cuda_gemv.md): narrow layers keep one per warp so enough warps fill the
    GPU; wide ones take two, halving the loads of x per weight byte."""
    return 1 if n <= 8192 else 2


def gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``x`` [m, k] and ``weight`` [n, k] are laid out as the kernel reads them."""
    vec = 16 // x.element_size()
    return (
        x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_ROWS
        and x.dtype in _DTYPES and weight.dtype == x.dtype and weight.dim() == 2
        and x.shape[1] == weight.shape[1] and x.shape[1] % vec == 0
        and x.stride(1) == 1 and weight.stride(1) == 1
        and x.stride(0) % vec == 0 and weight.stride(0) % vec == 0
        and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, per_warp: int | None = None) -> torch.Tensor:
    """``x @ weight.T`` through the kernel (callers check :func:`gemv_fits` first)."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    load_ops().gemv(out, x, weight, per_warp or rows_per_warp(weight.shape[0]))
    return out


class CudaDenseLinear(LinearMethod):
    """The dense format, with decode-sized inputs on the bandwidth-bound kernel."""

    name = "dense"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = layer.weight
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        if x2.shape[0] > ROUTE_MAX_ROWS or x2.shape[1] > ROUTE_MAX_K or not gemv_fits(x2, w):
            return F.linear(x, w, bias)
        y = gemv(x2, w)
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], w.shape[0])


CUDA_DENSE = CudaDenseLinear()
