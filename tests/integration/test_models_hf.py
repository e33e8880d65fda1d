"""The architectures added for issue 21 against HF transformers on tiny random checkpoints.

Every case is a seeded random ``transformers`` model saved as safetensors (no download).
Two checks per case:

* logits: tests.helpers.run_schedule (batched prompts of different lengths, a chunked
  prefill beside decodes, decode steps over a shuffled paged cache) vs HF's full-sequence
  forward, every row close (fp32, CPU);
* the engine: greedy tokens identical to HF's (full recompute each step) through batching,
  a token budget that splits prefills over steps, and a KV cache small enough to preempt.
"""

from __future__ import annotations

import pytest
import torch

from core import LLM, SamplingParams
from tests.helpers import TINY_LLAMA, hf_logits, load_tiny, run_ranks, run_schedule, save_tiny_model
from tests.integration.test_engine_hf import assert_all_blocks_free, hf_greedy, random_prompts, run

VOCAB = TINY_LLAMA["vocab_size"]
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

# family -> (transformers config class, model class, tiny config fields)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "mixtral": (
        "MixtralConfig", "MixtralForCausalLM",
        {**TINY_LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
        {**TINY_LLAMA, **MOE, "num_experts": 4, "shared_expert_intermediate_size": 48},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        {**TINY_LLAMA, **MOE, "num_experts": 4, "head_dim": 16, "norm_topk_prob": True},
    ),
    "olmoe": (
        "OlmoeConfig", "OlmoeForCausalLM",
        {**TINY_LLAMA, "intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
         "pad_token_id": 0},
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {**TINY_LLAMA, "pad_token_id": 0}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**TINY_LLAMA, "pad_token_id": 0}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", TINY_LLAMA),
    "gemma2": (
        "Gemma2Config", "Gemma2ForCausalLM",
        {**TINY_LLAMA, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 6,
         "pad_token_id": 0, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0},
    ),
    "gemma3": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        {**TINY_LLAMA, "num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 16,
         "sliding_window": 5, "pad_token_id": 0, "sliding_window_pattern": 2,
         "rope_parameters": {
             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
             "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
         }},
    ),
}

CASES: dict[str, tuple[str, dict]] = {
    "mixtral-top2": ("mixtral", {}),
    "mixtral-top1-tied-window": (
        "mixtral", dict(num_experts_per_tok=1, tie_word_embeddings=True, sliding_window=7)
    ),
    "qwen2_moe-shared": ("qwen2_moe", {}),
    # layer 0 dense (mlp_only_layers), top-1 without renormalising, MHA
    "qwen2_moe-top1-dense-layer": (
        "qwen2_moe", dict(num_experts_per_tok=1, mlp_only_layers=[0], num_key_value_heads=4)
    ),
    "qwen3_moe-top2": ("qwen3_moe", {}),
    "qwen3_moe-unnormed-sparse-step": (
        "qwen3_moe", dict(norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True)
    ),
    "olmoe-top2": ("olmoe", {}),
    "olmoe-clip-top1": ("olmoe", dict(clip_qkv=0.5, num_experts_per_tok=1)),
    "olmo2": ("olmo2", {}),
    "olmo2-mha-tied": ("olmo2", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    # one KV head on two ranks: the full-width k norm must not count the replica twice
    "olmo2-mqa": ("olmo2", dict(num_key_value_heads=1)),
    "phi3": ("phi3", {}),
    # LongRoPE: positions stay below original_max_position_embeddings (short factors), where
    # HF's full-recompute reference and a paged cache agree; partial rotary, window, tied
    "phi3-longrope-partial-window-tied": (
        "phi3",
        dict(
            original_max_position_embeddings=128, max_position_embeddings=512, sliding_window=9,
            tie_word_embeddings=True, num_key_value_heads=1,
            rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.3, 1.9, 2.2], "long_factor": [3.0, 5.0, 7.0, 9.0],
            },
        ),
    ),
    # Qwen2.5's long-context setting: YaRN with its attention factor folded into cos/sin
    "qwen2-yarn": (
        "qwen2",
        dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 32}),
    ),
    # soft caps low enough to bite on these logits; layers alternate window 6 / full
    "gemma2-capped": ("gemma2", {}),
    "gemma2-mqa-uncapped": (
        "gemma2", dict(num_key_value_heads=1, attn_logit_softcapping=None, final_logit_softcapping=None)
    ),
    "gemma3-local-global": ("gemma3", {}),
    # transformers' Gemma 3 applies only the final cap (its attention drops the other)
    "gemma3-capped-mha": (
        "gemma3", dict(num_key_value_heads=4, attn_logit_softcapping=3.0, final_logit_softcapping=8.0)
    ),
}


