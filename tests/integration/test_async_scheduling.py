"""Asynchronous scheduling end to end on tiny random models (CPU, fp32): the pipelined loop
(step N+1 scheduled and launched before step N's tokens are read back) gives exactly what
the synchronous loop gives, across batching, chunked prefill, both preemption modes, prefix
caching, n > 1, logprobs, stops, max_tokens=1, seeds and penalties; aborts in flight drop
their tokens and free every block; no token past a stop or max_tokens is ever reported.
(The HF comparisons in test_engine_hf run both loops too.)
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from core import LLM, SamplingParams
from core.request import PLACEHOLDER_TOKEN
from tests.helpers import tiny_llama_dir

BS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tiny_llama_dir(tmp_path_factory.mktemp("async"), seed=31))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(3, 60))] for _ in range(12)]


def _llm(model, async_scheduling: bool, **kw) -> LLM:
    kw.setdefault("max_model_len", 128)
    llm = LLM(model=model, platform="cpu", dtype="float32", block_size=BS,
              async_scheduling=async_scheduling, **kw)
    assert llm.engine.core.async_scheduling is async_scheduling
    return llm


def _all_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert not llm.engine.has_unfinished_requests()


def _tokens(outs) -> list[list[tuple[int, ...]]]:
    return [[tuple(c.token_ids) for c in o.outputs] for o in outs]


def _count_placeholders(llm: LLM) -> dict:
    """Wrap the executor's launch to count decode rows fed by a placeholder."""
    core, seen = llm.engine.core, {"placeholders": 0, "history_rows_with_placeholder": 0}
    launch = core.executor.launch

    def counting(sched):
        for s in sched.scheduled:
            if PLACEHOLDER_TOKEN in s.token_ids:
                seen["placeholders"] += 1
                seen["history_rows_with_placeholder"] += s.params.needs_token_history
            if s.params.needs_token_history:  # the sampler's history must be complete
                assert len(s.output_token_ids) == s.output_index
        return launch(sched)

    core.executor.launch = counting
    return seen


def _with_priorities(llm: LLM, prompts, sp, priorities) -> list[list[tuple[int, ...]]]:
    eng = llm.engine
    ids = [eng.add_request(None, p, sp, priority=pr, final_only=True) for p, pr in zip(prompts, priorities)]
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return _tokens([done[i] for i in ids])


GREEDY_CONFIGS = {
    "batch": {},
    "chunked-prefill": dict(max_num_batched_tokens=7, max_num_seqs=3),
    "no-chunking-small-batch": dict(enable_chunked_prefill=False, max_num_batched_tokens=64, max_num_seqs=4),
    "preempt-recompute": dict(num_blocks_override=13),
    "preempt-swap": dict(num_blocks_override=13, preemption_mode="swap", swap_space=0.01),
    "priority-preempt": dict(num_blocks_override=13, scheduling_policy="priority"),
}


@pytest.mark.parametrize("name", list(GREEDY_CONFIGS))
def test_greedy_tokens_identical_to_the_synchronous_loop(model, prompts, name):
    kw = GREEDY_CONFIGS[name]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    priority = [i % 3 for i in range(len(prompts))] if "priority" in name else None
    runs = {}
    for mode in (False, True):
        llm = _llm(model, mode, **kw)
        seen = _count_placeholders(llm)
        runs[mode] = (_with_priorities(llm, prompts, sp, priority) if priority
                      else _tokens(llm.generate(prompts, sp, use_tqdm=False)))
        assert (seen["placeholders"] > 0) is mode  # the async loop really pipelined
        if "preempt" in name:
            assert llm.engine.scheduler.stats().num_preemptions > 0
        _all_free(llm)
    assert runs[True] == runs[False]
    assert all(len(t) == 20 for o in runs[True] for t in o)


