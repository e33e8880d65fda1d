"""Mistral, Qwen2, Qwen3 and GPT-2 against HF transformers on tiny random checkpoints.

Same schedule as the Llama test (tests.helpers.run_schedule: batched prompts of different
lengths, a chunked prefill beside decodes, then decode steps over a paged cache); every
logits row must match HF's full-sequence forward (fp32, CPU).
"""

from __future__ import annotations

import pytest
import torch

from core.models import ModelRegistry
from tests.helpers import hf_logits, load_tiny, run_ranks, run_schedule, tiny_model_dir

CASES = {
    # sliding window 6 is shorter than every prompt: prefill, chunked prefill and decode
    # all have to drop old positions
    "mistral-window": ("mistral", dict(sliding_window=6)),
    "mistral-full-head-dim": ("mistral", dict(head_dim=32, num_key_value_heads=1)),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    # HF windows layers >= max_window_layers: layer 0 full, layer 1 sliding
    "qwen2-sliding-layer": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    ),
    "qwen3": ("qwen3", {}),
    "qwen3-bias-tied": ("qwen3", dict(attention_bias=True, tie_word_embeddings=True, head_dim=32)),
    "gpt2": ("gpt2", {}),
    "gpt2-layer-scaled-relu": (
        "gpt2",
        dict(scale_attn_by_inverse_layer_idx=True, activation_function="relu", n_inner=96),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    family, overrides = CASES[case]
    path = tiny_model_dir(tmp_path, family, seed=len(case), **overrides)
    results = run_schedule(load_tiny(path), vocab=512, decode_steps=3)
    reference = hf_logits(path, {s: toks for s, (toks, _) in results.items()})
    for s, (toks, ours) in results.items():
        assert ours.shape == (len(toks), 512)
        torch.testing.assert_close(ours, reference[s], rtol=1e-4, atol=1e-4, msg=f"{case}/{s}")


def test_windows_reach_the_attention_specs(tmp_path):
    mistral = load_tiny(tiny_model_dir(tmp_path, "mistral", sliding_window=6))
    assert [s.sliding_window for s in mistral.attention_specs()] == [6, 6]
    qwen = load_tiny(
        tiny_model_dir(
            tmp_path, "qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1
        )
    )
    assert [s.sliding_window for s in qwen.attention_specs()] == [None, 5]
    gpt2 = load_tiny(tiny_model_dir(tmp_path, "gpt2", scale_attn_by_inverse_layer_idx=True))
    assert [s.softmax_scale for s in gpt2.attention_specs()] == pytest.approx([0.25, 0.125])


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gpt2"])
def test_two_ranks_equal_one_rank(tmp_path, family):
    path = tiny_model_dir(tmp_path, family, vocab_size=510)
    single = run_schedule(load_tiny(path), vocab=510, decode_steps=2)
    for result in run_ranks(
        2, lambda comm: run_schedule(load_tiny(path, comm=comm), vocab=510, decode_steps=2)
    ):
        for s, (toks, logits) in result.items():
            assert toks == single[s][0]
            torch.testing.assert_close(logits, single[s][1], rtol=1e-5, atol=1e-5)


def test_registry_lists_every_builtin_architecture():
    names = ModelRegistry().names()
    for arch in (
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "GPT2LMHeadModel",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "OlmoeForCausalLM",
        "Olmo2ForCausalLM",
    ):
        assert arch in names
        assert ModelRegistry().resolve(arch).__name__ == arch
