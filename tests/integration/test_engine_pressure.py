"""Engine-level scheduler behaviour on a tiny random model: KV pressure with both
preemption modes, and prefix caching with a shared system prompt (issue 4)."""

from __future__ import annotations

import random

import pytest

from core import LLM, SamplingParams
from tests.helpers import tiny_llama_dir

BS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tiny_llama_dir(tmp_path_factory.mktemp("pressure"), seed=11))


def _llm(model, **kw) -> LLM:
    return LLM(model=model, platform="cpu", dtype="float32", block_size=BS, max_model_len=128, **kw)


def _greedy(llm: LLM, prompts, max_tokens=16) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    return [list(o.outputs[0].token_ids) for o in outs]


def _all_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks


@pytest.fixture(scope="module")
def workload(model):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(4, 60))] for _ in range(64)]
    return prompts, _greedy(_llm(model, async_scheduling=False), prompts)


@pytest.mark.parametrize("loop", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_64_requests_under_kv_pressure_match_unpressured_run(model, workload, mode, loop):
    prompts, expected = workload
    # A sequence here needs at most ceil((60 + 16) / 16) = 5 blocks: 20 usable blocks hold ~4.
    extra = {"swap_space": 0.05} if mode == "swap" else {}
    llm = _llm(model, num_blocks_override=21, preemption_mode=mode, async_scheduling=loop, **extra)
    assert _greedy(llm, prompts) == expected
    stats = llm.engine.scheduler.stats()
    assert stats.num_preemptions > 0
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
    _all_free(llm)


def test_shared_system_prompt_hits_the_prefix_cache_as_computed(model):
    rng = random.Random(9)
    system = [rng.randrange(3, 512) for _ in range(3 * BS)]  # exactly 3 full blocks
    suffixes = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 20))] for _ in range(32)]
    prompts = [system + s for s in suffixes]

    plain = _llm(model, enable_prefix_caching=False)
    expected = _greedy(plain, prompts[:1]) + _greedy(plain, prompts[1:])

    llm = _llm(model)
    got = _greedy(llm, prompts[:1])  # computes the shared blocks once
    got += _greedy(llm, prompts[1:])  # the other 31 find them cached
    assert got == expected
    stats = llm.engine.scheduler.stats()
    # Queries count every prompt token at admission; hits are the 3 shared blocks of each of
    # the 31 later requests (a suffix block is never shared: suffixes differ).
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert stats.prefix_cache_hits == 31 * 3 * BS
    assert stats.num_preemptions == 0
    _all_free(llm)


def test_oversubscribed_cache_is_named_at_start(model, caplog):
    # DEBUG: a one-prompt run with the defaults is "oversubscribed" too (issue 17)
    with caplog.at_level("DEBUG", logger="core.engine_core"):
        _llm(model, num_blocks_override=21, max_num_seqs=64)
    # 128 tokens = 8 blocks per full-length sequence; 20 usable blocks hold 2 of them
    assert "max_num_seqs 64 x max_model_len 128 would need 512 KV blocks; the cache holds 20 (2 sequences" in caplog.text