def test_prefix_caching_hits_and_tokens_match(model):
    rng = random.Random(9)
    system = [rng.randrange(3, 512) for _ in range(3 * BS)]
    prompts = [system + [rng.randrange(3, 512) for _ in range(rng.randint(1, 20))] for _ in range(10)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs, hits = {}, {}
    for mode in (False, True):
        llm = _llm(model, mode)
        first = llm.generate(prompts[:1], sp, use_tqdm=False)
        runs[mode] = _tokens(first + llm.generate(prompts[1:], sp, use_tqdm=False))
        hits[mode] = llm.engine.scheduler.stats().prefix_cache_hits
        _all_free(llm)
    assert runs[True] == runs[False]
    assert hits[True] == hits[False] == 9 * 3 * BS


def test_n_greater_than_one_logprobs_and_prompt_logprobs_match(model, prompts):
    sp = [SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2)]
    runs = {}
    for mode in (False, True):
        llm = _llm(model, mode)
        outs = llm.generate(prompts[:6], [sp[i % 2] for i in range(6)], use_tqdm=False)
        runs[mode] = outs
        _all_free(llm)
    assert _tokens(runs[True]) == _tokens(runs[False])
    for a, s in zip(runs[True], runs[False]):
        assert [c.index for c in a.outputs] == [c.index for c in s.outputs]
        for ca, cs in zip(a.outputs, s.outputs):
            assert ca.cumulative_logprob == pytest.approx(cs.cumulative_logprob, abs=1e-4)
            for la, ls in zip(ca.logprobs or [], cs.logprobs or []):
                assert la.keys() == ls.keys()
                assert all(la[k].logprob == pytest.approx(ls[k].logprob, abs=1e-4) for k in la)
        if s.prompt_logprobs is not None:
            assert len(a.prompt_logprobs) == len(s.prompt_logprobs)


def test_stop_tokens_min_tokens_and_max_tokens_1_emit_no_extra_token(model, prompts):
    plain = _llm(model, False)
    free = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    # stop ids that the free-running outputs hit mid-way, so sequences stop early
    stops = tuple({o.outputs[0].token_ids[3] for o in free[:4]})
    params = [SamplingParams(temperature=0, max_tokens=16, stop_token_ids=stops, min_tokens=i % 3)
              if i % 4 else SamplingParams(temperature=0, max_tokens=1) for i in range(len(prompts))]
    runs = {}
    for mode in (False, True):
        llm = _llm(model, mode)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[mode] = [(tuple(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                      for o in outs]
        _all_free(llm)
    assert runs[True] == runs[False]
    stopped = 0
    for (toks, reason, stop_reason), p in zip(runs[True], params):
        assert len(toks) <= p.max_tokens
        if reason == "stop":
            stopped += 1
            assert toks[-1] == stop_reason and not set(toks[p.min_tokens:-1]) & set(stops)
        else:
            assert len(toks) == p.max_tokens
    assert stopped >= 3
    assert sum(len(t) == 1 for t, _, _ in runs[True]) >= 3  # the max_tokens=1 requests


def test_stop_strings_match(model):
    runs = {}
    for mode in (False, True):
        llm = _llm(model, mode)
        base = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
        stop = base.text[len(base.text) // 3: len(base.text) // 3 + 2]
        out = llm.generate(["Hello world"] * 3, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                              stop=[stop]), use_tqdm=False)
        runs[mode] = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in out]
        assert all(r[2] == "stop" and stop not in r[0] for r in runs[mode])
        _all_free(llm)
    assert runs[True] == runs[False]


def test_seeded_sampling_and_penalties_match(model, prompts):
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=100 + i, max_tokens=14, ignore_eos=True)
        if i % 3 else
        SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.4, max_tokens=14, ignore_eos=True)
        for i in range(len(prompts))
    ]
    runs = {}
    for mode in (False, True):
        llm = _llm(model, mode)
        seen = _count_placeholders(llm)
        runs[mode] = _tokens(llm.generate(prompts, params, use_tqdm=False))
        # penalty requests make the loop drain: their rows never carry a placeholder
        assert seen["history_rows_with_placeholder"] == 0
        _all_free(llm)
    assert runs[True] == runs[False]
    # seeded requests alone (no penalty request: the loop pipelines) give the same tokens
    llm = _llm(model, True)
    seen = _count_placeholders(llm)
    seeded = [i for i in range(len(prompts)) if i % 3]
    alone = _tokens(llm.generate([prompts[i] for i in seeded], [params[i] for i in seeded], use_tqdm=False))
    assert seen["placeholders"] > 0
    assert alone == [runs[False][i] for i in seeded]


