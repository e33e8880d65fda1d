"""The CPU's decode-step strategy: a Llama-shaped model's whole decode forward in one C++ call.

A batch-1 decode step of the embedded SmolLM2-135M makes ~120 Python module calls and ~330
kernel calls; on a 2-core AVX2 machine that host cost (~6 ms a step) was as large as streaming
the weights (docs/benchmarks/cpu.md). :class:`FusedDecode` hands such steps to
``torch.classes.core_cpu.DecodeStack`` (csrc/cpu/decode_stack.cpp), which holds references to
the model's own parameters, packed weights and KV caches and runs the layer loop in C++ through
the same kernels the modules call, in the same order: its hidden states equal the modules'
bit for bit.

It is the CPU platform's :class:`~core.platform.DecodeGraphRunner` (the runner's per-step
strategy; the CPU declares ``Capability.FUSED_DECODE``, not graph capture, so any model still
loads). :func:`fused_decode` builds it only for a model it recognises exactly; for every other
model, and every step :meth:`FusedDecode.can_run` declines, the modules run as before:

* the Llama family's own classes (LlamaModel / LlamaDecoderLayer / LlamaAttention / LlamaMLP /
  RMSNorm / RotaryEmbedding, not subclasses: Qwen3's q/k norms, OLMo-2's post-norms or MoE
  blocks change the layer), one rank;
* float32 with every linear layer on ``quant_linear``'s grouped codes (``--dtype float32
  --weight-format int4/int8``, the AVX2 default for the embedded model), or bfloat16 with
  every one on torch's int4 kernel (``--dtype bfloat16 --weight-format int4``, the native-bf16
  default); the CPU kernels' op table and paged attention backend, KV caches of the model dtype;
* decode-only steps of at most as many sequences as the modules would multiply through the
  codes (``GROUPED_MAX_ROWS``, or the int4 codec's ``max_rows``): larger steps take the dense
  weights in the modules.
"""

from __future__ import annotations

import logging

import torch

from core.attention import AttentionMetadata
from core.models.layers import RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from core.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel
from core.platform import DecodeGraphRunner
from platforms.cpu.attention import CpuPagedAttentionBackend
from platforms.cpu.linear import (
    ACT_INT8,
    GROUPED_MAX_ROWS,
    GroupedQuant,
    PackedInt4,
    QuantizedLinear,
    released_codes,
)
from platforms.cpu.ops import CpuOps

logger = logging.getLogger(__name__)

_NONE = torch.empty(0)
"""Stands for an absent tensor (int8 mins, no bias) in DecodeStack's tensor lists."""
PROFILE_NAME = "core_cpu::decode_stack"
"""The profiler range of a fused step (its kernels run inside, not as separate torch ops)."""
_KERNEL_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding")


