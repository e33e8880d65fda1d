"""OLMo (v1, HF ``OlmoForCausalLM``), an architecture core does not ship, added by a
plugin through the ``core_model_architectures`` hook.

Read top to bottom: the config values used, attention, MLP, the decoder layer, the model
with its LM head, and the checkpoint-name mapping beside it. What sets OLMo apart from
Llama: its layer norms have no parameters at all, and q/k/v may be clipped to
``[-clip_qkv, clip_qkv]`` before the rotary embedding. Tensor-parallel size 1 only.

The model follows the contract in :mod:`core.models`: built as ``cls(hf_config, ctx)``,
attention through ``ctx.make_attention`` (any platform's backend), kernels through
``ctx.ops`` (so platform and plugin op overrides apply).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from core.attention import AttentionMetadata, AttentionSpec
from core.models import ModelContext

LAYER_NORM_EPS = 1e-5  # fixed in OLMo's (parameter-free) layer norm


@dataclass(frozen=True)
class OlmoArgs:
    """The config values this file reads, with defaults resolved."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rope_theta: float
    clip_qkv: float | None
    bias: bool
    """attention_bias: q/k/v/o projections carry biases."""
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, c: Any) -> OlmoArgs:
        if getattr(c, "hidden_act", "silu") != "silu":
            raise ValueError(f"OLMo with hidden_act {c.hidden_act!r} is not supported (only silu)")
        rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(
                f"OLMo with rope_type {kind!r} is not supported by core-extras (only default rope)"
            )
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=c.hidden_size // c.num_attention_heads,
            max_position=c.max_position_embeddings,
            rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
            clip_qkv=getattr(c, "clip_qkv", None),
            bias=bool(getattr(c, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        )


def _linear(n_in: int, n_out: int, bias: bool, ctx: ModelContext) -> nn.Linear:
    """A Linear with uninitialised storage on the device: load_weights fills every element."""
    layer = nn.Linear(n_in, n_out, bias=bias, device="meta", dtype=ctx.dtype)
    return layer.to_empty(device=ctx.device)


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    """OLMo's layer norm: no weight, no bias, computed in float32."""
    return F.layer_norm(x.float(), (x.shape[-1],), eps=LAYER_NORM_EPS).to(x.dtype)


class OlmoAttention(nn.Module):
    def __init__(self, a: OlmoArgs, ctx: ModelContext):
        super().__init__()
        self.ops, self.a = ctx.ops, a
        self.sizes = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
        self.qkv_proj = _linear(a.hidden_size, sum(self.sizes), a.bias, ctx)  # q, k, v rows
        self.o_proj = _linear(a.num_heads * a.head_dim, a.hidden_size, a.bias, ctx)
        self.spec = AttentionSpec(a.num_heads, a.num_kv_heads, a.head_dim, ctx.dtype, ctx.block_size)
        self.attn = ctx.make_attention(self.spec)

    def forward(self, positions, x, cos_sin, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.a.clip_qkv is not None:
            qkv = qkv.clamp(-self.a.clip_qkv, self.a.clip_qkv)
        q, k, v = qkv.split(self.sizes, dim=-1)
        d = self.a.head_dim
        q = q.reshape(-1, self.a.num_heads, d)  # [T, H, D]
        k = k.reshape(-1, self.a.num_kv_heads, d)  # [T, KVH, D]
        v = v.reshape(-1, self.a.num_kv_heads, d)
        q, k = self.ops.rotary_embedding(positions, q, k, cos_sin, d)
        out = self.attn.forward(q, k, v, kv_cache, metadata)  # [T, H, D]
        return self.o_proj(out.reshape(out.shape[0], -1))


class OlmoMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up are one matmul ([gate; up] rows)."""

    def __init__(self, a: OlmoArgs, ctx: ModelContext):
        super().__init__()
        self.ops = ctx.ops
        self.gate_up_proj = _linear(a.hidden_size, 2 * a.intermediate_size, False, ctx)
        self.down_proj = _linear(a.intermediate_size, a.hidden_size, False, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class OlmoDecoderLayer(nn.Module):
    def __init__(self, a: OlmoArgs, ctx: ModelContext):
        super().__init__()
        self.self_attn = OlmoAttention(a, ctx)
        self.mlp = OlmoMLP(a, ctx)

    def forward(self, positions, x, cos_sin, kv_cache, metadata) -> torch.Tensor:
        x = x + self.self_attn(positions, layer_norm(x), cos_sin, kv_cache, metadata)
        return x + self.mlp(layer_norm(x))


class OlmoModel(nn.Module):
    def __init__(self, a: OlmoArgs, ctx: ModelContext):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, device="meta", dtype=ctx.dtype)
        self.embed_tokens.to_empty(device=ctx.device)
        self.layers = nn.ModuleList(OlmoDecoderLayer(a, ctx) for _ in range(a.num_layers))
        # Neox-style rotary table [max_position, head_dim]: cos half, then sin half.
        inv_freq = 1.0 / a.rope_theta ** (torch.arange(0, a.head_dim, 2).float() / a.head_dim)
        angles = torch.arange(a.max_position, dtype=torch.float32)[:, None] * inv_freq
        table = torch.cat((angles.cos(), angles.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", table.to(ctx.device), persistent=False)

    def forward(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(positions, x, self.cos_sin_cache, kv_cache, metadata)
        return layer_norm(x)


class OlmoForCausalLM(nn.Module):
    """The registry entry for ``OlmoForCausalLM`` (contract: :mod:`core.models`)."""

    def __init__(self, hf_config: Any, ctx: ModelContext):
        super().__init__()
        if ctx.comm.world_size != 1:
            raise ValueError(
                f"OlmoForCausalLM from core-extras runs unsharded; got tensor-parallel size "
                f"{ctx.comm.world_size}, use --tensor-parallel-size 1"
            )
        if ctx.weight_format != "dense":
            raise ValueError(f"OlmoForCausalLM supports dense weights only, not {ctx.weight_format!r}")
        self.args = OlmoArgs.from_hf(hf_config)
        self.model = OlmoModel(self.args, ctx)
        if not self.args.tie_word_embeddings:
            self.lm_head = _linear(self.args.hidden_size, self.args.vocab_size, False, ctx)

    def forward(self, input_ids, positions, kv_caches, metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32."""
        weight = self.model.embed_tokens.weight if self.args.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def attention_specs(self) -> list[AttentionSpec]:
        return [layer.self_attn.spec for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; q/k/v and gate/up land in their fused rows. Every
        parameter element must be written exactly once (storage starts uninitialised)."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {name: 0 for name in params}
        for hf_name, tensor in weights:
            target = checkpoint_target(hf_name, self.args)
            if target is None:
                continue
            name, rows = target
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in OlmoForCausalLM")
            dst = params[name].data if rows is None else params[name].data[rows[0] : rows[1]]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, the model "
                    f"expects {tuple(dst.shape)}; is config.json the checkpoint's own?"
                )
            dst.copy_(tensor)
            filled[name] += dst.numel()
        missing = [n for n, p in params.items() if filled[n] != p.numel()]
        if missing:
            raise ValueError(f"the checkpoint lacks (parts of) {missing[:6]}; it is not a complete OLMo")


# ---- checkpoint names ------------------------------------------------------------------------
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def checkpoint_target(hf_name: str, a: OlmoArgs) -> tuple[str, tuple[int, int] | None] | None:
    """Our parameter and row range for an HF tensor name; None for tensors we skip."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None  # a derived buffer some exports include
    if hf_name == "lm_head.weight" and a.tie_word_embeddings:
        return None  # the embedding serves as the head
    prefix, _, leaf = hf_name.rpartition(".")  # leaf: weight | bias
    owner, _, module = prefix.rpartition(".")
    if module not in _FUSED:
        return hf_name, None
    fused, index = _FUSED[module]
    if fused == "qkv_proj":
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        starts = [0, q, q + kv, q + 2 * kv]
    else:
        starts = [0, a.intermediate_size, 2 * a.intermediate_size]
    return f"{owner}.{fused}.{leaf}", (starts[index], starts[index + 1])
