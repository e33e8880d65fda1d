"""GPT-2: learned absolute positions, LayerNorm, GELU MLP, no rotary embedding.

Read top to bottom: config values, MLP, attention, block, model, LM head (always tied to
the token embedding), then the checkpoint-name mapping. HF stores GPT-2's projections as
``Conv1D`` (weight ``[in, out]``, the transpose of ``nn.Linear``); the loader transposes
them (a view) and splits the fused ``c_attn`` into q, k and v so the tensor-parallel
layers can shard each.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from core.attention import AttentionMetadata, AttentionSpec
from core.models import ModelContext
from core.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_checkpoint,
)

_ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


@dataclass(frozen=True)
class GPT2Args:
    """The config values this file reads."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    inner_size: int
    max_position: int
    eps: float
    activation: str
    scale_attn_weights: bool
    scale_by_layer: bool
    """``scale_attn_by_inverse_layer_idx``: layer i also divides its scores by i + 1."""

    @classmethod
    def from_hf(cls, c: Any) -> GPT2Args:
        if c.activation_function not in _ACTIVATIONS:
            raise ValueError(
                f"GPT-2 activation {c.activation_function!r} is not supported; supported: "
                f"{sorted(_ACTIVATIONS)}"
            )
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.n_embd,
            num_layers=c.n_layer,
            num_heads=c.n_head,
            inner_size=c.n_inner or 4 * c.n_embd,
            max_position=c.n_positions,
            eps=c.layer_norm_epsilon,
            activation=c.activation_function,
            scale_attn_weights=bool(getattr(c, "scale_attn_weights", True)),
            scale_by_layer=bool(getattr(c, "scale_attn_by_inverse_layer_idx", False)),
        )


def _layer_norm(a: GPT2Args, ctx: ModelContext) -> nn.LayerNorm:
    norm = nn.LayerNorm(a.hidden_size, eps=a.eps, device=ctx.device, dtype=ctx.dtype)
    return norm.requires_grad_(False)


class GPT2MLP(nn.Module):
    def __init__(self, a: GPT2Args, ctx: ModelContext):
        super().__init__()
        self.c_fc = ColumnParallelLinear(a.hidden_size, a.inner_size, ctx, bias=True)
        self.c_proj = RowParallelLinear(a.inner_size, a.hidden_size, ctx, bias=True)
        self.act = _ACTIVATIONS[a.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Attention(nn.Module):
    """Multi-head attention (no rotary: positions entered through the embedding)."""

    def __init__(self, a: GPT2Args, ctx: ModelContext, layer: int):
        super().__init__()
        head_dim = a.hidden_size // a.num_heads
        self.qkv_proj = QKVParallelLinear(a.hidden_size, head_dim, a.num_heads, a.num_heads, ctx, bias=True)
        self.c_proj = RowParallelLinear(a.hidden_size, a.hidden_size, ctx, bias=True)
        scale = head_dim**-0.5 if a.scale_attn_weights else 1.0
        if a.scale_by_layer:
            scale /= layer + 1
        self.spec = AttentionSpec(
            num_heads=self.qkv_proj.num_heads,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            head_size=head_dim,
            dtype=ctx.dtype,
            block_size=ctx.block_size,
            scale=scale,
        )
        self.attn = ctx.make_attention(self.spec)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        size = self.qkv_proj.q_size
        q, k, v = self.qkv_proj(x).split([size, size, size], dim=-1)
        shape = (-1, self.spec.num_heads, self.spec.head_size)  # [T, H, D]
        out = self.attn.forward(q.reshape(shape), k.reshape(shape), v.reshape(shape), kv_cache, metadata)
        return self.c_proj(out.reshape(out.shape[0], -1))


class GPT2Block(nn.Module):
    """Pre-norm block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, a: GPT2Args, ctx: ModelContext, layer: int):
        super().__init__()
        self.ln_1 = _layer_norm(a, ctx)
        self.attn = GPT2Attention(a, ctx, layer)
        self.ln_2 = _layer_norm(a, ctx)
        self.mlp = GPT2MLP(a, ctx)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, metadata)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, a: GPT2Args, ctx: ModelContext):
        super().__init__()
        self.wte = VocabParallelEmbedding(a.vocab_size, a.hidden_size, ctx)
        # Position table: small, so every rank keeps all of it.
        self.wpe = nn.Embedding(a.max_position, a.hidden_size, device=ctx.device, dtype=ctx.dtype)
        self.wpe.requires_grad_(False)
        self.h = nn.ModuleList(GPT2Block(a, ctx, i) for i in range(a.num_layers))
        self.ln_f = _layer_norm(a, ctx)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)  # [T, hidden]
        for block, kv_cache in zip(self.h, kv_caches, strict=True):
            x = block(x, kv_cache, metadata)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    """Registry entry for ``GPT2LMHeadModel`` (see :mod:`core.models` for the contract)."""

    def __init__(self, hf_config: Any, ctx: ModelContext):
        super().__init__()
        self.args = GPT2Args.from_hf(hf_config)
        self.transformer = GPT2Model(self.args, ctx)
        a = self.args
        self.lm_head = ParallelLMHead(a.vocab_size, a.hidden_size, ctx, tied=self.transformer.wte)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden_size]."""
        return self.transformer(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32 (all ranks' vocabulary slices)."""
        return self.lm_head(hidden)

    def attention_specs(self) -> list[AttentionSpec]:
        return [block.attn.spec for block in self.transformer.h]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, _hf_to_linear(weights), STACKED_PARAMS, skip=SKIPPED)


# ---- checkpoint names ------------------------------------------------------------------------

STACKED_PARAMS = (
    (".c_attn_q.", ".qkv_proj.", "q"),
    (".c_attn_k.", ".qkv_proj.", "k"),
    (".c_attn_v.", ".qkv_proj.", "v"),
)
# Causal-mask buffers of old checkpoints, and the LM head (always the token embedding).
SKIPPED = (".attn.bias", ".attn.masked_bias", "lm_head.weight")
_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


def _hf_to_linear(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF GPT-2 names/layouts -> ours: add the ``transformer.`` prefix the original
    checkpoints lack, transpose Conv1D weights, split ``c_attn`` into q/k/v parts."""
    for name, tensor in weights:
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name
        if name.endswith(_CONV1D):
            tensor = tensor.t()  # [in, out] -> [out, in]
        if ".c_attn." in name:
            for part, piece in zip("qkv", tensor.chunk(3, dim=0)):
                yield name.replace(".c_attn.", f".c_attn_{part}."), piece
        else:
            yield name, tensor
