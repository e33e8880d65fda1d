"""The Acme platform's own facts: config validation, simulated memory, extension."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from core_acme.platform import (
    FIRMWARE_RESERVED,
    MAX_TOKENS_PER_STEP,
    AcmeDeviceProperties,
    AcmePlatform,
)

from core.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig

MiB = 1 << 20


def config(block_size=32, dtype="float32", batched=2048, chunked=True, weight_format="dense"):
    model = ModelConfig(model="m", tokenizer="m", architecture="LlamaForCausalLM", hf_config=None,
                        dtype=dtype, max_model_len=4096, weight_format=weight_format)
    return EngineConfig(
        model=model,
        cache=CacheConfig(block_size=block_size),
        scheduler=SchedulerConfig(max_num_batched_tokens=batched, max_model_len=4096,
                                  enable_chunked_prefill=chunked),
        parallel=ParallelConfig(),
        platform="acme",
    )


def test_validate_returns_a_new_config_in_eager_mode(emulated):
    original = config()
    before = copy.deepcopy(dataclasses.asdict(original))
    result = AcmePlatform().validate(original)
    assert result is not original and dataclasses.asdict(original) == before
    assert result.enforce_eager is True and original.enforce_eager is False
    assert result.cache == original.cache and result.model == original.model


@pytest.mark.parametrize("block_size", [16, 48, 128])
def test_block_sizes_other_than_32_and_64_are_refused(emulated, block_size):
    with pytest.raises(ValueError) as err:
        AcmePlatform().validate(config(block_size=block_size))
    msg = str(err.value)
    assert f"block size {block_size} is not supported by platform 'acme'" in msg
    assert "32 or 64" in msg and "--block-size 32" in msg


def test_both_supported_block_sizes_pass(emulated):
    for bs in (32, 64):
        assert AcmePlatform().validate(config(block_size=bs)).cache.block_size == bs
    assert AcmePlatform().preferred_block_size() == 32


def test_float16_is_refused_with_the_reason(emulated):
    with pytest.raises(ValueError, match=r"dtype float16 is not supported by platform 'acme' "
                                         r"\(it has no float16 units\); use --dtype with one of "
                                         r"\['float32', 'bfloat16'\]"):
        AcmePlatform().validate(config(dtype="float16"))
    assert AcmePlatform().validate(config(dtype="bfloat16")).model.dtype == "bfloat16"
    assert AcmePlatform().default_dtype(torch.float16) == torch.float32


def test_quantized_weights_are_refused(emulated):
    with pytest.raises(ValueError, match="keeps weights dense; --weight-format 'q4' is not supported"):
        AcmePlatform().validate(config(weight_format="q4"))


def test_step_budget_is_capped_at_the_command_queue(emulated):
    capped = AcmePlatform().validate(config(batched=3 * MAX_TOKENS_PER_STEP))
    assert capped.scheduler.max_num_batched_tokens == MAX_TOKENS_PER_STEP
    kept = AcmePlatform().validate(config(batched=100))
    assert kept.scheduler.max_num_batched_tokens == 100
    with pytest.raises(ValueError, match=rf"runs at most {MAX_TOKENS_PER_STEP} per step; keep "
                                         r"chunked prefill on"):
        AcmePlatform().validate(config(batched=2 * MAX_TOKENS_PER_STEP, chunked=False))


def test_memory_report_is_the_simulated_device(monkeypatch):
    monkeypatch.setenv("ACME_NPU_EMULATE", "1")
    monkeypatch.setenv("ACME_NPU_MEMORY", "3GiB")
    free, total = AcmePlatform().memory_info()
    assert total == 3 << 30 and free == total - FIRMWARE_RESERVED
    monkeypatch.setenv("ACME_NPU_MEMORY", "768MiB")
    assert AcmePlatform().memory_info() == (768 * MiB - FIRMWARE_RESERVED, 768 * MiB)


def test_kv_budget_follows_utilization_of_the_simulated_memory(emulated):
    p = AcmePlatform()  # 512 MiB
    weights = 10 * MiB
    assert p.kv_cache_budget(None, 0.5, weights) == 256 * MiB - FIRMWARE_RESERVED - weights
    assert p.kv_cache_budget(None, 0.05, weights) == 0  # nothing left: core's planner says so
    assert p.kv_cache_budget(8 * MiB, 0.9, weights) == 8 * MiB


def test_kv_budget_larger_than_the_device_is_refused(emulated):
    with pytest.raises(ValueError, match=r"--kv-cache-memory 1073741824 bytes does not fit the Acme "
                                         r"NPU: 469762048 bytes free minus 0 bytes of weights"):
        AcmePlatform().kv_cache_budget(1 << 30, 0.9, 0)


def test_emulated_memory_beyond_host_ram_is_refused(monkeypatch):
    monkeypatch.setenv("ACME_NPU_EMULATE", "1")
    monkeypatch.setenv("ACME_NPU_MEMORY", "64TiB")  # more RAM than any CI host has
    with pytest.raises(ValueError, match=r"KV cache in host RAM, but only .* GiB may be used.*"
                                         r"lower ACME_NPU_MEMORY \(now 64TiB\)"):
        AcmePlatform().kv_cache_budget(None, 0.9, 0)


def test_device_properties_extension(emulated):
    props = AcmePlatform().get_extension("acme.device_properties")
    assert isinstance(props, AcmeDeviceProperties)
    assert props.memory_bytes == 512 * MiB and props.block_sizes == (32, 64)
    assert AcmePlatform().get_extension("something.else") is None


def test_unknown_attention_backend_name_is_refused(emulated):
    from core.attention import AttentionSpec

    spec = AttentionSpec(4, 2, 64, torch.float32, 32)
    assert AcmePlatform().attention_backend_class(spec).name == "acme_paged"
    with pytest.raises(ValueError, match="one attention backend, 'acme_paged'; got --attention-backend 'flash'"):
        AcmePlatform().attention_backend_class(spec, "flash")
