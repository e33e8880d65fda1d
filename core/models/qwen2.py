"""Qwen2 (and Qwen2.5): the Llama network with biases on the q/k/v projections.

Differences from :mod:`core.models.llama`, all in the config reading: q, k and v always
carry a bias while the output projection and the MLP never do, and layers listed as
``"sliding_attention"`` in ``layer_types`` use the sliding window when the config enables it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from core.models import ModelContext
from core.models.llama import LlamaArgs, LlamaForCausalLM, layer_sliding_windows


def qwen2_args(hf_config: Any) -> LlamaArgs:
    base = LlamaArgs.from_hf(hf_config)
    return dataclasses.replace(
        base,
        qkv_bias=True,
        o_bias=False,
        mlp_bias=False,
        sliding_windows=layer_sliding_windows(hf_config),
    )


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Registry entry for ``Qwen2ForCausalLM``; checkpoint names are Llama's."""

    def __init__(self, hf_config: Any, ctx: ModelContext):
        super().__init__(hf_config, ctx, args=qwen2_args(hf_config))
