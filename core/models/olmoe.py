"""OLMoE (``OlmoeForCausalLM``): OLMo-2's attention in a pre-norm Llama block with a sparse
mixture of experts as every layer's feed-forward.

Attention is :class:`~core.models.olmo2.OlmoAttention` (q/k RMSNorm over all heads, then
optional ``clip_qkv`` clipping of q, k and v). Every layer routes each token to its top
``num_experts_per_tok`` of ``num_experts`` SwiGLU experts of ``intermediate_size`` (softmax
weights, renormalised only with ``norm_topk_prob``). Names: ``mlp.gate``,
``mlp.experts.{e}.gate_proj/up_proj/down_proj``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from core.models import ModelContext
from core.models.layers import load_checkpoint
from core.models.llama import STACKED_PARAMS, LlamaArgs, LlamaForCausalLM, _skipped
from core.models.moe import SparseMoeBlock, expert_checkpoint_names
from core.models.olmo2 import OlmoAttention, olmo2_args


class OlmoeForCausalLM(LlamaForCausalLM):
    """Registry entry for ``OlmoeForCausalLM``."""

    def __init__(self, hf_config: Any, ctx: ModelContext):
        num_experts, top_k = hf_config.num_experts, hf_config.num_experts_per_tok
        renormalize = bool(getattr(hf_config, "norm_topk_prob", False))

        def moe(a: LlamaArgs, ctx: ModelContext, layer: int) -> nn.Module:
            return SparseMoeBlock(
                a.hidden_size, num_experts, a.intermediate_size, top_k, renormalize, ctx
            )

        attention = functools.partial(OlmoAttention, clip_qkv=getattr(hf_config, "clip_qkv", None))
        super().__init__(
            hf_config, ctx, args=olmo2_args(hf_config), attention_cls=attention, make_mlp=moe
        )
        self.num_experts = num_experts

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        stacked = expert_checkpoint_names(self.num_experts) + STACKED_PARAMS
        load_checkpoint(self, weights, stacked, skip=_skipped(self.args))
