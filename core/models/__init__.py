"""Model registry and the contract a model class follows.

A model class is constructed as ``cls(hf_config, ctx)`` and provides:

* ``forward(input_ids, positions, kv_caches, metadata) -> hidden`` — input_ids/positions
  [num_tokens]; kv_caches one tensor per attention layer (``num_attention_layers``);
  returns [num_tokens, hidden_size];
* ``compute_logits(hidden) -> logits`` — [n, hidden] -> [n, vocab] float32, gathered
  over tensor-parallel ranks;
* ``load_weights(weights)`` — consume ``(checkpoint_name, tensor)`` pairs (HF names),
  sharding on load for tensor parallelism;
* ``attention_specs()`` — one :class:`~core.attention.AttentionSpec` per layer, in order.

Pipeline parallelism (optional; a class that implements it sets
``supports_pipeline_parallel = True``): built with ``ctx.stage`` (a
:class:`~core.executor.pipeline.StageLayers`), the model holds only the layers of
``[stage.start, stage.end)`` (the others are :class:`~core.models.layers.MissingLayer`, so
parameter names keep the checkpoint's layer numbers and their weights are skipped on
load), the embedding only on the first stage, the final norm and LM head only on the
last; ``kv_caches`` and ``attention_specs()`` cover its own layers only. ``forward`` takes
``intermediate`` (None on the first stage: token ids are embedded) and returns the hidden
state on the last stage, else a dict of the tensors named by ``intermediate_spec(T)``, a
list of ``(name, shape, dtype)`` that the next stage receives.

Built-in architectures are listed in ``_BUILTIN``; plugins add more through the
``core_model_architectures`` hook. Any other causal LM that transformers implements resolves
to :class:`~core.models.transformers_fallback.TransformersForCausalLM` (transformers' modules
with core's paged attention: slower, one device, eager; it says so at start-up).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from core.attention import AttentionBackend, AttentionSpec
from core.executor.distributed import Communicator, SingleRank
from core.models.layers import DENSE, LinearMethod
from core.ops import Ops

# HF architecture name -> "module:Class" (imported lazily).
_BUILTIN: dict[str, str] = {
    "LlamaForCausalLM": "core.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "core.models.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "core.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "core.models.qwen3:Qwen3ForCausalLM",
    "GPT2LMHeadModel": "core.models.gpt2:GPT2LMHeadModel",
    "MixtralForCausalLM": "core.models.mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "core.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "core.models.qwen3_moe:Qwen3MoeForCausalLM",
    "OlmoeForCausalLM": "core.models.olmoe:OlmoeForCausalLM",
    "Olmo2ForCausalLM": "core.models.olmo2:Olmo2ForCausalLM",
    "Gemma2ForCausalLM": "core.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "core.models.gemma3:Gemma3ForCausalLM",
    "Phi3ForCausalLM": "core.models.phi3:Phi3ForCausalLM",
}


@dataclass(frozen=True)
class ModelContext:
    """Everything a model needs from the engine besides its HF config."""

    dtype: torch.dtype
    device: torch.device
    block_size: int
    ops: Ops
    make_attention: Callable[[AttentionSpec], AttentionBackend]
    """Builds the platform's attention backend for one layer."""
    comm: Communicator = SingleRank()
    """Tensor-parallel group; SingleRank when TP is 1."""
    weight_format: str = "dense"
    linear_method: LinearMethod = DENSE
    """How linear layers keep and multiply by their weights: the platform's strategy for
    ``weight_format`` (see Platform.linear_method)."""
    graph_capture: bool = False
    """Whether the runner will capture this model's steps in graphs (a model that cannot be
    captured refuses instead of running wrong)."""
    stage: Any = None
    """Pipeline parallelism: the :class:`~core.executor.pipeline.StageLayers` this rank
    holds; None: every layer."""


def builtin_architectures() -> frozenset[str]:
    return frozenset(_BUILTIN)


def model_support_summary() -> str:
    """One line for ``core platforms``: what runs natively and what through the fallback."""
    from core.models.transformers_fallback import SLOWER

    return (
        f"models: {len(_BUILTIN)} architectures native ({', '.join(sorted(_BUILTIN))}); any other "
        f"transformers causal LM runs through the transformers fallback ({SLOWER})"
    )


@dataclass(frozen=True)
class ArchitectureConflict:
    """Stands in for an architecture name provided twice (by two plugins, or by a plugin
    and the built-ins). Only resolving that name fails, with ``reason``: one plugin's
    mistake does not stop engines that load other models."""

    reason: str


class ModelRegistry:
    """Architecture name -> model class: built-ins plus what plugins registered."""

    def __init__(self, extra: dict[str, Any] | None = None):
        self._extra = dict(extra or {})
        for name in set(self._extra) & set(_BUILTIN):
            if not isinstance(self._extra[name], ArchitectureConflict):
                self._extra[name] = ArchitectureConflict(
                    f"a plugin registers model architecture {name!r}, which is built in; a "
                    "plugin may only add new architecture names"
                )

    def names(self) -> list[str]:
        """The architectures that load (a name provided twice does not)."""
        conflicts = {n for n, v in self._extra.items() if isinstance(v, ArchitectureConflict)}
        return sorted({*_BUILTIN, *self._extra} - conflicts)

    def resolve(self, architecture: str) -> Any:
        found = self._extra.get(architecture)
        if isinstance(found, ArchitectureConflict):
            raise ValueError(
                f"{found.reason}. Load only one of them (CORE_PLUGINS=name,... lists the "
                "plugins to load) or rename the plugin's architecture"
            )
        if found is not None:
            return found
        if architecture not in _BUILTIN:
            from core.models.transformers_fallback import (
                TransformersForCausalLM,
                transformers_causal_lm,
            )

            if transformers_causal_lm(architecture):
                return TransformersForCausalLM  # slower, and says so at start-up
            raise ValueError(
                f"model architecture {architecture!r} is not supported: core has no model file "
                f"for it and transformers has no causal-LM class of that name; supported "
                f"natively: {self.names()}. A plugin can add one through the "
                "core_model_architectures hook"
            )
        module, cls = _BUILTIN[architecture].split(":")
        return getattr(importlib.import_module(module), cls)
