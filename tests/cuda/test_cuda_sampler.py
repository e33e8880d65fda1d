"""The sampler on the GPU: it must not wait for the device before its single read-back, and
it must draw the same tokens as on the CPU from the same logits and seeds. The GPU samplers
here stage host values as the model runner does on CUDA (``Staging(pinned=True)``).

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/cuda/test_cuda_sampler.py``
(part of ``tests/envs/cuda.sh``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from core.sampler import Sampler, Staging
from core.sampling_params import SamplingParams
from tests.unit.test_sampler import row

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

VOCAB = 32_000
PINNED = Staging(pinned=True)

# Parameter mixes of every stage but logprobs (whose values are read back on purpose).
SYNC_FREE = {
    "temperature 1": [SamplingParams(temperature=1.0)] * 8,
    "temperature 0.7": [SamplingParams(temperature=0.7)] * 8,
    "top-k and min-p": [SamplingParams(temperature=0.8, top_k=50, min_p=0.05)] * 8,
    "mixed greedy and random": [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=20),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, min_p=0.1),
    ],
    "seeded": [SamplingParams(temperature=1.0, seed=s) for s in range(6)],
    "greedy (the argmax fast path)": [SamplingParams(temperature=0.0)] * 4,
    "top-p": [SamplingParams(temperature=0.9, top_p=0.9)] * 8,
    "top-k, top-p and min-p": [SamplingParams(temperature=1.1, top_k=100, top_p=0.8, min_p=0.02)] * 4,
    "penalties": [
        SamplingParams(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, repetition_penalty=0.9),
        SamplingParams(temperature=0.7, top_p=0.95, frequency_penalty=-0.2),
    ],
    "logit bias and min_tokens": [
        SamplingParams(logit_bias={5: 3.0, 900: -2.0}, min_tokens=8, stop_token_ids=[17]),
        SamplingParams(temperature=0.0, logit_bias={11: 50.0}),
    ],
}


def rows_for(params: list[SamplingParams]) -> list:
    # Three tokens of history each (output_index 3), which the penalties need.
    return [row(p, prompt=(5, 6, 7, 5), output=(8, 9, 8)) for p in params]


def logits_for(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, VOCAB, generator=g) * 3.0


@pytest.mark.parametrize("name", list(SYNC_FREE))
def test_sampling_does_not_wait_for_the_device(name: str) -> None:
    rows = rows_for(SYNC_FREE[name])
    logits = logits_for(len(rows), seed=len(name)).cuda()
    sampler = Sampler(frozenset({2}), seed=0, staging=PINNED)
    sampler.sample_tensors(logits, rows)  # warm-up: allocator and pinned-memory pools
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens, logprobs = sampler.sample_tensors(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # The same draws as the CPU sampler from the same seed (whose first call was the warm-up).
    cpu = Sampler(frozenset({2}), seed=0)
    cpu.sample_tensors(logits.cpu(), rows)
    want_tokens, want_logprobs = cpu.sample_tensors(logits.cpu(), rows)
    assert tokens.cpu().tolist() == want_tokens.tolist()
    torch.testing.assert_close(logprobs.cpu(), want_logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(SYNC_FREE))
def test_a_sampler_call_reads_back_once(name: str) -> None:
    """The whole ``Sampler.__call__`` (tokens and logprobs to Python) synchronises once."""
    rows = rows_for(SYNC_FREE[name])
    logits = logits_for(len(rows), seed=1).cuda()
    sampler = Sampler(frozenset({2}), seed=0, staging=PINNED)
    sampler(logits, rows)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sampler(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=40),
        SamplingParams(temperature=0.9, top_p=0.9),
        SamplingParams(temperature=1.1, top_k=100, top_p=0.8, min_p=0.02),
        SamplingParams(temperature=0.0),
    ],
    ids=["t1", "topk", "topp", "all-filters", "greedy"],
)
def test_gpu_draws_the_cpu_tokens(params: SamplingParams) -> None:
    rows = [row(params, output_index=i) for i in range(64)]
    logits = logits_for(len(rows), seed=7)
    cpu = Sampler(seed=123)(logits, rows)
    gpu = Sampler(seed=123, staging=PINNED)(logits.cuda(), rows)
    assert gpu.token_ids == cpu.token_ids
    torch.testing.assert_close(
        torch.tensor(gpu.logprobs), torch.tensor(cpu.logprobs), rtol=1e-5, atol=1e-5
    )
