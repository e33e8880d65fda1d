"""Mixtral: the Mistral network with a sparse mixture of experts in place of the MLP.

Attention, norms, RoPE and the sliding window are Mistral's (:mod:`core.models.mistral`).
Each layer's feed-forward is a :class:`~core.models.moe.SparseMoeBlock`: a router over
``num_local_experts`` SwiGLU experts, the top ``num_experts_per_tok`` weighted by their
softmax probabilities renormalised to sum to 1. Checkpoint names: ``block_sparse_moe.gate``
and ``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate/up/down).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from core.models import ModelContext
from core.models.layers import load_checkpoint
from core.models.llama import STACKED_PARAMS, LlamaArgs, LlamaForCausalLM, _skipped
from core.models.mistral import mistral_args
from core.models.moe import SparseMoeBlock, expert_checkpoint_names


class MixtralForCausalLM(LlamaForCausalLM):
    """Registry entry for ``MixtralForCausalLM``."""

    def __init__(self, hf_config: Any, ctx: ModelContext):
        num_experts, top_k = hf_config.num_local_experts, hf_config.num_experts_per_tok

        def moe(a: LlamaArgs, ctx: ModelContext, layer: int) -> nn.Module:
            return SparseMoeBlock(a.hidden_size, num_experts, a.intermediate_size, top_k, True, ctx)

        super().__init__(hf_config, ctx, args=mistral_args(hf_config), make_mlp=moe)
        self.num_experts = num_experts

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        experts = expert_checkpoint_names(
            self.num_experts, ".block_sparse_moe.experts.", ("w1", "w3", "w2")
        )
        gate = ((".block_sparse_moe.gate.", ".mlp.gate.", None),)
        load_checkpoint(self, weights, experts + gate + STACKED_PARAMS, skip=_skipped(self.args))
