"""Asynchronous scheduling on CUDA: with graphs on (decode and piecewise mixed), step N+1
launched before step N's tokens are read back (pinned staging and an event), greedy tokens
equal HF transformers and the synchronous loop in fp32, in steps that mix prompt chunks
with decodes fed by placeholders.

Run on the GPU machine:
``PYTHONPATH=. python3 -m pytest -q tests/cuda/test_cuda_async_scheduling.py``.
"""

from __future__ import annotations

import pytest
import torch

from core import LLM
from core.request import PLACEHOLDER_TOKEN
from core.sampling_params import SamplingParams
from core.step_handle import PendingStep
from tests.integration.test_engine_hf import (
    assert_all_blocks_free,
    hf_greedy,
    random_prompts,
    run,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

# Head size 64: the smallest the CUDA decode kernels take.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2)
ENGINE = dict(platform="cuda", dtype="float32", block_size=16, kv_cache_memory="64MiB",
              max_num_batched_tokens=40)


def _record_launches(llm: LLM) -> list[dict]:
    core, seen = llm.engine.core, []
    launch = core.executor.launch

    def recording(sched):
        handle = launch(sched)
        decodes = sched.scheduled[sched.num_prefills:]
        seen.append({
            "prefills": sched.num_prefills,
            "placeholders": sum(PLACEHOLDER_TOKEN in s.token_ids for s in decodes),
            "pending": isinstance(handle, PendingStep),
        })
        return handle

    core.executor.launch = recording
    return seen


def _staggered(llm: LLM, prompts, max_new: int) -> list[list[int]]:
    """One new request per step while the others decode: every step mixes a prompt (chunk)
    with decodes whose input is the token sampled on the device one step before."""
    eng, sp = llm.engine, SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    queue, ids, done = list(prompts), [], {}
    while queue or eng.has_unfinished_requests():
        if queue:
            ids.append(eng.add_request(None, queue.pop(0), sp, final_only=True))
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return [list(done[i].outputs[0].token_ids) for i in ids]


def test_async_greedy_tokens_equal_hf_with_graphs_and_mixed_steps(tiny_llama):
    path = tiny_llama(seed=13, **SHAPE)
    prompts = random_prompts(10, 512, seed=14, lo=3, hi=70)
    want = hf_greedy(path, prompts, 20)

    sync = LLM(model=str(path), async_scheduling=False, **ENGINE)
    assert run(sync, prompts, max_new=20) == want
    sync.engine.shutdown()

    llm = LLM(model=str(path), async_scheduling=True, **ENGINE)
    core, runner = llm.engine.core, llm.engine.executor.runner
    assert core.async_scheduling and runner.graphs is not None
    assert runner.pin_host and runner._make_event is not None  # pinned read-back + event
    mixed = runner.graphs.mixed
    seen = _record_launches(llm)
    assert _staggered(llm, prompts, 20) == want
    assert run(llm, prompts, max_new=20) == want  # all at once: chunked prefills, then decodes
    assert any(s["prefills"] and s["placeholders"] for s in seen), "no mixed step was pipelined"
    # steps that sample without logprobs return before their ids are read back
    assert sum(s["pending"] for s in seen) >= 20, seen
    if mixed is not None:
        assert mixed.disabled is None, mixed.disabled
        assert mixed.replays > 0
    assert_all_blocks_free(llm)
    llm.engine.shutdown()


def test_async_logprobs_and_seeded_sampling_equal_the_sync_loop(tiny_llama):
    path = tiny_llama(seed=15, **SHAPE)
    prompts = random_prompts(8, 512, seed=16, lo=3, hi=50)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=50 + i, max_tokens=16, ignore_eos=True)
              if i % 2 else SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    runs = {}
    for mode in (False, True):
        llm = LLM(model=str(path), async_scheduling=mode, **ENGINE)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[mode] = [list(o.outputs[0].token_ids) for o in outs]
        assert_all_blocks_free(llm)
        llm.engine.shutdown()
    assert runs[True] == runs[False]
