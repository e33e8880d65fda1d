"""Qwen3 (dense): the Llama network with an RMSNorm on every query and key head.

The only new block is the attention: after the q/k/v projection, each head of q and of k is
RMS-normalised over ``head_dim`` (its own learned scale, shared by all heads) before the
rotary embedding. Biases follow ``attention_bias``; the sliding window follows
``layer_types``. MLP, decoder layer, model and checkpoint names are Llama's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from core.models import ModelContext
from core.models.layers import RMSNorm, RotaryEmbedding
from core.models.llama import LlamaArgs, LlamaAttention, LlamaForCausalLM, layer_sliding_windows


class Qwen3Attention(LlamaAttention):
    """Llama's attention with per-head q/k RMSNorm; this rank's share of the heads."""

    def __init__(self, a: LlamaArgs, ctx: ModelContext, rotary_emb: RotaryEmbedding, layer: int):
        super().__init__(a, ctx, rotary_emb, layer)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps, ctx)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps, ctx)

    def per_head(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # [T, H, D] / [T, KVH, D], normed per head


def qwen3_args(hf_config: Any) -> LlamaArgs:
    base = LlamaArgs.from_hf(hf_config)
    return dataclasses.replace(base, mlp_bias=False, sliding_windows=layer_sliding_windows(hf_config))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Registry entry for ``Qwen3ForCausalLM``; q_norm/k_norm load under their HF names."""

    def __init__(self, hf_config: Any, ctx: ModelContext):
        super().__init__(hf_config, ctx, args=qwen3_args(hf_config), attention_cls=Qwen3Attention)
