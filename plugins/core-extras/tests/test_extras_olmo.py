"""OLMo through the plugin equals transformers' own OLMo (fp32 greedy tokens and the
log-probabilities of each chosen token) — on platform cpu, and with cpu_naive attention."""

from __future__ import annotations

import json

import pytest
from extras_testkit import hf_greedy

import core

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. The quick brown fox",
           "ka lo mi ne su"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference(tiny_olmo):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_olmo)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    return prompts, hf_greedy(tiny_olmo, prompts, MAX_TOKENS)


def test_checkpoint_names_the_architecture(tiny_olmo):
    config = json.loads((tiny_olmo / "config.json").read_text())
    assert config["architectures"] == ["OlmoForCausalLM"] and config["clip_qkv"] == 1.5


@pytest.mark.parametrize("backend", [None, "cpu_naive"])
def test_greedy_and_logprobs_equal_transformers(tiny_olmo, reference, backend, no_override):
    prompts, want = reference
    llm = core.LLM(model=str(tiny_olmo), platform="cpu", dtype="float32", max_model_len=128,
                   kv_cache_memory="4MiB", block_size=16, attention_backend=backend)
    assert llm.engine.config.model.architecture == "OlmoForCausalLM"
    params = core.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outputs, want):
        got = out.outputs[0]
        assert list(got.token_ids) == tokens
        ours = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
        assert ours == pytest.approx(logprobs, abs=1e-4)


def test_rope_other_than_default_is_refused(tmp_path):
    from extras_testkit import build_tiny_olmo

    path = build_tiny_olmo(tmp_path / "olmo-linear", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="OLMo with rope_type 'linear' is not supported by core-extras"):
        core.LLM(model=str(path), platform="cpu", max_model_len=64, kv_cache_memory="4MiB")
