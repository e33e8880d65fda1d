"""Gemma 3, text only (``Gemma3ForCausalLM``: Gemma 3 1B and the text tower's layout).

Gemma 2's network (:mod:`core.models.gemma2`) with two changes:

* every query and key head is RMS-normalised over ``head_dim`` (Gemma's ``1 + weight`` norm)
  before the rotary embedding, as in Qwen3;
* local (sliding-window) and global layers use different RoPE settings: transformers 5 keeps
  them as ``rope_parameters[layer_type]``; 4.x configs give ``rope_local_base_freq`` for the
  local layers and ``rope_theta`` + ``rope_scaling`` for the global ones.

``final_logit_softcapping`` is applied when a config sets it. ``attn_logit_softcapping`` is
not: transformers' Gemma 3 attention never passes it on (released configs set it to null),
and HF is the reference here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from core.models import ModelContext
from core.models.gemma2 import Gemma2ForCausalLM, GemmaRMSNorm, gemma_args
from core.models.layers import RotaryEmbedding
from core.models.llama import LlamaArgs, LlamaAttention


class Gemma3Attention(LlamaAttention):
    """Llama's attention with Gemma-style per-head q/k RMSNorm."""

    def __init__(self, a: LlamaArgs, ctx: ModelContext, rotary_emb: RotaryEmbedding, layer: int):
        super().__init__(a, ctx, rotary_emb, layer)
        self.q_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps, ctx)
        self.k_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps, ctx)

    def per_head(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # [T, H, D] / [T, KVH, D], normed per head


def layer_type_rope(c: Any, layer_type: str) -> dict[str, Any]:
    """RoPE settings (rope_type, rope_theta, scaling fields) of one Gemma 3 layer type."""
    params = getattr(c, "rope_parameters", None) or {}
    if isinstance(params.get(layer_type), dict):
        out = dict(params[layer_type])
    elif layer_type == "sliding_attention":  # transformers 4.x layout
        out = {"rope_theta": getattr(c, "rope_local_base_freq", 10000.0)}
    else:
        out = {**(getattr(c, "rope_scaling", None) or {}), "rope_theta": getattr(c, "rope_theta", 1e6)}
    out["rope_type"] = out.get("rope_type", out.get("type", "default"))
    return out


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Registry entry for ``Gemma3ForCausalLM``; names are HF's (Gemma 2's plus
    ``self_attn.q_norm`` / ``k_norm``)."""

    def __init__(self, hf_config: Any, ctx: ModelContext):
        types = hf_config.layer_types
        args = dataclasses.replace(gemma_args(hf_config), attn_soft_cap=None)
        super().__init__(
            hf_config, ctx, Gemma3Attention, lambda i: layer_type_rope(hf_config, types[i]), args
        )
