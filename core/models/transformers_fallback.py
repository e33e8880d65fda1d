"""The transformers fallback: any causal LM transformers implements, with core's paged attention.

An architecture core has no model file for runs as transformers' own modules (embeddings,
norms, MLPs, rotary embedding: exactly HF's code), except that every attention call goes
through transformers' attention interface (``AttentionInterface.register`` and
``attn_implementation``) into this platform's attention backend over core's paged KV cache.
So the scheduler, continuous batching, chunked prefill, prefix caching and preemption all
work, and the outputs are HF's.

What it costs and what it refuses (said at start-up, and in ``core platforms``):

* slower than a native model: no fused kernels (HF's unfused MLPs and norms), no CUDA/HIP
  graphs, transformers' Python overhead per layer;
* one device only: HF's modules are not tensor-parallel, so ``--tensor-parallel-size`` > 1
  is refused; graph capture is refused (run with ``--enforce-eager``): HF's forward is not
  written to be captured;
* dense checkpoints only (no GGUF-quantised weight formats);
* the model must use transformers' attention interface (most current decoder models do;
  those that do not, e.g. ALiBi models with their own attention code, are refused by
  transformers itself, with the error quoted).

The step's batch is one flat "sequence" of all its tokens (``[1, num_tokens]``) with explicit
position ids; transformers builds no mask for an attention function it has no mask function
for, and core's backend applies causality, windows and soft-capping per sequence.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from core.attention import AttentionBackend, AttentionMetadata, AttentionSpec
from core.models import ModelContext

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "core_paged"
"""The name core's attention is registered under in transformers' AttentionInterface."""

SLOWER = (
    "slower than a native model: HF's unfused modules, eager only (no graphs), one device"
)


def transformers_causal_lm(architecture: str) -> bool:
    """Whether transformers has a causal-LM class of this name (the fallback can run it)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return architecture in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


@dataclass
class _Step:
    """What one forward's attention calls read: set by TransformersForCausalLM.forward for
    the duration of the call (transformers does not pass custom arguments to every model's
    attention, so the layers find it through their owner)."""

    kv_caches: list[torch.Tensor]
    metadata: AttentionMetadata
    calls: int = 0


class _PagedLayer:
    """One HF attention module's link to its core backend, attached to the module."""

    def __init__(self, owner: TransformersForCausalLM, index: int, backend: AttentionBackend):
        self.owner = owner
        self.index = index
        self.backend = backend

    def attend(self, query, key, value, scaling, kwargs) -> torch.Tensor:
        """query [1, H, T, D], key/value [1, Hkv, T, D] -> [1, T, H, D] (HF's layout)."""
        step = self.owner._step
        if step is None:
            raise RuntimeError(
                "a core_paged attention layer was called outside TransformersForCausalLM.forward"
            )
        spec = self.backend.spec
        _check_call(spec, query, key, scaling, kwargs, self.index)
        step.calls += 1
        q = query[0].transpose(0, 1)  # [T, H, D]
        k = key[0].transpose(0, 1).contiguous()
        v = value[0].transpose(0, 1).contiguous()
        out = self.backend.forward(q.contiguous(), k, v, step.kv_caches[self.index], step.metadata)
        return out.unsqueeze(0)


def _check_call(spec: AttentionSpec, query, key, scaling, kwargs, index: int) -> None:
    if query.shape[0] != 1 or query.shape[1] != spec.num_heads or key.shape[1] != spec.num_kv_heads:
        raise RuntimeError(
            f"attention layer {index} was called with query {tuple(query.shape)} and key "
            f"{tuple(key.shape)}, but its KV cache was planned for {spec.num_heads} query / "
            f"{spec.num_kv_heads} kv heads of {spec.head_size} at batch 1"
        )
    scale = scaling if scaling is not None else spec.head_size**-0.5
    window = kwargs.get("sliding_window")
    cap = kwargs.get("softcap")
    if (abs(scale - spec.softmax_scale) > 1e-9 * spec.softmax_scale or (window or None) != spec.sliding_window
            or (cap or None) != spec.logits_soft_cap):
        raise RuntimeError(
            f"attention layer {index} changed its scale/window/soft-cap since start-up "
            f"({scale}, {window}, {cap} vs {spec.softmax_scale}, {spec.sliding_window}, "
            f"{spec.logits_soft_cap}); the transformers fallback needs them fixed per layer"
        )


