"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention with a sparse MoE feed-forward.

Attention is Qwen3's (per-head q/k RMSNorm, :mod:`core.models.qwen3`); the feed-forward is
Qwen2-MoE's routing without a shared expert (``norm_topk_prob`` renormalises the top-k
weights; ``mlp_only_layers`` / ``decoder_sparse_step`` pick dense layers).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from core.models import ModelContext
from core.models.layers import load_checkpoint
from core.models.llama import STACKED_PARAMS, LlamaForCausalLM, _skipped
from core.models.moe import expert_checkpoint_names
from core.models.qwen2_moe import qwen_moe_mlp
from core.models.qwen3 import Qwen3Attention, qwen3_args


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Registry entry for ``Qwen3MoeForCausalLM``; names: ``mlp.gate``, ``mlp.experts.{e}.*``."""

    def __init__(self, hf_config: Any, ctx: ModelContext):
        super().__init__(
            hf_config,
            ctx,
            args=qwen3_args(hf_config),
            attention_cls=Qwen3Attention,
            make_mlp=qwen_moe_mlp(hf_config, False),
        )
        self.num_experts = hf_config.num_experts

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        stacked = expert_checkpoint_names(self.num_experts) + STACKED_PARAMS
        load_checkpoint(self, weights, stacked, skip=_skipped(self.args))
