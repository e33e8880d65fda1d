"""The CPU platform's op table: csrc/cpu kernels for the element-wise ops of a layer.

Each function has the signature and result of its reference in :mod:`core.ops` (the same
roundings, see csrc/cpu/elementwise.cpp) and allocates its outputs, so callers see the
functional contract. What one kernel call replaces is a handful of torch ops, each with its
own dispatch and temporary: on a 135M-parameter model at batch 1 that overhead, not the
arithmetic, is what a layer's element-wise work costs. Inputs the kernels do not take
(mixed dtypes, rows that are not contiguous) go to the reference: slower, never wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from core import ops as reference
from platforms.cpu.kernels import load_kernels

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rows_ok(x: torch.Tensor) -> bool:
    """``x`` viewed as [rows, last] without a copy: contiguous, or 2-D with unit stride."""
    return x.dtype in _DTYPES and x.stride(-1) == 1 and (x.dim() == 2 or x.is_contiguous())


class CpuOps:
    """Builds the op table over the loaded ``torch.ops.core_cpu`` namespace."""

    def __init__(self, kernels: Any):
        self._rms_norm = kernels.rms_norm.default
        self._fused_add_rms_norm = kernels.fused_add_rms_norm.default
        self._silu_and_mul = kernels.silu_and_mul.default
        self._rotary = kernels.rotary_embedding.default
        self._linear_f32out = kernels.linear_f32out.default

    def __reduce__(self):
        # The op handles cannot be pickled; a worker process (multiprocess tensor parallel)
        # loads the kernels itself, from the build cache.
        return _ops_from_cache, ()

    def table(self) -> dict[str, Callable[..., Any]]:
        """Overrides for :data:`core.ops.DEFAULT_OPS`, by name."""
        return {
            "rms_norm": self.rms_norm,
            "fused_add_rms_norm": self.fused_add_rms_norm,
            "silu_and_mul": self.silu_and_mul,
            "rotary_embedding": self.rotary_embedding,
            "lm_head": self.lm_head,
        }

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not (_rows_ok(x) and weight.dtype == x.dtype and weight.is_contiguous()):
            return reference.rms_norm(x, weight, eps)
        h = x.shape[-1]
        out = torch.empty(x.shape, dtype=x.dtype)
        self._rms_norm(out.view(-1, h), x.view(-1, h) if x.dim() != 2 else x, weight, eps)
        return out

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fits = (
            x.dtype in _DTYPES and x.is_contiguous() and residual.is_contiguous()
            and x.shape == residual.shape and residual.dtype == x.dtype
            and weight.dtype == x.dtype and weight.is_contiguous()
        )
        if not fits:
            return reference.fused_add_rms_norm(x, residual, weight, eps)
        h = x.shape[-1]
        out = torch.empty(x.shape, dtype=x.dtype)
        new_residual = torch.empty(x.shape, dtype=x.dtype)
        self._fused_add_rms_norm(
            out.view(-1, h), new_residual.view(-1, h), x.view(-1, h), residual.view(-1, h), weight, eps
        )
        return out, new_residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if not (x.dtype in _DTYPES and x.is_contiguous() and x.shape[-1] % 2 == 0):
            return reference.silu_and_mul(x)
        d = x.shape[-1] // 2
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype)
        self._silu_and_mul(out.view(-1, d), x.view(-1, 2 * d))
        return out

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        rotary_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        d = query.shape[-1]
        fits = (
            query.dim() == 3 and key.dim() == 3 and query.dtype in _DTYPES
            and key.dtype == query.dtype and query.stride(2) == 1 and key.stride(2) == 1
            and query.stride(1) == d and key.stride(1) == d
            and positions.dtype == torch.int64 and positions.is_contiguous()
            and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
            and rotary_dim % 2 == 0
        )
        if not fits:
            return reference.rotary_embedding(positions, query, key, cos_sin_cache, rotary_dim)
        q_out = torch.empty(query.shape, dtype=query.dtype)
        k_out = torch.empty(key.shape, dtype=key.dtype)
        self._rotary(q_out, k_out, positions, query, key, cos_sin_cache, rotary_dim)
        return q_out, k_out

    def lm_head(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """float32 logits accumulated in float32 (the reference rounds bf16 logits to bf16).
        A float32 model keeps the reference's F.linear: it is already exact there."""
        fits = (
            hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == hidden.dtype
            and hidden.dim() == 2 and hidden.is_contiguous() and weight.is_contiguous()
        )
        if not fits:
            return reference.lm_head(hidden, weight)
        out = torch.empty((hidden.shape[0], weight.shape[0]), dtype=torch.float32)
        self._linear_f32out(out, hidden, weight)
        return out


def _ops_from_cache() -> CpuOps:
    return CpuOps(load_kernels())