def paged_attention(module: nn.Module, query, key, value, attention_mask, scaling=None,
                    dropout: float = 0.0, **kwargs):
    """The function registered as ``attn_implementation="core_paged"``: HF's call
    ``(module, query, key, value, attention_mask, scaling=, dropout=, **kwargs)`` ->
    ``(output [1, T, H, D], None)``. The mask is ignored: transformers builds none for it."""
    discovery = getattr(module, "_core_discovery", None)
    if discovery is not None:
        return _record(discovery, module, query, key, value, attention_mask, scaling, kwargs)
    layer = getattr(module, "_core_paged", None)
    if layer is None:
        raise RuntimeError(
            f"{type(module).__name__} has no core KV cache: attn_implementation "
            f"{ATTN_IMPLEMENTATION!r} only works inside core's transformers fallback"
        )
    return layer.attend(query, key, value, scaling, kwargs), None


def _record(found: list, module, query, key, value, attention_mask, scaling, kwargs):
    """Start-up dry run: note what this attention call needs (see _discover_attention), and
    refuse what core's causal paged attention cannot reproduce."""
    name = type(module).__name__
    problem = None
    if value.shape[-1] != query.shape[-1]:
        problem = (f"its value head size {value.shape[-1]} differs from the query/key head size "
                   f"{query.shape[-1]} (core's KV cache has one head size)")
    elif attention_mask is not None:
        problem = "it builds its own attention mask (an ALiBi bias, a bidirectional prefix...)"
    elif not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        problem = "its attention is not causal"
    elif kwargs.get("s_aux") is not None:
        problem = "it uses attention sinks (s_aux)"
    if problem is not None:
        raise ValueError(f"{name} cannot run on core's paged attention through the "
                         f"transformers fallback: {problem}")
    found.append((module, dict(
        num_heads=query.shape[1], num_kv_heads=key.shape[1], head_size=query.shape[-1],
        scale=scaling, sliding_window=kwargs.get("sliding_window") or None,
        logits_soft_cap=kwargs.get("softcap") or None,
    )))
    return torch.zeros_like(query).transpose(1, 2), None


