"""Steps that mix prefills and decodes, replayed piecewise from CUDA graphs
(platforms/cuda/piecewise.py): greedy tokens equal HF transformers and the eager engine in
fp32, and a replayed step's hidden states equal the eager forward's.

Run on the GPU machine:
``PYTHONPATH=. python3 -m pytest -q tests/cuda/test_cuda_mixed_graphs.py``.
"""

from __future__ import annotations

import pytest
import torch

from core import LLM
from core.sampling_params import SamplingParams
from core.scheduler import ScheduledSequence, SchedulerOutput
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
ENGINE = dict(platform="cuda", dtype="float32", block_size=16, kv_cache_memory="64MiB")


def test_mixed_steps_from_graphs_give_the_hf_tokens(tiny_llama):
    path = tiny_llama(seed=11, **SHAPE)
    # A token budget of 40 splits the prompts (3..70 tokens) over steps, so prompt chunks
    # run in the same steps as the decodes of prompts that finished earlier.
    prompts = random_prompts(9, 512, seed=12, lo=3, hi=70)
    want = hf_greedy(path, prompts, 20)
    eager = LLM(model=str(path), enforce_eager=True, max_num_batched_tokens=40, **ENGINE)
    assert run(eager, prompts, max_new=20) == want
    eager.engine.shutdown()
    llm = LLM(model=str(path), max_num_batched_tokens=40, **ENGINE)
    mixed = llm.engine.executor.runner.graphs.mixed
    assert mixed is not None
    assert run(llm, prompts, max_new=20) == want
    assert mixed.disabled is None, mixed.disabled
    assert mixed.captured and mixed.replays > 0, (mixed.captured, mixed.replays)
    # Again with every bucket captured: only replays now, the same tokens.
    replays = mixed.replays
    assert run(llm, prompts, max_new=20) == want
    assert mixed.replays > replays
    assert_all_blocks_free(llm)
    llm.engine.shutdown()


def _mixed_step(prompt_len: int, decodes: int, context: int, vocab: int) -> SchedulerOutput:
    """One prompt chunk over ``context`` cached tokens, then ``decodes`` decode rows."""
    params = SamplingParams(temperature=0.0)
    g = torch.Generator().manual_seed(prompt_len)
    ids = torch.randint(0, vocab, (prompt_len + decodes,), generator=g).tolist()
    per = -(-(context + prompt_len) // 16)
    rows = [ScheduledSequence(
        seq_id=0, request_id="p", token_ids=tuple(ids[:prompt_len]), start_pos=context,
        block_table=tuple(range(1, 1 + per)), sample=True, params=params, output_index=0)]
    for i in range(decodes):
        rows.append(ScheduledSequence(
            seq_id=1 + i, request_id=f"d{i}", token_ids=(ids[prompt_len + i],),
            start_pos=context + 5 * i, block_table=tuple(range(1 + per * (i + 1), 1 + per * (i + 2))),
            sample=True, params=params, output_index=3))
    return SchedulerOutput(tuple(rows), 1, prompt_len + decodes)


@pytest.mark.parametrize("prompt_len,decodes", [(5, 0), (21, 3), (100, 7), (300, 11)])
def test_a_replayed_mixed_step_equals_the_eager_forward(tiny_llama, prompt_len, decodes):
    llm = LLM(model=str(tiny_llama(seed=13, **SHAPE)), max_num_batched_tokens=512, **ENGINE)
    runner = llm.engine.executor.runner
    for cache in runner.kv_caches:
        cache.normal_()  # a cached context of random values, not zeros
    sched = _mixed_step(prompt_len, decodes, context=37, vocab=512)
    with torch.inference_mode():
        ids, pos, md = runner.prepare_inputs(sched)
        assert runner.graphs.can_run(md)
        want = runner.model(ids, pos, runner.kv_caches, md).clone()
        first = runner.graphs.run(ids, pos, md).clone()  # the warm-up, then the capture
        assert runner.graphs.mixed.disabled is None, runner.graphs.mixed.disabled
        assert runner.graphs.mixed.replays == 0
        replayed = runner.graphs.run(ids, pos, md).clone()
        assert runner.graphs.mixed.replays == 1
    torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-5)
    # Padded to the bucket the GEMMs may pick other kernels: fp32 agreement, not bit equality.
    torch.testing.assert_close(replayed, want, rtol=1e-4, atol=1e-4)
    llm.engine.shutdown()
