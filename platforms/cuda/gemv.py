"""``core_C.gemv`` (csrc/gemv.cu): a bandwidth-bound dense GEMM for 1-8 rows, as a candidate
for the decode-step linear layers.

Measured on the H200 against cuBLAS (docs/benchmarks/cuda_gemv.md): faster in isolation only
at 1-2 rows on the narrower projections, and no faster in the model's graphed decode step, so
the model's linear layers keep cuBLAS (``torch.nn.functional.linear``) and this kernel is used
by the benchmark (:mod:`platforms.cuda.small_gemm`) and its tests only.
"""

from __future__ import annotations

import torch

from platforms.cuda.build import load_ops

GEMV_MAX_ROWS = 8
"""Largest row count the kernel takes (csrc/gemv.h, kGemvMaxRows)."""

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rows_per_warp(n: int) -> int:
    """Output features per warp for an ``n``-feature layer (the best of the H200 sweep at one
    row: one per warp up to 8,192 features, two above)."""
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
