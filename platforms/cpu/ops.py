"""The CPU platform's op table: csrc/cpu kernels for the element-wise ops of a layer.

Each function has the signature and result of its reference in :mod:`core.ops` (the same
roundings, see csrc/cpu/elementwise.cpp) and allocates its outputs, so callers see the
functional contract. What one kernel call replaces is a handful of torch ops, each with its
own dispatch and temporary: on a 135M-parameter model at batch 1 that overhead, not the
arithmetic, is what a layer's element-wise work costs. Inputs the kernels do not take
(mixed dtypes, rows that are not contiguous) go to the reference: slower, never wrong.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from core import ops as reference
from platforms.cpu.kernels import load_kernels
from platforms.cpu.linear import (
    GroupedQuant,
    dequantized_linear,
    group_int8,
    grouped_matmul,
    grouped_takes,
    released_codes,
)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rows_ok(x: torch.Tensor) -> bool:
    """``x`` viewed as [rows, last] without a copy: contiguous, or 2-D with unit stride."""
    return x.dtype in _DTYPES and x.stride(-1) == 1 and (x.dim() == 2 or x.is_contiguous())


@dataclass
class HeadPolicy:
    """Whether a float32 LM head may multiply through int8 codes: set by the platform when
    the engine chose a quantized weight format (``--weight-format int4/int8``), so the dense
    format keeps torch's matmul, bit-identical to HF transformers."""

    quantized: bool = False


class CpuOps:
    """Builds the op table over the loaded ``torch.ops.core_cpu`` namespace."""

    def __init__(self, kernels: Any, head: HeadPolicy | None = None):
        self._kernels = kernels
        self._head = head or HeadPolicy()
        self._head_codes: dict[int, tuple[Any, int, GroupedQuant | None]] = {}
        self._rms_norm = kernels.rms_norm.default
        self._fused_add_rms_norm = kernels.fused_add_rms_norm.default
        self._silu_and_mul = kernels.silu_and_mul.default
        self._rotary = kernels.rotary_embedding.default
        self._linear_f32out = kernels.linear_f32out.default

    def __reduce__(self):
        # The op handles cannot be pickled; a worker process (multiprocess tensor parallel)
        # loads the kernels itself, from the build cache.
        return _ops_from_cache, (self._head,)

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
        A float32 model keeps the reference's F.linear (already exact there), except under a
        quantized weight format when the weight lies exactly on an int8 grid of 32-wide groups
        (a GGUF Q8_0 embedding, as the embedded SmolLM2's): then its int8 codes are the same
        values in a quarter of the bytes, multiplied by ``quant_linear`` (int8 activations).
        A table released for those codes (``QuantizedLinear.prepare_embedding``) has no dense
        copy left: more rows than ``quant_linear`` takes multiply by it dequantized again."""
        released = released_codes(weight)
        if released is not None:
            flat = hidden.reshape(-1, hidden.shape[-1])
            if grouped_takes(flat.shape[0], released.bits):
                return grouped_matmul(self._kernels, flat if flat.stride(-1) == 1 else flat.contiguous(), released)
            return dequantized_linear(self._kernels, flat, released, None)
        if hidden.dtype == torch.float32 and self._head.quantized and grouped_takes(hidden.shape[0], 8):
            packed = self._exact_int8(weight)
            if packed is not None and hidden.dim() == 2 and hidden.stride(-1) == 1:
                return grouped_matmul(self._kernels, hidden, packed)
        fits = (
            hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == hidden.dtype
            and hidden.dim() == 2 and hidden.is_contiguous() and weight.is_contiguous()
        )
        if not fits:
            return reference.lm_head(hidden, weight)
        out = torch.empty((hidden.shape[0], weight.shape[0]), dtype=torch.float32)
        self._linear_f32out(out, hidden, weight)
        return out


    def _exact_int8(self, weight: torch.Tensor) -> GroupedQuant | None:
        """The weight's int8 codes when they reproduce it exactly, else None; computed once per
        weight (and again after an in-place change, which bumps its version)."""
        key = id(weight)
        held = self._head_codes.get(key)
        if held is not None and held[0]() is weight and held[1] == weight._version:
            return held[2]
        packed = None
        if weight.dim() == 2 and weight.dtype == torch.float32 and weight.shape[1] % 32 == 0:
            packed = group_int8(weight)
            if not packed.reproduces(weight):
                packed = None
        self._head_codes[key] = (weakref.ref(weight), weight._version, packed)
        return packed


def _ops_from_cache(head: HeadPolicy | None = None) -> CpuOps:
    return CpuOps(load_kernels(), head)
