"""The engine end to end against HF transformers: greedy token ids must be identical (fp32).

Covers GQA/MHA, tied/untied embeddings, batches of different prompt lengths, a KV cache so
small that requests get preempted, a token budget that splits prefills over several steps,
and n > 1. After every run all KV blocks must be free again. Each runs with asynchronous
scheduling (the default on CPU) and with the synchronous loop.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from core import LLM, SamplingParams
from tests.helpers import HF_ATTENTION

MAX_NEW = 12


@pytest.fixture(params=[True, False], ids=["async", "sync"])
def loop(request) -> bool:
    """async_scheduling for the engine under test."""
    return request.param


def hf_greedy(path, prompts: list[list[int]], max_new: int, processor=None) -> list[list[int]]:
    """Independent reference: full recompute each step, argmax, no KV cache, no EOS stop;
    ``processor`` (an HF LogitsProcessor, e.g. a repetition penalty) edits each step's
    scores over the ids so far first."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=HF_ATTENTION).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = []
            for _ in range(max_new):
                scores = model(ids).logits[:, -1]
                if processor is not None:
                    scores = processor(ids, scores.clone())
                nxt = int(scores[0].argmax())
                gen.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            outs.append(gen)
    return outs


def random_prompts(n: int, vocab: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert not llm.engine.has_unfinished_requests()


def run(llm: LLM, prompts, max_new=MAX_NEW, **params) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, **params)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    return [list(o.outputs[0].token_ids) for o in outs]


CONFIGS = {
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha-tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "mqa-llama3-rope": dict(
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batch_matches_hf(tiny_llama, name, loop):
    path = tiny_llama(seed=1, **CONFIGS[name])
    prompts = random_prompts(6, 512, seed=2)
    llm = LLM(model=str(path), platform="cpu", dtype="float32", block_size=16, async_scheduling=loop)
    assert run(llm, prompts) == hf_greedy(path, prompts, MAX_NEW)
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    from tests.helpers import tiny_llama_dir

    path = tiny_llama_dir(tmp_path_factory.mktemp("m"), seed=3)
    prompts = random_prompts(8, 512, seed=4, lo=5, hi=60)
    return path, prompts, hf_greedy(path, prompts, 20)


def test_preemption_under_a_tiny_kv_cache_keeps_outputs(shared, loop):
    path, prompts, expected = shared
    # 12 usable blocks of 16 tokens: room for ~2-3 of these sequences at once, 8 submitted.
    llm = LLM(model=str(path), platform="cpu", dtype="float32", block_size=16, async_scheduling=loop,
              num_blocks_override=13, max_model_len=128)
    assert run(llm, prompts, max_new=20) == expected
    assert llm.engine.scheduler.stats().num_preemptions > 0
    assert_all_blocks_free(llm)


def test_token_budget_splits_prefill_over_steps(shared, loop):
    path, prompts, expected = shared
    llm = LLM(model=str(path), platform="cpu", dtype="float32", block_size=16, async_scheduling=loop,
              max_num_batched_tokens=7, max_num_seqs=3)
    assert run(llm, prompts, max_new=20) == expected
    assert_all_blocks_free(llm)


def test_swap_preemption_keeps_outputs(shared, loop):
    path, prompts, expected = shared
    llm = LLM(model=str(path), platform="cpu", dtype="float32", block_size=16, async_scheduling=loop,
              num_blocks_override=13, max_model_len=128, preemption_mode="swap", swap_space=0.01)
    assert run(llm, prompts, max_new=20) == expected
    assert llm.engine.scheduler.stats().num_preemptions > 0
    assert_all_blocks_free(llm)


def test_n_greater_than_one_greedy_samples_agree(shared, loop):
    path, prompts, expected = shared
    llm = LLM(model=str(path), platform="cpu", dtype="float32", block_size=16, async_scheduling=loop)
    sp = SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts[:3], sp, use_tqdm=False)
    for o, exp in zip(outs, expected[:3]):
        assert [c.index for c in o.outputs] == [0, 1, 2]
        assert all(list(c.token_ids) == exp for c in o.outputs)
    assert_all_blocks_free(llm)


def test_prompt_too_long_is_refused_with_both_numbers(shared):
    path, _, _ = shared
    llm = LLM(model=str(path), platform="cpu", dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="prompt has 64 tokens but max_model_len is 64"):
        llm.generate([[5] * 64], use_tqdm=False)
    assert_all_blocks_free(llm)


def test_kv_cache_too_small_for_max_model_len_refuses_to_start(shared):
    path, _, _ = shared
    with pytest.raises(ValueError, match=r"max_model_len 512 needs 32 blocks of 16 tokens.*holds 0 blocks.*--kv-cache-memory"):
        LLM(model=str(path), platform="cpu", dtype="float32", block_size=16, kv_cache_memory=4096)
