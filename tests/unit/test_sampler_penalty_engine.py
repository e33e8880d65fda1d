"""The engine's greedy outputs with penalties, with the device penalty state on the CPU.

The CPU platform keeps the host-built penalties by default (faster there), so these tests
give the model runner a ``Sampler(penalty_state=True)``, the path a device with memory of
its own takes, and check it end to end: against HF transformers' own
``RepetitionPenaltyLogitsProcessor`` (greedy, fp32: identical token ids), and against the
host-built path for presence/frequency mixes, under preemption (a KV cache too small for
the batch), n > 1, and with the asynchronous loop and the synchronous one. (While a
penalty request is live the asynchronous loop still updates before it schedules,
``Scheduler.needs_sync``, so these rows carry no placeholder; a continuing row's lagging
history is covered in test_sampler_penalty_state.py.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, RepetitionPenaltyLogitsProcessor

from core import LLM, SamplingParams
from core.sampler import Sampler
from tests.helpers import tiny_llama_dir

MAX_NEW = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("pen"), seed=5)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(9)
    return [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in (5, 17, 40, 9, 28, 60)]


def hf_greedy_repetition(path, prompts, penalty: float, max_new: int) -> list[list[int]]:
    """HF's definition: full recompute each step, RepetitionPenaltyLogitsProcessor over
    prompt + generated ids, argmax; no EOS stop."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    proc = RepetitionPenaltyLogitsProcessor(penalty)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = []
            for _ in range(max_new):
                scores = proc(ids, model(ids).logits[:, -1].clone())
                nxt = int(scores[0].argmax())
                gen.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            outs.append(gen)
    return outs


def _llm(path, loop: bool, state: bool, **kw) -> LLM:
    llm = LLM(model=str(path), platform="cpu", dtype="float32", block_size=16, async_scheduling=loop, **kw)
    runner = llm.engine.core.executor.runner
    assert not runner.sampler.penalty_state  # the CPU's default: host-built penalties
    if state:
        runner.sampler = Sampler(runner.sampler.eos_token_ids, seed=0, penalty_state=True)
    return llm


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
    assert _run(llm, prompts, sp) == [[tuple(w)] for w in want]
    # The runner's sampler kept state for the penalised sequences, and freed it all.
    assert llm.engine.core.executor.runner.sampler.penalties is not None
    # Under preemption (12 usable blocks of 16 tokens for 6 sequences): re-joined
    # sequences rebuild their state from the history and give the same tokens.
    small = _llm(model, loop, state=True, num_blocks_override=13, max_model_len=128)
    assert _run(small, prompts, sp) == [[tuple(w)] for w in want]
    assert small.engine.scheduler.stats().num_preemptions > 0


@pytest.mark.parametrize("loop", [True, False], ids=["async", "sync"])
def test_presence_frequency_and_n_match_the_host_built_path(model, prompts, loop):
    params = [
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
    want = _run(_llm(model, loop, state=False), prompts, params)
    kw = dict(num_blocks_override=13, max_model_len=128)
    assert _run(_llm(model, loop, state=True), prompts, params) == want
    small = _llm(model, loop, state=True, **kw)
    assert _run(small, prompts, params) == want
    assert small.engine.scheduler.stats().num_preemptions > 0
    assert want[3][0] == want[3][1]  # greedy siblings agree
    # The penalties changed the tokens (the test would not notice a path that ignores them).
    plain = [dataclasses.replace(p, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
             for p in params]
    assert _run(_llm(model, loop, state=True), prompts, plain) != want

