"""Llama (2, 3, 3.1+, SmolLM and other Llama-shaped checkpoints).

Read top to bottom: the config values used, the MLP, attention, the decoder layer, the
model, the causal-LM head, and beside it the checkpoint-name mapping. Covers grouped-query
attention, tied embeddings, RoPE (default, linear, llama3 scaling), an explicit
``head_dim``, and optional q/k/v/o and MLP biases. All linear layers are tensor-parallel
aware (see :mod:`core.models.layers`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from core.attention import AttentionMetadata, AttentionSpec
from core.models import ModelContext
from core.models.layers import (
    MergedColumnParallelLinear,
    MissingLayer,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_checkpoint,
    rope_parameters,
)


@dataclass(frozen=True)
class LlamaArgs:
    """The config values this file reads, with their defaults resolved."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: dict[str, Any]
    rotary_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]
    """Per layer: attend to the last N positions only, or None (full attention)."""
    attn_scale: float | None = None
    """Softmax scale; None: 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar ** -0.5)."""
    attn_soft_cap: float | None = None
    """Attention logit soft-cap (Gemma 2), or None."""

    @classmethod
    def from_hf(cls, c: Any) -> LlamaArgs:
        if getattr(c, "hidden_act", "silu") != "silu":
            raise ValueError(f"Llama with hidden_act {c.hidden_act!r} is not supported (only silu)")
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        rope = rope_parameters(c)
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=c.rms_norm_eps,
            max_position=c.max_position_embeddings,
            rope=rope,
            rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 1.0)),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(c, "attention_bias", False)),
            o_bias=bool(getattr(c, "attention_bias", False)),
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
            sliding_windows=(None,) * c.num_hidden_layers,  # Llama attends to everything
        )


def layer_sliding_windows(c: Any) -> tuple[int | None, ...]:
    """Per-layer sliding windows as transformers applies them.

    Configs with ``layer_types`` (Qwen2/3) window only their ``"sliding_attention"``
    layers; otherwise a set ``sliding_window`` applies to every layer (Mistral).
    ``use_sliding_window=False`` (Qwen, transformers 4.x) switches it off.
    """
    n = c.num_hidden_layers
    window = getattr(c, "sliding_window", None)
    if window is None or getattr(c, "use_sliding_window", True) is False:
        return (None,) * n
    types = getattr(c, "layer_types", None)
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window,) * n


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up are one column-parallel matmul.

    :param intermediate_size: overrides ``a.intermediate_size`` (MoE shared experts).
    """

    def __init__(self, a: LlamaArgs, ctx: ModelContext, intermediate_size: int | None = None):
        super().__init__()
        self.ops = ctx.ops
        size = intermediate_size or a.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(a.hidden_size, [size] * 2, ctx, bias=a.mlp_bias)
        self.down_proj = RowParallelLinear(size, a.hidden_size, ctx, bias=a.mlp_bias)

    def forward(
        self, x: torch.Tensor, norm: nn.Module | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x))``; with ``norm``, of ``norm(x)``; with ``residual``,
        plus ``residual`` (the decoder layer's folded form: :meth:`LlamaDecoderLayer.forward`)."""
        return self.down_proj(self.gate_up_proj.silu_and_mul(x, self.ops.silu_and_mul, norm), residual)


MakeMLP = Callable[[LlamaArgs, ModelContext, int], nn.Module]
"""Builds layer ``i``'s feed-forward block."""


def dense_mlp(a: LlamaArgs, ctx: ModelContext, layer: int) -> nn.Module:
    return LlamaMLP(a, ctx)