class TransformersForCausalLM(nn.Module):
    """The registry's answer for an architecture transformers has and core does not (see
    the module docstring and :mod:`core.models` for the contract)."""

    supports_graph_capture = False

    def __init__(self, hf_config: Any, ctx: ModelContext):
        super().__init__()
        arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
        _refuse_unsupported(arch, ctx)
        logger.warning(
            "model architecture %s has no native implementation in core; it runs through the "
            "transformers fallback (transformers' modules with core's paged attention), %s",
            arch, SLOWER,
        )
        self._device, self._dtype, self._block_size = ctx.device, ctx.dtype, ctx.block_size
        self.hf = _build_hf_model(hf_config, arch, ctx)
        self._step: _Step | None = None
        self._specs = [spec for _, spec in self._discover()]
        self._layers = [
            _PagedLayer(self, i, ctx.make_attention(spec)) for i, spec in enumerate(self._specs)
        ]
        self._attach()
        self._logit_post = _logit_postprocessing(hf_config)

    def _discover(self) -> list[tuple[nn.Module, AttentionSpec]]:
        return [
            (module, AttentionSpec(**args, dtype=self._dtype, block_size=self._block_size))
            for module, args in _discover_attention(self.hf, self._device)
        ]

    def _attach(self) -> None:
        """Point each HF attention module at its layer (a plain attribute, not a submodule:
        the backend is the runner's and holds no parameters)."""
        found = self._discover()
        if [spec for _, spec in found] != self._specs:
            raise RuntimeError("the loaded transformers model's attention layers differ from the built one's")
        for (module, _), layer in zip(found, self._layers, strict=True):
            module._core_paged = layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden_size]."""
        self._step = _Step(kv_caches, metadata)
        try:
            out = self.hf.base_model(
                input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                use_cache=False,
            )
            if self._step.calls != len(self._specs):
                raise RuntimeError(
                    f"the transformers model made {self._step.calls} attention calls through "
                    f"core's paged attention in one forward, expected {len(self._specs)} (one "
                    "per layer); this architecture does not fit the fallback"
                )
        finally:
            self._step = None
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32: HF's output embedding and the config's logit
        scaling / soft-capping, as the model's own forward applies them."""
        logits = self.hf.get_output_embeddings()(hidden).float()
        return self._logit_post(logits)

    def attention_specs(self) -> list[AttentionSpec]:
        return list(self._specs)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hands the checkpoint's tensors to transformers' own loader (``from_pretrained``
        with ``state_dict``: its renamings and conversions of older checkpoint layouts
        apply); a tensor the model needs and the checkpoint lacks is an error, never left at
        its random init."""
        cls, config = type(self.hf), self.hf.config
        del self.hf  # the randomly initialised copy goes before the loaded one arrives
        hf, info = cls.from_pretrained(
            None, config=config, state_dict=dict(weights), dtype=self._dtype,
            attn_implementation=ATTN_IMPLEMENTATION, output_loading_info=True,
        )
        if info["missing_keys"] or info["mismatched_keys"]:
            raise ValueError(
                f"the checkpoint does not fit {cls.__name__}: missing "
                f"{sorted(info['missing_keys'])[:4]}, mismatched {sorted(info['mismatched_keys'])[:4]}"
            )
        if info["unexpected_keys"]:
            logger.warning("transformers fallback: %d checkpoint tensor(s) unused, e.g. %s",
                           len(info["unexpected_keys"]), sorted(info["unexpected_keys"])[:4])
        self.hf = hf.to(self._device).eval()
        self._attach()


def _refuse_unsupported(arch: str, ctx: ModelContext) -> None:
    why = []
    if ctx.comm.world_size > 1:
        why.append(
            f"tensor parallelism (tensor_parallel_size {ctx.comm.world_size}): transformers' "
            "modules are not sharded; run it with --tensor-parallel-size 1"
        )
    if ctx.graph_capture:
        why.append("graph capture: transformers' forward is not capturable; pass --enforce-eager")
    if ctx.weight_format != "dense":
        why.append(f"weight format {ctx.weight_format!r}: only dense checkpoints are supported")
    if why:
        raise ValueError(
            f"model architecture {arch} would run through the transformers fallback, which "
            f"cannot do " + "; ".join(why)
        )


def _build_hf_model(hf_config: Any, arch: str, ctx: ModelContext) -> nn.Module:
    import transformers
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    cls = getattr(transformers, arch, None) if arch != "?" else None
    try:
        with torch.device(ctx.device):
            if cls is not None and hasattr(cls, "_from_config"):
                model = cls._from_config(hf_config, dtype=ctx.dtype, attn_implementation=ATTN_IMPLEMENTATION)
            else:
                model = AutoModelForCausalLM.from_config(
                    hf_config, dtype=ctx.dtype, attn_implementation=ATTN_IMPLEMENTATION
                )
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"model architecture {arch} cannot run through the transformers fallback: "
            f"transformers refused core's paged attention for it ({e})"
        ) from e
    return model.eval()


def _discover_attention(hf: nn.Module, device: torch.device) -> list[tuple[nn.Module, dict]]:
    """Each attention module in call order with its shape, scale, window and soft-cap, from
    one two-token dry run (what a module passes to the attention function is the only
    description every architecture shares)."""
    found: list[tuple[nn.Module, dict]] = []
    modules = list(hf.modules())
    for m in modules:  # paged_attention records instead of attending while this is set
        m._core_discovery = found
    try:
        with torch.no_grad():
            ids = torch.ones(1, 2, dtype=torch.long, device=device)
            hf.base_model(input_ids=ids, position_ids=torch.arange(2, device=device)[None], use_cache=False)
    finally:
        for m in modules:
            del m._core_discovery
    if not found:
        raise ValueError(
            f"{type(hf).__name__} made no call through transformers' attention interface; the "
            "transformers fallback cannot give it core's paged attention"
        )
    return found


def _logit_postprocessing(c: Any):
    """What HF's causal-LM heads apply after the output embedding, by config field."""
    cap = getattr(c, "final_logit_softcapping", None)
    scale = getattr(c, "logit_scale", None)  # Cohere: multiplied
    divide = getattr(c, "logits_scaling", None)  # Granite: divided

    def post(logits: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            logits = logits * scale
        if divide is not None:
            logits = logits / divide
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits

    return post
