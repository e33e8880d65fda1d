"""Mixture-of-experts feed-forward, shared by every MoE model file.

A :class:`SparseMoeBlock` is a router (``gate``: hidden -> one logit per expert), the routed
experts (:class:`FusedExperts`, all experts' weights in two stacked tensors, multiplied by the
``fused_moe`` op of ``ctx.ops``) and optionally a shared expert that every token passes
through, scaled by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE).

Routing (:func:`select_experts`): softmax over all experts' logits in float32, then the top
``k``; with ``renormalize`` the k weights are divided by their sum. Softmax-then-top-k with
renormalisation equals top-k-then-softmax over the chosen logits (Mixtral's original
formulation), so one path serves both.

Tensor parallelism: every rank holds every expert, sharded along the FFN dimension (rows of
gate/up, columns of down), so the expert output is a partial sum reduced with one
``all_reduce``, exactly like a column/row-parallel MLP pair. The router is replicated.

Checkpoint names: per-expert tensors ``experts.{e}.{gate,up,down}`` (or Mixtral's
``w1``/``w3``/``w2``) load into ``experts.w13_weight`` / ``experts.w2_weight`` as shard
``(e, part)``; :func:`expert_checkpoint_names` builds that mapping for ``load_checkpoint``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from core.models import ModelContext
from core.models.layers import _copy_into, _divide, _param, _shard

GATE, UP, DOWN = 0, 1, 2
"""Shard part ids of one expert's three projections."""


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] float32, expert ids [T, k] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Router(nn.Module):
    """The replicated gate: one logit per expert (no bias in any supported family)."""

    def __init__(self, hidden_size: int, num_experts: int, ctx: ModelContext):
        super().__init__()
        self.weight = _param(ctx, num_experts, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)  # [T, E]


class FusedExperts(nn.Module):
    """All routed experts of one layer, this rank's slice of each expert's FFN dimension.

    ``w13_weight`` [E, 2 * ffn_per_rank, hidden]: gate rows then up rows of each expert;
    ``w2_weight`` [E, hidden, ffn_per_rank]. Output: a partial sum over this rank's FFN
    slice, all-reduced here when tensor-parallel.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_size: int, ctx: ModelContext):
        super().__init__()
        if ctx.weight_format != "dense":
            raise ValueError(
                f"MoE experts support --weight-format dense only, got {ctx.weight_format!r}"
            )
        self.comm = ctx.comm
        self.ops = ctx.ops
        self.num_experts = num_experts
        self.ffn_per_rank = _divide(ffn_size, ctx.comm.world_size, "MoE expert FFN size")
        self.w13_weight = _param(ctx, num_experts, 2 * self.ffn_per_rank, hidden_size)
        self.w2_weight = _param(ctx, num_experts, hidden_size, self.ffn_per_rank)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, ffn_per_rank={self.ffn_per_rank}"

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = self.ops.fused_moe(x, self.w13_weight, self.w2_weight, weights, ids)
        return self.comm.all_reduce(out) if self.comm.world_size > 1 else out

    def load_weight(self, name: str, tensor: torch.Tensor, shard: Any = None) -> None:
        expert, part = shard
        if not 0 <= expert < self.num_experts:
            raise ValueError(
                f"checkpoint has expert {expert} but the config has {self.num_experts} experts "
                f"(num_experts / num_local_experts in config.json)"
            )
        n, rank, what = self.ffn_per_rank, self.comm.rank, f"experts.{expert}[{part}]"
        if part == DOWN:
            _copy_into(self.w2_weight.data[expert], _shard(tensor, 1, rank, n, what), what)
        else:
            dst = self.w13_weight.data[expert].narrow(0, part * n, n)
            _copy_into(dst, _shard(tensor, 0, rank, n, what), what)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ an optional gated shared expert): [T, hidden] -> [T, hidden].

    :param shared_expert: a dense MLP module every token goes through (Qwen2-MoE), or None.
    :param shared_gate: with a shared expert, whether its output is scaled by
        ``sigmoid(shared_expert_gate(x))``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        ffn_size: int,
        top_k: int,
        renormalize: bool,
        ctx: ModelContext,
        shared_expert: nn.Module | None = None,
        shared_gate: bool = False,
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok {top_k} must be between 1 and the number of experts "
                f"({num_experts}); check config.json"
            )
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Router(hidden_size, num_experts, ctx)
        self.experts = FusedExperts(num_experts, hidden_size, ffn_size, ctx)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Router(hidden_size, 1, ctx) if shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


def expert_checkpoint_names(
    num_experts: int, prefix: str = ".mlp.experts.", names=("gate_proj", "up_proj", "down_proj"),
    ours: str = ".mlp.experts.",
) -> tuple[tuple[str, str, Any], ...]:
    """``load_checkpoint`` stacked entries mapping per-expert checkpoint tensors
    (``{prefix}{e}.{name}.``) onto :class:`FusedExperts` parameters as shard ``(e, part)``."""
    entries = []
    for e in range(num_experts):
        for part, name in zip((GATE, UP, DOWN), names):
            target = f"{ours}w2_" if part == DOWN else f"{ours}w13_"
            entries.append((f"{prefix}{e}.{name}.", target, (e, part)))
    return tuple(entries)
