"""GGUF weights kept quantized: the embedded SmolLM2-135M (Q4_1 linear layers, a Q8_0
embedding) loaded through the kept-quantized path gives the same logits as core's
dequantizing GGUF loader, bit for bit (the block decoding itself is checked against the
``gguf`` package for Q4_0, Q4_1, Q4_K and Q8_0 in tests/unit/test_quant_formats.py); and the
engine on the CPU platform counts the codes its layers keep as the model's weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core.model_loader import default_model_path, load_model
from core.models import ModelRegistry
from core.quantization.gguf import GgufMethod
from core.quantization.linear import ReferenceQuantizedLinear
from core.quantization.tensors import IntWeight
from tests.helpers import cpu_context, model_config_for, run_schedule


@pytest.fixture(scope="module")
def smollm2():
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_kept_gguf_weights_give_the_dequantized_logits(smollm2):
    config = dataclasses.replace(model_config_for(smollm2), quantization=GgufMethod(None))
    vocab = config.hf_config.vocab_size
    dense = load_model(config, cpu_context(block_size=16), ModelRegistry())
    ctx = dataclasses.replace(cpu_context(block_size=16),
                              linear_method=ReferenceQuantizedLinear(config.quantization, torch.float32))
    kept = load_model(config, ctx, ModelRegistry())
    qkv = kept.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.packed_weight.weight, IntWeight) and qkv.packed_weight.weight.bits == 4
    assert qkv.weight.numel() == 0  # no dense copy kept
    want = run_schedule(dense, vocab, decode_steps=2, lengths=(9, 3, 12))
    got = run_schedule(kept, vocab, decode_steps=2, lengths=(9, 3, 12))
    for seq in want:
        assert torch.equal(got[seq][1], want[seq][1])


def test_the_engine_counts_the_kept_codes_as_weights(smollm2):
    """On the CPU platform the embedded model's Q4_1 linear layers and its Q8_0 embedding
    (tied to the LM head) drop their dense weights for their codes. The engine's weight
    count (parameters and buffers: the start-up log, and the KV budget wherever a platform
    cannot profile a step) must include those codes: at least 4 bits for every weight of the
    decoder layers' projections and 8 for every entry of the embedding table, and not count
    any twice (the LM head shares the embedding's codes): at most 1.3 times that floor, the
    scales and mins of 32-input groups and the norms being the rest (94.1 MiB against 77.6
    measured). (It counted 2.1 MiB for this model before the codes were buffers.)"""
    from core import LLM

    llm = LLM(smollm2, platform="cpu", max_model_len=128, kv_cache_memory="16MiB")
    try:
        report = llm.engine.core.executor.startup_reports[0]
        model = llm.engine.core.executor.runner.model.model
        qkv = model.layers[0].self_attn.qkv_proj
        assert qkv.weight.numel() == 0  # released: the codes are the weight
    finally:
        llm.engine.shutdown()
    c = model_config_for(smollm2).hf_config
    head = c.hidden_size // c.num_attention_heads
    per_layer = c.hidden_size * head * (c.num_attention_heads * 2 + c.num_key_value_heads * 2) \
        + 3 * c.hidden_size * c.intermediate_size
    floor = c.num_hidden_layers * per_layer // 2 + c.vocab_size * c.hidden_size
    assert floor <= report.weights_bytes <= 1.3 * floor, (report.weights_bytes, floor)
