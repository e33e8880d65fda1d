"""The transformers fallback (core/models/transformers_fallback.py) against HF transformers, on
tiny random checkpoints of architectures core has no model file for.

Each case: logits of a mixed paged schedule (tests.helpers.run_schedule: batched prompts, a
chunked prefill beside decodes) close to HF's full-sequence forward, and the engine's greedy
tokens identical to HF's through batching, a 7-token step budget (chunked prefills) and a
cache small enough to preempt. Then what the fallback refuses, and how it is labelled.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest
import torch

from core import LLM
from core.models import ModelRegistry, model_support_summary
from core.models.transformers_fallback import TransformersForCausalLM
from tests.helpers import (
    cpu_context,
    hf_logits,
    load_tiny,
    model_config_for,
    run_schedule,
    save_tiny_model,
)
from tests.integration.test_engine_hf import assert_all_blocks_free, hf_greedy, random_prompts, run

VOCAB = 512
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=512, initializer_range=0.2,
            bos_token_id=1, eos_token_id=2)

# case -> (transformers config class, model class, config fields beyond BASE)
CASES: dict[str, tuple[str, str, dict]] = {
    # GQA, partial rotary, q/k/v bias
    "stablelm-gqa-partial-rotary": (
        "StableLmConfig", "StableLmForCausalLM",
        dict(num_key_value_heads=2, partial_rotary_factor=0.5, use_qkv_bias=True),
    ),
    # parallel residual, LayerNorm, fused qkv; its checkpoint names the head embed_out
    # (transformers' loader renames it: the fallback goes through that loader)
    "gptneox-parallel-residual": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.5)),
    # the head's logit_scale (applied after the output embedding) and tied embeddings
    "cohere-logit-scale-tied": (
        "CohereConfig", "CohereForCausalLM",
        dict(num_key_value_heads=2, logit_scale=0.5, tie_word_embeddings=True),
    ),
    # a sliding window every layer shares: the block manager frees blocks that slid out
    "starcoder2-window": (
        "Starcoder2Config", "Starcoder2ForCausalLM", dict(num_key_value_heads=2, sliding_window=8),
    ),
}


def fallback_dir(tmp_path, case: str, **extra):
    import transformers

    config_cls, model_cls, fields = CASES[case]
    config = getattr(transformers, config_cls)(**{**BASE, **fields, **extra})
    return save_tiny_model(tmp_path / case, getattr(transformers, model_cls), config, seed=len(case))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    path = fallback_dir(tmp_path, case)
    model = load_tiny(path)
    assert isinstance(model, TransformersForCausalLM)
    results = run_schedule(model, vocab=VOCAB, decode_steps=3)
    reference = hf_logits(path, {s: toks for s, (toks, _) in results.items()})
    for s, (toks, ours) in results.items():
        assert ours.shape == (len(toks), VOCAB)
        torch.testing.assert_close(ours, reference[s], rtol=1e-4, atol=1e-4, msg=f"{case}/{s}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_greedy_matches_transformers(tmp_path, case, caplog):
    path = fallback_dir(tmp_path, case)
    prompts = random_prompts(6, VOCAB, seed=5, lo=5, hi=50)
    expected = hf_greedy(path, prompts, 16)
    with caplog.at_level(logging.WARNING, logger="core.models.transformers_fallback"):
        batched = LLM(model=str(path), platform="cpu", dtype="float32", block_size=16)
    assert any("transformers fallback" in r.message and "slower" in r.message for r in caplog.records)
    assert run(batched, prompts, max_new=16) == expected
    assert_all_blocks_free(batched)
    pressed = LLM(model=str(path), platform="cpu", dtype="float32", block_size=16,
                  num_blocks_override=6, max_model_len=80, max_num_batched_tokens=7)
    assert run(pressed, prompts, max_new=16) == expected
    assert pressed.engine.scheduler.stats().num_preemptions > 0
    assert_all_blocks_free(pressed)


def test_a_shared_window_frees_blocks_through_the_fallback(tmp_path):
    path = fallback_dir(tmp_path, "starcoder2-window")
    llm = LLM(model=str(path), platform="cpu", dtype="float32", block_size=16)
    assert llm.engine.block_manager.sliding_window == 8


# ---- refusals and labels ------------------------------------------------------------------------


class _TwoRanks:
    rank, world_size = 0, 2


@pytest.mark.parametrize("change,message", [
    (dict(comm=_TwoRanks()), "tensor parallelism .*--tensor-parallel-size 1"),
    (dict(graph_capture=True), "graph capture.*--enforce-eager"),
    (dict(weight_format="q4_1"), "weight format 'q4_1'"),
])
def test_what_the_fallback_cannot_do_is_refused(tmp_path, change, message):
    mc = model_config_for(fallback_dir(tmp_path, "stablelm-gqa-partial-rotary"))
    ctx = dataclasses.replace(cpu_context(16), **change)
    with pytest.raises(ValueError, match="StableLmForCausalLM would run through the transformers "
                                         f"fallback, which cannot do {message}"):
        TransformersForCausalLM(mc.hf_config, ctx)


def test_a_model_outside_the_attention_interface_is_refused(tmp_path):
    import transformers

    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)
    path = save_tiny_model(tmp_path / "bloom", transformers.BloomForCausalLM, config)
    with pytest.raises(ValueError, match="BloomForCausalLM made no call through transformers' "
                                         "attention interface"):
        load_tiny(path)


def test_registry_resolves_fallback_and_refuses_unknown_names():
    registry = ModelRegistry()
    assert registry.resolve("StableLmForCausalLM") is TransformersForCausalLM
    assert registry.resolve("LlamaForCausalLM") is not TransformersForCausalLM
    with pytest.raises(ValueError, match="'NoSuchForCausalLM' is not supported: core has no model "
                                         "file for it and transformers has no causal-LM class"):
        registry.resolve("NoSuchForCausalLM")


def test_core_platforms_labels_the_fallback_slower(capsys):
    from core.entrypoints import cli

    assert "transformers fallback (slower" in model_support_summary()
    cli.cmd_platforms(argparse.Namespace(platform=None))
    out = " ".join(capsys.readouterr().out.split())
    assert "any other transformers causal LM runs through the transformers fallback (slower" in out


@pytest.mark.parametrize("call,why", [
    (dict(attention_mask=torch.zeros(1, 1, 3, 3)), "builds its own attention mask"),
    (dict(is_causal=False), "its attention is not causal"),
    (dict(s_aux=torch.zeros(4)), "attention sinks"),
    (dict(value=torch.zeros(1, 2, 3, 8)), "value head size 8 differs from the query/key head size 16"),
])
def test_the_dry_run_refuses_attention_core_cannot_reproduce(call, why):
    from core.models.transformers_fallback import paged_attention

    module = torch.nn.Linear(1, 1)
    module._core_discovery = []
    args = dict(query=torch.zeros(1, 4, 3, 16), key=torch.zeros(1, 2, 3, 16),
                value=torch.zeros(1, 2, 3, 16), attention_mask=None)
    args.update(call)
    with pytest.raises(ValueError, match=f"Linear cannot run on core's paged attention through "
                                         f"the transformers fallback: .*{why}"):
        paged_attention(module, **args)
    assert module._core_discovery == []


def test_prefix_cache_hits_and_n_samples_through_the_fallback(tmp_path):
    """Prompts sharing a 48-token prefix (the later ones hit the prefix cache) and n=2
    greedy samples (forked block tables): every sample equals HF's greedy run."""
    from core import SamplingParams

    path = fallback_dir(tmp_path, "stablelm-gqa-partial-rotary")
    shared = random_prompts(1, VOCAB, seed=11, lo=48, hi=48)[0]
    prompts = [shared + tail for tail in random_prompts(3, VOCAB, seed=12, lo=3, hi=9)]
    expected = hf_greedy(path, prompts, 8)
    llm = LLM(model=str(path), platform="cpu", dtype="float32", block_size=16, enable_prefix_caching=True)
    outs = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert list(outs[0].outputs[0].token_ids) == expected[0]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2)
    outs = llm.generate(prompts[1:], sp, use_tqdm=False)
    for out, want in zip(outs, expected[1:]):
        assert [list(s.token_ids) for s in out.outputs] == [want, want]
    assert llm.engine.block_manager.prefix_cache_hits >= 2 * 48
    assert_all_blocks_free(llm)
