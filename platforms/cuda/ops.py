"""The CUDA platform's op table: fused csrc kernels for the element-wise ops of a layer.

Each function has the signature and result of its reference in :mod:`core.ops` (same
roundings; see csrc/fused_ops.h) and allocates its outputs, so callers see the functional
contract. Inputs whose rows the 16-byte vector kernels cannot read (odd hidden sizes,
misaligned views, CPU tensors) go to the reference instead: slower, never wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from core import ops as reference
from platforms.cuda.build import load_ops
from platforms.cuda.gemv import lm_head
from platforms.cuda.moe import fused_moe
from platforms.cuda.sampling import CudaSamplingKernel

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _vector_rows(t: torch.Tensor) -> bool:
    """``t`` viewed as [rows, last] has contiguous, 16-byte aligned rows of whole vectors."""
    vec = 16 // t.element_size()
    return (
        t.is_cuda
        and t.dtype in _DTYPES
        and t.dim() >= 1
        and t.stride(-1) == 1
        and t.shape[-1] % vec == 0
        and t.data_ptr() % 16 == 0
        and (t.dim() == 1 or all(t.stride(i) % vec == 0 for i in range(t.dim() - 1)))
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., last] as a 2-D [rows, last] view (no copy for the inputs taken here)."""
    return t.reshape(-1, t.shape[-1])


def _norm_weight(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """The kernels read the weight before waiting for the kernel that produced ``x``
    (csrc/fused_ops.cu), so it must be usable as it is: a contiguous parameter, never a copy
    made just before the call."""
    return weight.dtype == x.dtype and weight.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not (x.is_contiguous() and _vector_rows(x) and _norm_weight(weight, x)):
        return reference.rms_norm(x, weight, eps)
    out = torch.empty_like(x)
    load_ops().rms_norm(_rows(out), _rows(x), weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    fits = (
        x.is_contiguous() and residual.is_contiguous() and _vector_rows(x)
        and _vector_rows(residual) and x.shape == residual.shape
        and residual.dtype == x.dtype and _norm_weight(weight, x)
    )
    if not fits:
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x)
    load_ops().fused_add_rms_norm(
        _rows(out), _rows(new_residual), _rows(x), _rows(residual), weight, eps
    )
    return out, new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    if not (x.is_contiguous() and _vector_rows(x) and d % (16 // x.element_size()) == 0):
        return reference.silu_and_mul(x)
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    load_ops().silu_and_mul(_rows(out), _rows(x))
    return out


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    vec = 16 // query.element_size()
    fits = (
        _vector_rows(query) and _vector_rows(key) and key.dtype == query.dtype
        and rotary_dim % 2 == 0 and (rotary_dim // 2) % vec == 0
        and (query.shape[-1] - rotary_dim) % vec == 0
        and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
        and positions.dtype == torch.int64
    )
    if not fits:
        return reference.rotary_embedding(positions, query, key, cos_sin_cache, rotary_dim)
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    load_ops().rotary_embedding(
        q_out, k_out, positions.contiguous(), query, key, cos_sin_cache, rotary_dim
    )
    return q_out, k_out


def cuda_ops() -> dict[str, Callable[..., Any]]:
    """The overrides :meth:`CudaPlatform.ops` returns (names of :data:`core.ops.DEFAULT_OPS`)."""
    return {
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "silu_and_mul": silu_and_mul,
        "rotary_embedding": rotary_embedding,
        "fused_moe": fused_moe,
        "lm_head": lm_head,
        "sampling_kernel": CudaSamplingKernel(),
    }
