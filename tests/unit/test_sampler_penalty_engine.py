"""The engine's outputs with penalties, with the device penalty state on the CPU.

The CPU platform keeps the host-built penalties by default (faster there), so these tests
make the model runner build a ``Sampler(penalty_state=True)``, the sampler a device with
memory of its own gets: the executor's start-up report then tells the scheduler
(``Scheduler.penalty_state``), which sends a sequence's history only on the step it joins
the state and no longer makes the asynchronous loop wait for penalty requests. Checked end
to end: against HF transformers' own ``RepetitionPenaltyLogitsProcessor`` (greedy, fp32:
identical token ids), and against the host-built path in the synchronous loop for
presence/frequency mixes, seeded sampling, under preemption (a KV cache too small for the
batch), n > 1 and aborts, with the asynchronous loop (penalised rows fed the placeholder
token) and the synchronous one.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

import core.model_runner
from core import LLM, SamplingParams
from core.request import PLACEHOLDER_TOKEN
from core.sampler import Sampler
from tests.helpers import tiny_llama_dir
from tests.integration.test_engine_hf import hf_greedy

MAX_NEW = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("pen"), seed=5)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(9)
    return [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in (5, 17, 40, 9, 28, 60)]


def hf_greedy_repetition(path, prompts, penalty: float, max_new: int) -> list[list[int]]:
    """HF's definition: RepetitionPenaltyLogitsProcessor over prompt + generated ids."""
    return hf_greedy(path, prompts, max_new, RepetitionPenaltyLogitsProcessor(penalty))


def _llm(path, loop: bool, state: bool, **kw) -> LLM:
    with pytest.MonkeyPatch.context() as m:
        if state:  # the runner builds the sampler a device with memory of its own gets
            m.setattr(core.model_runner, "Sampler", lambda *a, **k: Sampler(*a, **{**k, "penalty_state": True}))
        llm = LLM(model=str(path), platform="cpu", dtype="float32", block_size=16, async_scheduling=loop, **kw)
    core_ = llm.engine.core
    assert core_.executor.runner.sampler.penalty_state is state  # False: the CPU's default
    assert core_.executor.penalty_state is state and llm.engine.scheduler.penalty_state is state
    return llm


def _watch(llm: LLM) -> Counter:
    """Wrap the executor's launch and execute: count the penalised rows fed a placeholder, the steps
    scheduled while ``needs_sync()`` held, and check that a penalised sampled row carries its
    history exactly when it joins the runner's penalty state (with the state on) or always
    (off)."""
    core_, seen = llm.engine.core, Counter()
    executor = core_.executor
    sampler, launch, execute = executor.runner.sampler, executor.launch, executor.execute

    def check(sched):
        seen["synced"] += core_.scheduler.needs_sync()
        for s in sched.scheduled:
            if not (s.sample and s.params.needs_token_history):
                continue
            seen["placeholders"] += PLACEHOLDER_TOKEN in s.token_ids
            carries = len(s.output_token_ids) == s.output_index and bool(s.prompt_token_ids)
            held = sampler.penalties is not None and sampler.penalties.holds(s.seq_id)
            assert carries == (not held), s.seq_id  # off: nothing is ever held
            if not carries:
                assert s.output_token_ids == () and s.prompt_token_ids == (), s.seq_id
            seen["history"] += carries
            seen["rows"] += 1

    executor.launch = lambda sched: (check(sched), launch(sched))[1]  # the asynchronous loop
    executor.execute = lambda sched: (check(sched), execute(sched))[1]  # the synchronous one
    return seen


