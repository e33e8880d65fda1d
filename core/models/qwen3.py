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
from torch import nn

from core.attention import AttentionMetadata, AttentionSpec
from core.models import ModelContext
from core.models.layers import QKVParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear
from core.models.llama import LlamaArgs, LlamaForCausalLM, layer_sliding_windows


class Qwen3Attention(nn.Module):
    """Self-attention with per-head q/k RMSNorm; this rank's share of the heads."""

    def __init__(self, a: LlamaArgs, ctx: ModelContext, rotary_emb: RotaryEmbedding, layer: int):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            a.hidden_size, a.head_dim, a.num_heads, a.num_kv_heads, ctx, bias=a.qkv_bias
        )
        self.o_proj = RowParallelLinear(a.num_heads * a.head_dim, a.hidden_size, ctx, bias=a.o_bias)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps, ctx)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps, ctx)
        self.rotary_emb = rotary_emb
        self.spec = AttentionSpec(
            num_heads=self.qkv_proj.num_heads,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            head_size=a.head_dim,
            dtype=ctx.dtype,
            block_size=ctx.block_size,
            sliding_window=a.sliding_windows[layer],
        )
        self.attn = ctx.make_attention(self.spec)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        d = self.spec.head_size
        q = self.q_norm(q.reshape(-1, self.spec.num_heads, d))  # [T, H, D], normed per head
        k = self.k_norm(k.reshape(-1, self.spec.num_kv_heads, d))  # [T, KVH, D]
        v = v.reshape(-1, self.spec.num_kv_heads, d)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn.forward(q, k, v, kv_cache, metadata)  # [T, H, D]
        return self.o_proj(out.reshape(out.shape[0], -1))


def qwen3_args(hf_config: Any) -> LlamaArgs:
    base = LlamaArgs.from_hf(hf_config)
    return dataclasses.replace(base, mlp_bias=False, sliding_windows=layer_sliding_windows(hf_config))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Registry entry for ``Qwen3ForCausalLM``; q_norm/k_norm load under their HF names."""

    def __init__(self, hf_config: Any, ctx: ModelContext):
        super().__init__(hf_config, ctx, args=qwen3_args(hf_config), attention_cls=Qwen3Attention)
