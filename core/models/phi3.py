"""Phi-3 / Phi-3.5 / Phi-4 (``Phi3ForCausalLM``): the Llama network with fused checkpoints.

Differences from :mod:`core.models.llama`, all in the config and the checkpoint names:

* the checkpoint stores q, k and v as one ``qkv_proj`` matrix and gate and up as one
  ``gate_up_proj`` matrix; they are split here into the parts Llama's layers load (so
  tensor-parallel sharding stays the layers' business);
* ``longrope`` scaling (Phi-3 128k, Phi-3.5, Phi-4-mini) with ``original_max_position_embeddings``
  read from the top level of the config when the RoPE settings lack it
  (see :mod:`core.models.rope` for how it is applied per position);
* ``partial_rotary_factor`` (Phi-4-mini: 0.75) rotates only the leading part of each head;
* ``sliding_window``, when set, applies to every layer (Phi-3-mini 4k).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from core.models import ModelContext
from core.models.layers import load_checkpoint
from core.models.llama import (
    STACKED_PARAMS,
    LlamaArgs,
    LlamaForCausalLM,
    _skipped,
    layer_sliding_windows,
)


def phi3_args(hf_config: Any) -> LlamaArgs:
    base = LlamaArgs.from_hf(hf_config)
    rope = dict(base.rope)
    orig = getattr(hf_config, "original_max_position_embeddings", None)
    if orig is not None:
        rope.setdefault("original_max_position_embeddings", orig)
    return dataclasses.replace(
        base, rope=rope, qkv_bias=False, o_bias=False, mlp_bias=False,
        sliding_windows=layer_sliding_windows(hf_config),
    )


class Phi3ForCausalLM(LlamaForCausalLM):
    """Registry entry for ``Phi3ForCausalLM``."""

    def __init__(self, hf_config: Any, ctx: ModelContext):
        super().__init__(hf_config, ctx, args=phi3_args(hf_config))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, split_fused(weights, self.args), STACKED_PARAMS, skip=_skipped(self.args))


def split_fused(
    weights: Iterable[tuple[str, torch.Tensor]], a: LlamaArgs
) -> Iterator[tuple[str, torch.Tensor]]:
    """Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` tensors as Llama's separate q/k/v and
    gate/up tensors (views along the output rows, no copy)."""
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    for name, tensor in weights:
        if ".qkv_proj." in name:
            if tensor.shape[0] != q + 2 * kv:
                raise ValueError(
                    f"checkpoint {name} has {tensor.shape[0]} rows; num_attention_heads, "
                    f"num_key_value_heads and head_dim in config.json give {q} + 2 x {kv}"
                )
            for part, start, size in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                yield name.replace(".qkv_proj.", f".{part}_proj."), tensor.narrow(0, start, size)
        elif ".gate_up_proj." in name:
            half = tensor.shape[0] // 2
            yield name.replace(".gate_up_proj.", ".gate_proj."), tensor.narrow(0, 0, half)
            yield name.replace(".gate_up_proj.", ".up_proj."), tensor.narrow(0, half, half)
        else:
            yield name, tensor
