"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention with a sparse MoE feed-forward.

Attention is Qwen2's (q/k/v biases, :mod:`core.models.qwen2`). Each MoE layer routes every
token to its top ``num_experts_per_tok`` of ``num_experts`` experts (softmax weights,
renormalised only with ``norm_topk_prob``) and adds a shared expert scaled by
``sigmoid(shared_expert_gate(x))``. Layers in ``mlp_only_layers``, and those not on the
``decoder_sparse_step`` stride, keep a dense MLP of ``intermediate_size``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from core.models import ModelContext
from core.models.layers import load_checkpoint
from core.models.llama import STACKED_PARAMS, LlamaArgs, LlamaForCausalLM, LlamaMLP, _skipped
from core.models.moe import SparseMoeBlock, expert_checkpoint_names
from core.models.qwen2 import qwen2_args


def is_moe_layer(hf_config: Any, layer: int) -> bool:
    """Whether layer ``layer`` is sparse, as Qwen2/3-MoE decide it."""
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return (
        layer not in (getattr(hf_config, "mlp_only_layers", None) or [])
        and hf_config.num_experts > 0
        and (layer + 1) % step == 0
    )


def qwen_moe_mlp(hf_config: Any, shared: bool):
    """``make_mlp`` for the Qwen MoE families; ``shared``: add the gated shared expert."""

    def make(a: LlamaArgs, ctx: ModelContext, layer: int) -> nn.Module:
        if not is_moe_layer(hf_config, layer):
            return LlamaMLP(a, ctx)
        shared_mlp = None
        if shared:
            shared_mlp = LlamaMLP(a, ctx, hf_config.shared_expert_intermediate_size)
        return SparseMoeBlock(
            a.hidden_size,
            hf_config.num_experts,
            hf_config.moe_intermediate_size,
            hf_config.num_experts_per_tok,
            bool(getattr(hf_config, "norm_topk_prob", False)),
            ctx,
            shared_expert=shared_mlp,
            shared_gate=shared,
        )

    return make


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Registry entry for ``Qwen2MoeForCausalLM``; names: ``mlp.gate``, ``mlp.experts.{e}.*``,
    ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate``."""

    def __init__(self, hf_config: Any, ctx: ModelContext):
        super().__init__(
            hf_config, ctx, args=qwen2_args(hf_config), make_mlp=qwen_moe_mlp(hf_config, True)
        )
        self.num_experts = hf_config.num_experts

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        stacked = expert_checkpoint_names(self.num_experts) + STACKED_PARAMS
        load_checkpoint(self, weights, stacked, skip=_skipped(self.args))