def tiny_dir(tmp_path, case: str, **extra):
    """The case's checkpoint; ``extra`` fields override its config (e.g. a head size that
    a GPU platform's kernels support)."""
    import transformers

    family, overrides = CASES[case]
    config_cls, model_cls, fields = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**fields, **overrides, **extra})
    path = tmp_path / case
    return save_tiny_model(path, getattr(transformers, model_cls), config, seed=len(case))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    path = tiny_dir(tmp_path, case)
    results = run_schedule(load_tiny(path), vocab=VOCAB, decode_steps=3)
    reference = hf_logits(path, {s: toks for s, (toks, _) in results.items()})
    for s, (toks, ours) in results.items():
        assert ours.shape == (len(toks), VOCAB)
        torch.testing.assert_close(ours, reference[s], rtol=1e-4, atol=1e-4, msg=f"{case}/{s}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_greedy_matches_transformers(tmp_path, case):
    path = tiny_dir(tmp_path, case)
    prompts = random_prompts(6, VOCAB, seed=5, lo=5, hi=50)
    expected = hf_greedy(path, prompts, 16)
    batched = LLM(model=str(path), platform="cpu", dtype="float32", block_size=16)
    assert run(batched, prompts, max_new=16) == expected
    assert_all_blocks_free(batched)
    # 5 usable blocks of 16 tokens and 7 tokens a step: chunked prefills and preemptions
    pressed = LLM(model=str(path), platform="cpu", dtype="float32", block_size=16,
                  num_blocks_override=6, max_model_len=80, max_num_batched_tokens=7)
    assert run(pressed, prompts, max_new=16) == expected
    assert pressed.engine.scheduler.stats().num_preemptions > 0
    assert_all_blocks_free(pressed)


@pytest.mark.parametrize("case", ["qwen2_moe-shared", "olmoe-top2", "olmo2", "olmo2-mqa", "gemma3-local-global", "phi3"])
def test_two_ranks_equal_one_rank(tmp_path, case):
    path = tiny_dir(tmp_path, case)
    single = run_schedule(load_tiny(path), vocab=VOCAB, decode_steps=2)
    for result in run_ranks(
        2, lambda comm: run_schedule(load_tiny(path, comm=comm), vocab=VOCAB, decode_steps=2)
    ):
        for s, (toks, logits) in result.items():
            assert toks == single[s][0]
            torch.testing.assert_close(logits, single[s][1], rtol=1e-5, atol=1e-5)


# ---- sliding windows: KV blocks that slid out of every layer's window are freed ------------------


def _peak_blocks_held(llm: LLM, prompts, max_new: int) -> tuple[int, list[list[int]]]:
    """Run to completion step by step; the most blocks ever held at once, and the outputs."""
    engine, bm = llm.engine, llm.engine.block_manager
    sp = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    ids = [engine.add_request(None, p, sp, final_only=True) for p in prompts]
    peak, done = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = list(out.outputs[0].token_ids)
        peak = max(peak, bm.num_usable_blocks - bm.num_free_blocks)
        bm.check_invariants()
    return peak, [done[i] for i in ids]


def test_window_bounds_kv_blocks_of_sequences_8x_longer(tmp_path):
    from tests.helpers import tiny_model_dir

    window, bs, max_new = 16, 16, 140
    path = tiny_model_dir(tmp_path, "mistral", sliding_window=window, seed=7)
    prompts = random_prompts(3, VOCAB, seed=8, lo=20, hi=36)
    assert all(len(p) + max_new > 8 * window for p in prompts)
    expected = hf_greedy(path, prompts, max_new)
    llm = LLM(model=str(path), platform="cpu", dtype="float32", block_size=bs,
              num_blocks_override=40, max_num_batched_tokens=24, enable_prefix_caching=True)
    assert llm.engine.block_manager.sliding_window == window
    peak, outs = _peak_blocks_held(llm, prompts, max_new)
    assert outs == expected
    # each sequence holds at most window/bs + 1 blocks, plus 2 for a 24-token prefill chunk;
    # without freeing the three would end holding 3 x 11 = 33
    full = sum(-(-(len(p) + max_new) // bs) for p in prompts)
    assert peak <= len(prompts) * (window // bs + 1) + 2 < full
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_window_model_runs_in_a_cache_smaller_than_one_full_sequence(tmp_path, mode):
    """Admission counts the window: 5 usable blocks hold no 512-token sequence (32 blocks)
    but do hold one window of 16 plus a 24-token step (4 blocks); three sequences 8x the
    window then take turns (preempted by recompute or swap) and still equal HF."""
    from tests.helpers import tiny_model_dir

    window, bs, max_new = 16, 16, 140
    path = tiny_model_dir(tmp_path, "mistral", sliding_window=window, seed=7)
    prompts = random_prompts(3, VOCAB, seed=8, lo=20, hi=36)
    expected = hf_greedy(path, prompts, max_new)
    llm = LLM(model=str(path), platform="cpu", dtype="float32", block_size=bs,
              num_blocks_override=6, max_num_batched_tokens=24, enable_prefix_caching=True,
              preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0.0)
    assert llm.engine.kv_plan.blocks_per_max_len_seq == 4
    peak, outs = _peak_blocks_held(llm, prompts, max_new)
    assert outs == expected
    assert peak <= 5 and llm.engine.scheduler.stats().num_preemptions > 0
    assert_all_blocks_free(llm)


def test_mixed_local_and_global_layers_free_nothing(tmp_path):
    path = tiny_dir(tmp_path, "gemma2-capped")
    llm = LLM(model=str(path), platform="cpu", dtype="float32", block_size=16)
    assert llm.engine.block_manager.sliding_window is None  # the global layers need everything
