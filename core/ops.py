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

from core.sampler.kernel import NO_KERNEL
from core.structured_output.bitmask import apply_bitmask_default


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


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*d] (gate then up) -> gelu_tanh(gate) * up, [..., d] (Gemma's GeGLU)."""
    d = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :d], approximate="tanh") * x[..., d:]


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


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Mixture-of-experts feed-forward: ``sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))``.

    The reference groups the (token, choice) pairs by expert (a stable sort), runs one
    matmul pair per expert that received tokens over its contiguous slice, and scatters the
    weighted rows back with an fp32 accumulation.

    :param x: [T, hidden]
    :param w13: [E, 2 * ffn, hidden] per expert: gate rows then up rows (this rank's FFN slice)
    :param w2: [E, hidden, ffn]
    :param topk_weights: [T, K] float32 routing weights
    :param topk_ids: [T, K] int64 expert ids in [0, E)
    :return: [T, hidden] in ``x``'s dtype; a partial sum when the FFN dim is sharded
    """
    num_tokens, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, choice) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    rows = order // k  # token of each sorted pair
    xs = x.index_select(0, rows)  # [T*K, hidden], expert-contiguous
    ys = torch.empty_like(xs)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            h = torch.nn.functional.linear(xs[start : start + n], w13[expert])
            ys[start : start + n] = torch.nn.functional.linear(silu_and_mul(h), w2[expert])
            start += n
    weighted = ys.float() * topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, rows, weighted).to(x.dtype)


DEFAULT_OPS: MappingProxyType[str, Callable[..., Any]] = MappingProxyType(
    {
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "silu_and_mul": silu_and_mul,
        "gelu_tanh_and_mul": gelu_tanh_and_mul,
        "rotary_embedding": rotary_embedding,
        "lm_head": lm_head,
        "fused_moe": fused_moe,
        # Not a layer op: the sampler's fused kernel (core.sampler.kernel.SamplingKernel);
        # the default accepts nothing, so the sampler's torch pipeline runs.
        "sampling_kernel": NO_KERNEL,
        # Not a layer op: how the sampler applies structured output's token bitmasks
        # (core.structured_output.bitmask); the default masks on the logits' device, a
        # platform whose device cannot run the unpack ops supplies apply_bitmask_host.
        "grammar_bitmask": apply_bitmask_default,
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