class LlamaAttention(nn.Module):
    """Self-attention over the paged KV cache; this rank's share of the heads."""

    def __init__(self, a: LlamaArgs, ctx: ModelContext, rotary_emb: RotaryEmbedding, layer: int):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            a.hidden_size, a.head_dim, a.num_heads, a.num_kv_heads, ctx, bias=a.qkv_bias
        )
        self.o_proj = RowParallelLinear(a.num_heads * a.head_dim, a.hidden_size, ctx, bias=a.o_bias)
        self.rotary_emb = rotary_emb
        self.spec = AttentionSpec(
            num_heads=self.qkv_proj.num_heads,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            head_size=a.head_dim,
            dtype=ctx.dtype,
            block_size=ctx.block_size,
            sliding_window=a.sliding_windows[layer],
            scale=a.attn_scale,
            logits_soft_cap=a.attn_soft_cap,
        )
        self.attn = ctx.make_attention(self.spec)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        norm: nn.Module | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention output projected; with ``norm``, of ``norm(x)``; with ``residual``,
        plus ``residual`` (the decoder layer's folded form: :meth:`LlamaDecoderLayer.forward`)."""
        x, norm = self.qkv_proj.unfolded(x, norm)
        # A family without per-head work lets the projection rotate q and k itself, where its
        # format's kernel can (one kernel fewer a layer on CUDA decode steps).
        qkv = self.qkv_proj.rotated(x, positions, self.rotary_emb, norm) if self._rope_in_projection else None
        rotated = qkv is not None
        if not rotated:
            qkv = self.qkv_proj(x, norm)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        d = self.spec.head_size
        q = q.view(-1, self.spec.num_heads, d)  # [T, H, D]
        k = k.view(-1, self.spec.num_kv_heads, d)  # [T, KVH, D]
        v = v.view(-1, self.spec.num_kv_heads, d)
        if not rotated:
            q, k = self.rotary_emb(positions, *self.per_head(q, k))
        out = self.attn.forward(q, k, v, kv_cache, metadata)  # [T, H, D]
        return self.o_proj(out.reshape(out.shape[0], -1), residual)

    def per_head(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a family does to each query and key head before the rotary embedding
        (Qwen3: an RMSNorm); nothing for Llama."""
        return q, k

    @property
    def _rope_in_projection(self) -> bool:
        return type(self).per_head is LlamaAttention.per_head


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried un-normed between layers so each
    norm can fuse the residual add."""

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
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, ctx)
        self.self_attn = attention_cls(a, ctx, rotary_emb, layer)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, ctx)
        self.mlp = make_mlp(a, ctx, layer)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._folds_norms(x):
            # The norms go into the projections after them and the residual adds into the
            # projections before (CUDA decode steps: no norm kernel): the layer returns the
            # residual stream itself, with residual None.
            h = x if residual is None else x + residual
            h = self.self_attn(positions, h, kv_cache, metadata, self.input_layernorm, h)
            return self.mlp(h, self.post_attention_layernorm, h), None
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def _folds_norms(self, x: torch.Tensor) -> bool:
        """Whether this step takes the folded form: core's own attention and MLP blocks (whose
        forwards take the norm and the residual) and norms, and a QKV projection whose format
        folds the input norm at these rows (each projection still falls back on its own)."""
        attn = self.self_attn
        return (type(attn).forward is LlamaAttention.forward and type(self.mlp).forward is LlamaMLP.forward
                and type(self.input_layernorm) is RMSNorm and type(self.post_attention_layernorm) is RMSNorm
                and attn.qkv_proj.linear_method.folds_norm(attn.qkv_proj, x, self.input_layernorm))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm; with ``ctx.stage`` (pipeline parallelism)
    only this stage's share of them (see the pipeline contract in :mod:`core.models`)."""

    def __init__(
        self,
        a: LlamaArgs,
        ctx: ModelContext,
        attention_cls: type[nn.Module],
        make_mlp: MakeMLP,
        layer_cls: type[nn.Module],
    ):
        super().__init__()
        self.start, self.end = (ctx.stage.start, ctx.stage.end) if ctx.stage else (0, a.num_layers)
        self.is_first = ctx.stage is None or ctx.stage.is_first
        self.is_last = ctx.stage is None or ctx.stage.is_last
        self.hidden_size, self.dtype = a.hidden_size, ctx.dtype
        # The last stage keeps the embedding when the LM head is tied to it.
        keep_embed = self.is_first or (self.is_last and a.tie_word_embeddings)
        self.embed_tokens = (
            VocabParallelEmbedding(a.vocab_size, a.hidden_size, ctx) if keep_embed else MissingLayer()
        )
        # One cos/sin table shared by every layer (it is [max_position, rotary_dim] floats).
        rotary = RotaryEmbedding(a.head_dim, a.rotary_dim, a.max_position, a.rope, ctx)
        self.layers = nn.ModuleList(
            layer_cls(a, ctx, rotary, i, attention_cls, make_mlp) if self.start <= i < self.end
            else MissingLayer()
            for i in range(a.num_layers)
        )
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, ctx) if self.is_last else MissingLayer()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        intermediate: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        if intermediate is None:
            x, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        else:  # a later pipeline stage: the previous stage's hidden state and residual
            x, residual = intermediate["hidden"], intermediate["residual"]
        own = self.layers[self.start : self.end]
        for layer, kv_cache in zip(own, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, metadata)
        if not self.is_last:
            # A layer returning residual None (its output is the whole stream, OLMo-2) hands
            # on zeros: the next layer adds them, exactly.
            return {"hidden": x, "residual": torch.zeros_like(x) if residual is None else residual}
        # A layer returns residual None when its output already is the residual stream.
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def intermediate_spec(self, num_tokens: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """What one stage sends the next: the hidden state and the residual, [T, hidden]."""
        shape = (num_tokens, self.hidden_size)
        return [("hidden", shape, self.dtype), ("residual", shape, self.dtype)]


class LlamaForCausalLM(nn.Module):
    """The registry entry for ``LlamaForCausalLM`` (see :mod:`core.models` for the contract).

    Llama-shaped families reuse it: ``args`` replaces the values read from ``hf_config``
    (biases, sliding windows), ``attention_cls`` the attention block (Qwen3's q/k norm) and
    ``make_mlp(args, ctx, layer)`` each layer's feed-forward block (MoE families) and
    ``layer_cls`` the decoder layer (OLMo-2's post-norms), called like LlamaDecoderLayer.
    It implements the pipeline contract of :mod:`core.models` (``ctx.stage``).
    """

    supports_pipeline_parallel = True

    def __init__(
        self,
        hf_config: Any,
        ctx: ModelContext,
        args: LlamaArgs | None = None,
        attention_cls: type[nn.Module] | None = None,
        make_mlp: MakeMLP | None = None,
        layer_cls: type[nn.Module] | None = None,
    ):
        super().__init__()
        self.args = args if args is not None else LlamaArgs.from_hf(hf_config)
        self.model = LlamaModel(
            self.args,
            ctx,
            attention_cls or LlamaAttention,
            make_mlp or dense_mlp,
            layer_cls or LlamaDecoderLayer,
        )
        tied = self.model.embed_tokens if self.args.tie_word_embeddings else None
        self.lm_head = (
            ParallelLMHead(self.args.vocab_size, self.args.hidden_size, ctx, tied=tied)
            if self.model.is_last else MissingLayer()
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        intermediate: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden_size] (a pipeline
        stage but the last: the intermediate tensors for the next stage)."""
        return self.model(input_ids, positions, kv_caches, metadata, intermediate)

    def intermediate_spec(self, num_tokens: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return self.model.intermediate_spec(num_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32 (all ranks' vocabulary slices)."""
        return self.lm_head(hidden)

    def attention_specs(self) -> list[AttentionSpec]:
        return [layer.self_attn.spec for layer in self.model.layers[self.model.start : self.model.end]]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, weights, STACKED_PARAMS, skip=_skipped(self.args))


# ---- checkpoint names ------------------------------------------------------------------------

STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    # (checkpoint module name, our fused module name, shard id inside the fused module)
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


def _skipped(a: LlamaArgs) -> tuple[str, ...]:
    # Old checkpoints store the rotary table; tied ones sometimes repeat the embedding.
    return ("rotary_emb.inv_freq",) + (("lm_head.weight",) if a.tie_word_embeddings else ())