def _run(llm: LLM, prompts, sp: SamplingParams) -> list[list[tuple[int, ...]]]:
    outs = llm.generate(prompts, sp, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    return [[tuple(c.token_ids) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("loop", [True, False], ids=["async", "sync"])
def test_repetition_penalty_matches_hf_with_the_device_state(model, prompts, loop):
    want = hf_greedy_repetition(model, prompts, 1.3, MAX_NEW)
    sp = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=MAX_NEW, ignore_eos=True)
    llm = _llm(model, loop, state=True)
    seen = _watch(llm)
    assert _run(llm, prompts, sp) == [[tuple(w)] for w in want]
    # The runner's sampler kept state for the penalised sequences; each sent its history
    # once, and the asynchronous loop overlapped their steps (placeholders, no sync).
    assert llm.engine.core.executor.runner.sampler.penalties is not None
    assert seen["history"] == len(prompts) and seen["synced"] == 0
    assert (seen["placeholders"] > 0) == loop
    # Under preemption (12 usable blocks of 16 tokens for 6 sequences): re-joined
    # sequences rebuild their state from the history and give the same tokens.
    small = _llm(model, loop, state=True, num_blocks_override=13, max_model_len=128)
    seen = _watch(small)
    assert _run(small, prompts, sp) == [[tuple(w)] for w in want]
    assert small.engine.scheduler.stats().num_preemptions > 0
    assert seen["history"] > len(prompts) and seen["synced"] == 0


PARAMS = [
    SamplingParams(temperature=0, presence_penalty=0.8, frequency_penalty=0.6, max_tokens=MAX_NEW,
                   ignore_eos=True),
    SamplingParams(temperature=0, repetition_penalty=0.9, frequency_penalty=-0.4, max_tokens=MAX_NEW,
                   ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),  # no penalty
    SamplingParams(n=2, temperature=0, repetition_penalty=1.5, presence_penalty=0.3,
                   max_tokens=MAX_NEW, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=11, top_k=20, repetition_penalty=1.2, max_tokens=MAX_NEW,
                   ignore_eos=True),
    SamplingParams(temperature=0, frequency_penalty=1.0, max_tokens=MAX_NEW, ignore_eos=True),
]
PENALISED_SEQS = 6  # PARAMS' sequences with a penalty (n=2 counts twice)


@pytest.fixture(scope="module")
def host_sync(model, prompts):
    """PARAMS' outputs on the host-built path in the synchronous loop: the reference."""
    return _run(_llm(model, False, state=False), prompts, PARAMS)


@pytest.mark.parametrize("loop", [True, False], ids=["async", "sync"])
def test_presence_frequency_seeds_and_n_match_the_host_built_path(model, prompts, loop, host_sync):
    want = host_sync
    host = _llm(model, loop, state=False)
    seen = _watch(host)
    assert _run(host, prompts, PARAMS) == want
    # The host path, unchanged: every sampled penalised row carries its history, and the
    # scheduler asks the asynchronous loop to sync while a penalty request is live (no
    # placeholder for them).
    assert seen["history"] == seen["rows"] > PENALISED_SEQS and seen["placeholders"] == 0
    assert seen["synced"] > 0
    for kw in ({}, dict(num_blocks_override=13, max_model_len=128)):
        llm = _llm(model, loop, state=True, **kw)
        seen = _watch(llm)
        assert _run(llm, prompts, PARAMS) == want, kw
        assert seen["synced"] == 0 and (seen["placeholders"] > 0) == loop
        if kw:
            assert llm.engine.scheduler.stats().num_preemptions > 0
            assert seen["history"] > PENALISED_SEQS
        else:
            assert seen["history"] == PENALISED_SEQS
    assert want[3][0] == want[3][1]  # greedy siblings agree
    # The penalties changed the tokens (the test would not notice a path that ignores them).
    plain = [dataclasses.replace(p, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
             for p in PARAMS]
    assert _run(_llm(model, loop, state=True), prompts, plain) != want


@pytest.mark.parametrize("loop", [True, False], ids=["async", "sync"])
def test_aborts_with_the_device_state_keep_the_rest_exact(model, prompts, loop, host_sync):
    # Two requests aborted with a step in flight; a new one then joins (it may take a
    # freed slot, which must be zeroed): every other output equals the host path's.
    llm = _llm(model, loop, state=True, num_blocks_override=13, max_model_len=128)
    seen, eng = _watch(llm), llm.engine
    ids = [eng.add_request(None, p, sp) for p, sp in zip(prompts, PARAMS)]
    got: dict[str, list[tuple[int, ...]]] = {}
    late, step = None, 0
    while eng.has_unfinished_requests():
        if step == 4:
            eng.abort_request(ids[0])
            eng.abort_request(ids[3])
        if step == 6:
            late = eng.add_request(None, prompts[0], PARAMS[0])
        for out in eng.step():
            got[out.request_id] = [tuple(c.token_ids) for c in out.outputs]
        step += 1
        assert step < 500
    for i in (1, 2, 4, 5):
        assert got[ids[i]] == host_sync[i], i
    assert got[late] == host_sync[0]
    for i in (0, 3):  # cut short, never a token the host path would not give
        assert all(g == w[:len(g)] and len(g) < MAX_NEW for g, w in zip(got[ids[i]], host_sync[i]))
    assert seen["synced"] == 0 and (seen["placeholders"] > 0) == loop
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
