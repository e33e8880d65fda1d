"""Gemma 2 (``Gemma2ForCausalLM``); :mod:`core.models.gemma3` reuses its blocks.

Read top to bottom: the config values, the norm, the MLP, the decoder layer, the model, the
causal-LM head and the checkpoint names. What sets Gemma apart from Llama:

* RMSNorm scales by ``1 + weight`` (the checkpoint stores the offset from 1; we add the 1
  when loading, so the norm op is the usual one);
* the MLP is GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``;
* four norms per layer ("sandwich"): the attention and MLP outputs are normed again before
  the residual add;
* the embedding is multiplied by ``sqrt(hidden_size)`` (rounded to the model dtype, as HF does);
* attention scale ``query_pre_attn_scalar ** -0.5``, attention logits soft-capped at
  ``attn_logit_softcapping`` (``AttentionSpec.logits_soft_cap``), final logits soft-capped
  at ``final_logit_softcapping``;
* ``layer_types`` alternates sliding-window (``sliding_window``) and full-attention layers.

Released checkpoints tie the embeddings (the config default). All linear layers are tensor-parallel aware.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from core.attention import AttentionMetadata, AttentionSpec
from core.models import ModelContext
from core.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_checkpoint,
    rope_parameters,
)
from core.models.llama import STACKED_PARAMS, LlamaArgs, LlamaAttention, layer_sliding_windows


def gemma_args(c: Any) -> LlamaArgs:
    """Gemma's config as :class:`LlamaArgs` (Llama's reader refuses its GELU, so it is
    read here; every field Llama's attention block uses has Gemma's meaning)."""
    act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma with hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    if getattr(c, "use_bidirectional_attention", False):
        raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is not supported")
    head_dim = c.head_dim
    rope = rope_parameters(c)
    return LlamaArgs(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=c.rms_norm_eps,
        max_position=c.max_position_embeddings,
        rope=rope,
        rotary_dim=head_dim,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        qkv_bias=bool(getattr(c, "attention_bias", False)),
        o_bias=bool(getattr(c, "attention_bias", False)),
        mlp_bias=False,
        sliding_windows=layer_sliding_windows(c),
        attn_scale=float(c.query_pre_attn_scalar) ** -0.5,
        attn_soft_cap=getattr(c, "attn_logit_softcapping", None),
    )


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight is the offset from 1 (``x_normed * (1 + w)``)."""

    def load_weight(self, name: str, tensor: torch.Tensor, shard: Any = None) -> None:
        super().load_weight(name, tensor.float() + 1.0, shard)


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)); gate and up are one column-parallel matmul."""

    def __init__(self, a: LlamaArgs, ctx: ModelContext):
        super().__init__()
        self.ops = ctx.ops
        self.gate_up_proj = MergedColumnParallelLinear(a.hidden_size, [a.intermediate_size] * 2, ctx)
        self.down_proj = RowParallelLinear(a.intermediate_size, a.hidden_size, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """Sandwich-norm block; the residual stream is carried un-normed between layers so the
    input and pre-feed-forward norms fuse the residual add."""

    def __init__(
        self,
        a: LlamaArgs,
        ctx: ModelContext,
        rotary_emb: RotaryEmbedding,
        layer: int,
        attention_cls: type[nn.Module],
    ):
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps, ctx)
        self.self_attn = attention_cls(a, ctx, rotary_emb, layer)
        self.post_attention_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps, ctx)
        self.pre_feedforward_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps, ctx)
        self.mlp = GemmaMLP(a, ctx)
        self.post_feedforward_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps, ctx)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, kv_cache, metadata))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    """Scaled embedding, the layers (each with the rotary table of its layer type), final norm.

    :param layer_rope: RoPE settings of layer ``i`` (Gemma 3 gives local and global layers
        different bases); layers with equal settings share one table.
    """

    def __init__(
        self,
        a: LlamaArgs,
        ctx: ModelContext,
        attention_cls: type[nn.Module],
        layer_rope: Callable[[int], dict[str, Any]],
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, ctx)
        self.embed_scale = float(a.hidden_size) ** 0.5
        tables: dict[str, RotaryEmbedding] = {}
        layers = []
        for i in range(a.num_layers):
            params = layer_rope(i)
            key = repr(sorted(params.items()))
            if key not in tables:
                tables[key] = RotaryEmbedding(a.head_dim, a.rotary_dim, a.max_position, params, ctx)
            layers.append(GemmaDecoderLayer(a, ctx, tables[key], i, attention_cls))
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps, ctx)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # HF rounds the scale to the dtype
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, metadata)
        x, _ = self.norm(x, residual)
        return x


class Gemma2ForCausalLM(nn.Module):
    """The registry entry for ``Gemma2ForCausalLM`` (see :mod:`core.models` for the contract).

    ``attention_cls``, ``layer_rope`` and ``args`` let Gemma 3 swap in its q/k-normed
    attention, its per-layer-type RoPE and its config reading.
    """

    def __init__(
        self,
        hf_config: Any,
        ctx: ModelContext,
        attention_cls: type[nn.Module] = LlamaAttention,
        layer_rope: Callable[[int], dict[str, Any]] | None = None,
        args: LlamaArgs | None = None,
    ):
        super().__init__()
        self.args = args if args is not None else gemma_args(hf_config)
        self.final_soft_cap = getattr(hf_config, "final_logit_softcapping", None)
        rope = layer_rope or (lambda i: self.args.rope)
        self.model = GemmaModel(self.args, ctx, attention_cls, rope)
        a = self.args
        tied = self.model.embed_tokens if a.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(a.vocab_size, a.hidden_size, ctx, tied=tied)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32, soft-capped when the config says so."""
        logits = self.lm_head(hidden)
        if self.final_soft_cap is not None:
            logits = self.final_soft_cap * torch.tanh(logits / self.final_soft_cap)
        return logits

    def attention_specs(self) -> list[AttentionSpec]:
        return [layer.self_attn.spec for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = ("lm_head.weight",) if self.args.tie_word_embeddings else ()
        load_checkpoint(self, weights, STACKED_PARAMS, skip=skip)
