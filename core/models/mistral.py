"""Mistral: the Llama network with an optional sliding attention window.

Everything but the config reading is :mod:`core.models.llama`; when ``sliding_window`` is
set, every layer attends only to the last ``sliding_window`` positions (itself included),
which the attention backend enforces through ``AttentionSpec.sliding_window``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from core.models import ModelContext
from core.models.llama import LlamaArgs, LlamaForCausalLM, layer_sliding_windows


def mistral_args(hf_config: Any) -> LlamaArgs:
    base = LlamaArgs.from_hf(hf_config)
    return dataclasses.replace(base, sliding_windows=layer_sliding_windows(hf_config))


class MistralForCausalLM(LlamaForCausalLM):
    """Registry entry for ``MistralForCausalLM``; checkpoint names are Llama's."""

    def __init__(self, hf_config: Any, ctx: ModelContext):
        super().__init__(hf_config, ctx, args=mistral_args(hf_config))
