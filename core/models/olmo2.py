"""OLMo 2 (``Olmo2ForCausalLM``): Llama's blocks with post-norms and a q/k norm over all heads.

Differences from :mod:`core.models.llama`:

* the decoder layer normalises each sub-block's *output* before the residual add
  (``x + post_attention_layernorm(attn(x))``, ``x + post_feedforward_layernorm(mlp(x))``)
  and has no input norm;
* q and k are RMS-normalised over the whole projection (all heads together, one learned
  scale per feature) right after the q/k/v projection, before the rotary embedding. Under
  tensor parallelism the mean square is all-reduced (:class:`ShardedRMSNorm`).

:class:`OlmoAttention` (with optional ``clip_qkv``) is shared with :mod:`core.models.olmoe`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from core.attention import AttentionMetadata
from core.models import ModelContext
from core.models.layers import RMSNorm, RotaryEmbedding, ShardedRMSNorm
from core.models.llama import LlamaArgs, LlamaAttention, LlamaForCausalLM, MakeMLP


class OlmoAttention(LlamaAttention):
    """Llama's attention with full-width q/k RMSNorms and optional clipping of q, k and v to
    ``[-clip_qkv, clip_qkv]`` (after the norms, as OLMoE does)."""

    def __init__(
        self,
        a: LlamaArgs,
        ctx: ModelContext,
        rotary_emb: RotaryEmbedding,
        layer: int,
        clip_qkv: float | None = None,
    ):
        super().__init__(a, ctx, rotary_emb, layer)
        self.clip_qkv = clip_qkv
        p, tp = self.qkv_proj, ctx.comm.world_size
        kv_total = a.num_kv_heads * a.head_dim
        self.q_norm = ShardedRMSNorm(
            a.num_heads * a.head_dim, a.rms_norm_eps, ctx, ctx.comm.rank * p.q_size, p.q_size
        )
        replicas = max(1, tp // a.num_kv_heads)
        self.k_norm = ShardedRMSNorm(
            kv_total, a.rms_norm_eps, ctx, p.kv_head_start * a.head_dim, p.kv_size, replicas
        )

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)  # [T, q_size] / [T, kv_size], over all heads
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        d = self.spec.head_size
        q = q.reshape(-1, self.spec.num_heads, d)  # [T, H, D]
        k = k.reshape(-1, self.spec.num_kv_heads, d)  # [T, KVH, D]
        v = v.reshape(-1, self.spec.num_kv_heads, d)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn.forward(q, k, v, kv_cache, metadata)  # [T, H, D]
        return self.o_proj(out.reshape(out.shape[0], -1))


class Olmo2DecoderLayer(nn.Module):
    """Post-norm block: each sub-block's output is normed, then added to the residual."""

    def __init__(
        self,
        a: LlamaArgs,
        ctx: ModelContext,
        rotary_emb: RotaryEmbedding,
        layer: int,
        attention_cls: type[nn.Module],
        make_mlp: MakeMLP,
    ):
        super().__init__()
        self.self_attn = attention_cls(a, ctx, rotary_emb, layer)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, ctx)
        self.mlp = make_mlp(a, ctx, layer)
        self.post_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, ctx)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, None]:
        if residual is not None:  # a pre-norm layer before this one left the sum unmade
            x = x + residual
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, kv_cache, metadata))
        x = x + self.post_feedforward_layernorm(self.mlp(x))
        return x, None  # the residual stream is x itself


def olmo2_args(hf_config: Any) -> LlamaArgs:
    return dataclasses.replace(LlamaArgs.from_hf(hf_config), mlp_bias=False)


class Olmo2ForCausalLM(LlamaForCausalLM):
    """Registry entry for ``Olmo2ForCausalLM``; checkpoint names are HF's (Llama's plus
    ``self_attn.q_norm``/``k_norm`` and ``post_feedforward_layernorm``)."""

    def __init__(self, hf_config: Any, ctx: ModelContext):
        super().__init__(
            hf_config,
            ctx,
            args=olmo2_args(hf_config),
            attention_cls=OlmoAttention,
            layer_cls=Olmo2DecoderLayer,
        )