def _drive(llm: LLM, prompts, sp, abort_at: dict[int, list[int]]):
    """Step the engine by hand, aborting request i at step abort_at[...]; return the tokens
    seen per request (from the outputs of each step) and the ids aborted."""
    eng = llm.engine
    ids = [eng.add_request(None, p, sp) for p in prompts]
    seen: dict[str, list[int]] = defaultdict(list)
    finished: dict[str, str] = {}
    aborted, step = set(), 0
    while eng.has_unfinished_requests():
        for i in abort_at.get(step, []):
            if ids[i] not in finished:
                eng.abort_request(ids[i])
                aborted.add(ids[i])
        for out in eng.step():
            assert out.request_id not in finished, "an output after the final one"
            seen[out.request_id] = list(out.outputs[0].token_ids)
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason
        step += 1
        assert step < 2000
    return ids, seen, finished, aborted


def test_aborts_in_flight_drop_their_tokens_and_the_rest_match(model, prompts):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    abort_at = {3: [0, 5], 6: [2], 10: [7, 8]}
    results = {}
    for mode in (False, True):
        llm = _llm(model, mode)
        results[mode] = _drive(llm, prompts, sp, abort_at)
        _all_free(llm)
    (ids_s, seen_s, fin_s, ab_s), (ids_a, seen_a, fin_a, ab_a) = results[False], results[True]
    assert [r in ab_s for r in ids_s] == [r in ab_a for r in ids_a]  # the same 5 requests
    for rs, ra in zip(ids_s, ids_a):
        assert (fin_s[rs] == "abort") == (rs in ab_s)
        if rs in ab_s:
            assert fin_a[ra] == "abort" and seen_a[ra] == seen_s[rs][: len(seen_a[ra])]
        else:
            assert seen_a[ra] == seen_s[rs] and len(seen_a[ra]) == 24 and fin_a[ra] == "length"


def test_abort_storm_under_async_leaves_every_block_free(model):
    rng = random.Random(13)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 90))] for _ in range(64)]
    llm = _llm(model, True, num_blocks_override=40, max_num_seqs=16)
    abort_at: dict[int, list[int]] = defaultdict(list)
    for i in rng.sample(range(64), 48):
        abort_at[rng.randrange(40)].append(i)
    sp = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)
    ids, seen, finished, aborted = _drive(llm, prompts, sp, abort_at)
    assert set(finished) == set(ids) and len(aborted) > 20
    assert all(finished[r] == "abort" for r in aborted)
    assert all(len(seen[r]) == 30 for r in ids if r not in aborted)
    stats = llm.engine.scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
    _all_free(llm)


def test_async_is_off_with_a_synchronous_executor_and_refused_if_asked_for(model):
    llm = LLM(model=model, platform="cpu", dtype="float32", executor="mp", max_model_len=64)
    try:
        assert llm.engine.core.async_scheduling is False  # the default follows the executor
    finally:
        llm.engine.shutdown()
    with pytest.raises(ValueError, match="'mp' executor .* runs steps synchronously. Drop --async-scheduling"):
        LLM(model=model, platform="cpu", dtype="float32", executor="mp", async_scheduling=True)


def test_switching_the_loop_between_steps_keeps_every_token(model, prompts):
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = _tokens(_llm(model, False).generate(prompts[:4], sp, use_tqdm=False))
    llm = _llm(model, True)
    eng = llm.engine
    ids = [eng.add_request(None, p, sp, final_only=True) for p in prompts[:4]]
    done, step = {}, 0
    while eng.has_unfinished_requests():
        eng.core.async_scheduling = step % 3 != 2  # a sync step now and then, mid-flight
        done.update({o.request_id: o for o in eng.step() if o.finished})
        step += 1
    assert _tokens([done[i] for i in ids]) == want
    _all_free(llm)