class FusedDecode(DecodeGraphRunner):
    """Decode-only steps of a recognised model through one DecodeStack call (see module doc)."""

    def __init__(self, stack, num_layers: int, max_rows: int):
        self._stack = stack
        self.num_layers = num_layers
        self.max_rows = max_rows
        """Most sequences a step may have: where the modules would still take the codes."""

    def can_run(self, metadata: AttentionMetadata) -> bool:
        md = metadata
        return (
            md.num_prefills == 0 and 0 < md.num_decode_tokens <= self.max_rows
            and md.slot_mapping.numel() == md.num_decode_tokens
            and md.block_tables.dtype == torch.int32 and md.seq_lens.dtype == torch.int32
            and md.slot_mapping.dtype == torch.int64
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        md = metadata
        # A named range, so profiles (python -m core.benchmarks.cpu --profile) can attribute it.
        with torch.profiler.record_function(PROFILE_NAME):
            return self._stack.forward(input_ids, positions, md.block_tables, md.seq_lens.contiguous(),
                                       md.slot_mapping)


def fused_decode(kernels, model: torch.nn.Module, kv_caches: list[torch.Tensor]) -> FusedDecode | None:
    """A :class:`FusedDecode` for ``model`` over ``kv_caches``, or None (the reason logged at
    debug level) when the model is not one it reproduces exactly."""
    dtype = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", torch.empty(0)).dtype
    why = _unsupported(model, kv_caches, dtype)
    if why:
        logger.debug("CPU fused decode off for %s: %s", type(model).__name__, why)
        return None
    inner: LlamaModel = model.model
    rotary: RotaryEmbedding = inner.layers[0].self_attn.rotary_emb
    codes = released_codes(inner.embed_tokens.weight)
    table = [inner.embed_tokens.weight] if codes is None else [codes.codes, codes.scales]
    stack = torch.classes.core_cpu.DecodeStack(
        table, inner.norm.weight, inner.norm.eps, rotary.cos_sin_cache,
        rotary.rotary_dim, ACT_INT8,
    )
    for layer, cache in zip(inner.layers, kv_caches, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        spec = attn.spec
        stack.add_layer(
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.input_layernorm.eps,
            _linear(attn.qkv_proj), _linear(attn.o_proj), _linear(mlp.gate_up_proj), _linear(mlp.down_proj),
            cache, spec.num_heads, spec.num_kv_heads, spec.head_size, spec.softmax_scale,
            spec.sliding_window or 0, spec.logits_soft_cap or 0.0,
        )
    logger.info("CPU fused decode: %d layers of %s in one kernel call per step", len(inner.layers),
                type(model).__name__)
    first = inner.layers[0].mlp.down_proj
    max_rows = GROUPED_MAX_ROWS if dtype == torch.float32 else first.linear_method.codec.max_rows
    return FusedDecode(stack, len(inner.layers), max_rows)


def _linear(layer: torch.nn.Module) -> list[torch.Tensor]:
    p = layer.packed_weight
    bias = layer.bias if layer.bias is not None else _NONE
    if isinstance(p, PackedInt4):  # bfloat16 model: torch's int4 kernel (scales_and_zeros is 3-D)
        return [p.weight, p.scales_and_zeros, _NONE, bias]
    return [p.codes, p.scales, p.mins if p.mins is not None else _NONE, bias]


_PACKING = {torch.float32: GroupedQuant, torch.bfloat16: PackedInt4}
"""Model dtype -> the packed weights the stack multiplies by (what QuantizedLinear keeps)."""


def _unsupported(model: torch.nn.Module, kv_caches: list[torch.Tensor], dtype: torch.dtype) -> str:
    """Why the fused step would not equal the modules' forward ('' when it would)."""
    inner = getattr(model, "model", None)
    if type(inner) is not LlamaModel:
        return "not a Llama-family model"
    if dtype not in _PACKING:
        return f"dtype {dtype}"
    if type(inner.embed_tokens) is not VocabParallelEmbedding or inner.embed_tokens.comm.world_size != 1:
        return "embedding split across ranks"
    if type(inner.norm) is not RMSNorm or not _of(dtype, inner.norm.weight, inner.embed_tokens.weight):
        return "final norm or embedding"
    if len(inner.layers) != len(kv_caches) or not inner.layers:
        return f"{len(inner.layers)} layers for {len(kv_caches)} KV caches"
    if len(inner.layers) != getattr(getattr(model, "args", None), "num_layers", -1):
        return "not every layer of the model (a pipeline stage holds a range of them)"
    rotary = inner.layers[0].self_attn.rotary_emb if type(inner.layers[0]) is LlamaDecoderLayer else None
    for i, (layer, cache) in enumerate(zip(inner.layers, kv_caches)):
        why = _layer_unsupported(layer, cache, rotary, dtype)
        if why:
            return f"layer {i}: {why}"
    return ""


def _layer_unsupported(layer, cache: torch.Tensor, rotary, dtype: torch.dtype) -> str:
    if type(layer) is not LlamaDecoderLayer or type(layer.self_attn) is not LlamaAttention:
        return f"{type(layer).__name__} is not the plain Llama decoder layer"
    attn, mlp = layer.self_attn, layer.mlp
    if type(mlp) is not LlamaMLP:
        return f"feed-forward block {type(mlp).__name__}"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(n) is not RMSNorm for n in norms) or norms[0].eps != norms[1].eps or not _of(dtype, *(n.weight for n in norms)):
        return "norms"
    if attn.rotary_emb is not rotary or type(rotary) is not RotaryEmbedding or rotary.rotary_dim % 2:
        return "rotary embedding"
    if not _of(torch.float32, rotary.cos_sin_cache) or rotary.head_size != attn.spec.head_size:
        return "rotary table"
    if any(not _cpu_op(n.ops, name) for n in (*norms, mlp, rotary) for name in _KERNEL_OPS):
        return "an op of the layer is not the CPU kernel (an op override)"
    if type(attn.attn) is not CpuPagedAttentionBackend:
        return f"attention backend {type(attn.attn).__name__}"
    if cache.dtype != dtype or attn.spec.dtype != dtype or cache.dim() != 5 or not cache.is_contiguous():
        return f"KV cache {cache.dtype} {tuple(cache.shape)}"
    for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        why = _linear_unsupported(lin, dtype)
        if why:
            return why
    return ""


def _linear_unsupported(layer, dtype: torch.dtype) -> str:
    if not isinstance(layer.linear_method, QuantizedLinear) or layer.comm.world_size != 1:
        return "a linear layer without quantized weights on one rank"
    if layer.packed_weight is None:
        layer.linear_method.prepare(layer)
    if not isinstance(layer.packed_weight, _PACKING[dtype]):
        return f"a linear layer's packed weight is {type(layer.packed_weight).__name__}"
    if layer.bias is not None and not _of(dtype, layer.bias):
        return f"a linear bias not {dtype}"
    return ""


def _of(dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    return all(t.dtype == dtype and t.is_contiguous() for t in tensors)


def _cpu_op(ops, name: str) -> bool:
    return isinstance(getattr(getattr(ops, name, None), "__self__", None), CpuOps)
