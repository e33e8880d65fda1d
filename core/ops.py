"""Named ops that model layers call, so a platform (or a plugin) can replace one kernel.

The defaults are plain torch. A platform overrides entries through ``Platform.ops()``; a
plugin overrides one op on one platform through the ``core_op_overrides`` hook. The
resolved table is built once per engine and handed to the model; nothing is patched.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, result in ``x``'s dtype. x: [..., hidden]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype) if weight.dtype != torch.float32 else (xf * weight).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; return rms_norm(residual), residual``."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*d] (gate then up) -> silu(gate) * up, [..., d]."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (half-split) rotary embedding.

    :param positions: [T] int64
    :param query: [T, num_heads, head_size]
    :param key: [T, num_kv_heads, head_size]
    :param cos_sin_cache: [max_pos, rotary_dim] float32, cos in the first half, sin second
    :return: rotated (query, key), same shapes and dtype
    """
    cs = cos_sin_cache.index_select(0, positions)
    cos, sin = cs.chunk(2, dim=-1)  # [T, rotary_dim/2]
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)

    def rot(x: torch.Tensor) -> torch.Tensor:
        xr = x[..., :rotary_dim].float()
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        if rotary_dim == x.shape[-1]:
            return out
        return torch.cat((out, x[..., rotary_dim:]), dim=-1)

    return rot(query), rot(key)


def lm_head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits ``hidden @ weight.T`` as float32: hidden [n, h], weight [vocab rows, h].

    The default multiplies in the inputs' dtype and converts the result (so a bf16 model
    gets bf16-rounded logits); a platform may override it with a kernel that accumulates
    and returns float32.
    """
    return torch.nn.functional.linear(hidden, weight).float()


DEFAULT_OPS: MappingProxyType[str, Callable[..., Any]] = MappingProxyType(
    {
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "silu_and_mul": silu_and_mul,
        "rotary_embedding": rotary_embedding,
        "lm_head": lm_head,
    }
)


class Ops:
    """The resolved op table handed to a model: attribute access by op name."""

    def __init__(self, overrides: dict[str, Callable[..., Any]] | None = None):
        overrides = overrides or {}
        unknown = set(overrides) - set(DEFAULT_OPS)
        if unknown:
            raise ValueError(
                f"unknown op name(s) {sorted(unknown)}; overridable ops are {sorted(DEFAULT_OPS)}"
            )
        self._table = {**DEFAULT_OPS, **overrides}
        for name, fn in self._table.items():
            setattr(self, name, fn)

    def names(self) -> dict[str, str]:
        """op name -> qualified name of the implementation in use (for logs)."""
        return {n: _qualname(f) for n, f in self._table.items()}


def _qualname(fn: Callable[..., Any]) -> str:
    """Name of a function or of a callable object's class."""
    obj = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(obj, '__module__', '?')}.{obj.__qualname__}"
