"""The sampler on the GPU: it must not wait for the device before its single read-back, and
it must draw the CPU's tokens from the same logits and seeds. The GPU samplers here stage
host values as the model runner does on CUDA (``Staging(pinned=True)``).

Two paths: the torch pipeline on CUDA tensors (``Sampler(staging=PINNED)``), and the fused
kernel the CUDA platform plugs in (``kernel=CudaSamplingKernel()``, csrc/sampling; what
the model runner uses). The kernel follows the CPU's definitions in float32/float64 with
its own summation order, so its token is the CPU's except where the draw lands within
rounding of a token boundary: :func:`assert_inverse_cdf_tokens` accepts a different token
only when the row's uniform number lies within 1e-5 of that token's CDF interval.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/cuda/test_cuda_sampler.py``
(part of ``tests/envs/cuda.sh``).
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch

from core.sampler import Sampler, Staging
from core.sampling_params import SamplingParams
from tests.unit.test_sampler import chi_square, row

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


# ---- the fused kernel (csrc/sampling) -----------------------------------------------------


def kernel():
    from platforms.cuda.sampling import CudaSamplingKernel

    return CudaSamplingKernel()


def assert_inverse_cdf_tokens(logits, rows, seed, got_tokens, eos=frozenset({2}), calls=0) -> int:
    """Each token is the inverse-CDF token of the CPU's distribution at the row's uniform
    number, within 1e-5 of CDF; returns how many differ from the CPU's own token. ``calls``:
    how many calls on the same rows the GPU sampler made before (its generator advanced)."""
    logits = logits.cpu()
    cpu, draws = Sampler(eos, seed=seed), Sampler(eos, seed=seed)
    random = [i for i, r in enumerate(rows) if not r.params.greedy]
    for _ in range(calls):
        cpu(logits, rows)
        if random:
            draws._uniforms([rows[i] for i in random])
    want = cpu(logits, rows).token_ids
    dist = Sampler(eos).distribution(logits, rows).double()
    u = dict(zip(random, draws._uniforms([rows[i] for i in random]).tolist())) if random else {}
    differ = 0
    for i, (g, w) in enumerate(zip(got_tokens, want)):
        if g == w:
            continue
        differ += 1
        assert i in u, f"greedy row {i}: GPU {g}, CPU {w}"
        cdf = dist[i].cumsum(0)
        lo = float(cdf[g] - dist[i, g])
        assert dist[i, g] > 0, f"row {i}: GPU drew token {g}, which has no weight"
        assert lo - 1e-5 <= u[i] < float(cdf[g]) + 1e-5, (i, g, w, u[i], lo, float(cdf[g]))
    return differ


@pytest.mark.parametrize("name", list(SYNC_FREE))
def test_kernel_does_not_wait_for_the_device(name: str) -> None:
    rows = rows_for(SYNC_FREE[name])
    logits = logits_for(len(rows), seed=len(name)).cuda()
    sampler = Sampler(frozenset({2}), seed=0, staging=PINNED, kernel=kernel())
    sampler.sample_tensors(logits, rows)  # warm-up: JIT build, allocator, pinned pools
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens, logprobs = sampler.sample_tensors(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert assert_inverse_cdf_tokens(logits, rows, 0, tokens.cpu().tolist(), calls=1) == 0
    want_logprobs = torch.log_softmax(logits.cpu(), dim=-1).gather(1, tokens.cpu()[:, None])[:, 0]
    torch.testing.assert_close(logprobs.cpu(), want_logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(SYNC_FREE))
def test_a_kernel_call_reads_back_once(name: str) -> None:
    rows = rows_for(SYNC_FREE[name])
    logits = logits_for(len(rows), seed=1).cuda()
    sampler = Sampler(frozenset({2}), seed=0, staging=PINNED, kernel=kernel())
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


def test_kernel_matches_the_cpu_on_mixed_batches() -> None:
    # tests/unit/test_sampler_exact's 320 random batches: every parameter, ties, vocab 50-3000.
    from tests.unit.test_sampler_exact import EOS, _batch

    differ = total = 0
    for seed in range(320):
        logits, rows = _batch(seed)
        gpu = Sampler(frozenset({EOS}), seed=seed, staging=PINNED, kernel=kernel())
        out = gpu(logits.cuda(), rows)
        raw = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(out.token_ids)[:, None])
        torch.testing.assert_close(torch.tensor(out.logprobs), raw[:, 0], rtol=1e-5, atol=1e-5)
        differ += assert_inverse_cdf_tokens(logits, rows, seed, out.token_ids, frozenset({EOS}))
        total += len(rows)
    assert differ <= total // 1000, f"{differ} of {total} tokens differ (rounding boundaries)"


@pytest.mark.parametrize("shape", ["peaked", "flat"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_p=0.95),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
        SamplingParams(temperature=0.7, min_p=0.05),
        SamplingParams(top_k=50, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3),
    ],
    ids=["greedy", "t1", "topp", "topk-topp", "minp", "penalties"],
)
def test_kernel_at_llama3_vocab_and_batch_256(shape: str, params: SamplingParams) -> None:
    """Batch 256 x vocab 128256 (16-byte loads, 252-token chunks): the benchmark's shapes."""
    from core.benchmarks.sampler import make_logits, make_rows

    logits = make_logits(256, 128256, shape)
    rows = make_rows(256, 128256, lambda i: params)
    out = Sampler(frozenset({0}), seed=9, staging=PINNED, kernel=kernel())(logits.cuda(), rows)
    differ = assert_inverse_cdf_tokens(logits, rows, 9, out.token_ids, frozenset({0}))
    assert differ <= 2, differ
    raw = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(out.token_ids)[:, None])
    torch.testing.assert_close(torch.tensor(out.logprobs), raw[:, 0], rtol=1e-5, atol=1e-4)


def test_kernel_fallback_paths() -> None:
    from tests.unit.test_sampler_kernel import FALLBACKS

    for name, (make, params) in FALLBACKS.items():
        logits = make(torch.Generator().manual_seed(len(name)))
        rows = [row(params, output_index=i) for i in range(logits.shape[0])]
        out = Sampler(seed=5, staging=PINNED, kernel=kernel())(logits.cuda(), rows)
        assert assert_inverse_cdf_tokens(logits, rows, 5, out.token_ids) == 0, name


def test_kernel_frequencies_follow_the_distribution() -> None:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(1, 32000, generator=g) * 2.0
    base[0, :10] += torch.linspace(6.0, 3.0, 10)
    n = 20000
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=20, top_p=0.9)):
        rows = [row(params) for _ in range(n)]
        logits = base.expand(n, -1).contiguous()
        tokens = Sampler(seed=11, staging=PINNED, kernel=kernel())(logits.cuda(), rows).token_ids
        probs = Sampler().distribution(base, rows[:1])[0]
        top = probs.argsort(descending=True)[:11].tolist()
        p = [float(probs[t]) for t in top]
        p.append(max(1.0 - sum(p), 0.0))
        counts = collections.Counter(t if t in top else -1 for t in tokens)
        pairs = [(counts[t], q) for t, q in zip([*top, -1], p) if q > 1e-9]
        assert all(float(probs[t]) > 0 for t in set(tokens))
        # <= 11 degrees of freedom: P(chi2 > 60) < 1e-8; the seed fixes the outcome anyway.
        assert chi_square([c for c, _ in pairs], [q for _, q in pairs]) < 60


def test_kernel_greedy_top_k_1_and_padded_vocab() -> None:
    g = torch.Generator().manual_seed(8)
    padded = torch.randn(64, 128264, generator=g) * 4
    padded[:, 128256:] = 100.0  # padding columns of the LM head: never sampled
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(32)]
    rows += [row(SamplingParams(temperature=0.8, top_k=1, seed=i)) for i in range(32)]
    out = Sampler(staging=PINNED, kernel=kernel())(padded.cuda(), rows, vocab_size=128256)
    assert out.token_ids == padded[:, :128256].argmax(dim=-1).tolist()
    rows = [row(SamplingParams(temperature=1.5, seed=i)) for i in range(64)]
    out = Sampler(staging=PINNED, kernel=kernel())(padded.cuda(), rows, vocab_size=128256)
    assert max(out.token_ids) < 128256


def test_kernel_seeded_rows_do_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(4)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=77)
    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=7), SamplingParams(min_p=0.2),
              SamplingParams(repetition_penalty=1.3, logit_bias={3: 5.0})] * 8
    tokens = []
    for step in range(10):
        logits = torch.randn(33, 128256, generator=g).cuda() * 2.5
        pos = (7 * step) % 33
        batch = [row(p, (1, 2), (4, 5)) for p in others]
        batch.insert(pos, row(seeded, (1, 2), (4, 5)))
        alone = Sampler(seed=1, staging=PINNED, kernel=kernel())(logits[pos:pos + 1].clone(), [batch[pos]])
        mixed = Sampler(seed=2, staging=PINNED, kernel=kernel())(logits, batch)
        assert alone.token_ids[0] == mixed.token_ids[pos]
        tokens.append(alone.token_ids[0])
    assert len(set(tokens)) > 3


@pytest.mark.parametrize("batch", [1, 3, 8, 40])
@pytest.mark.parametrize("shape", ["peaked", "flat"])
def test_small_batches_split_rows_across_blocks(batch: int, shape: str) -> None:
    """Few rows at Llama-3's vocabulary: greedy and plain-temperature rows are split across
    blocks (platforms/cuda/sampling.py splits_for), mixed with top-p and min-p rows that one
    block samples alone. Tokens are the inverse-CDF tokens of the CPU's distribution (within
    1e-5 of CDF), greedy rows exactly the argmax, logprobs torch's; the arrival counts are
    left at zero for the next launch, which reuses them."""
    from core.benchmarks.sampler import make_logits, make_rows
    from platforms.cuda.sampling import splits_for

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert splits_for(batch, 128256, sms) > 1
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7), SamplingParams(temperature=0.9, top_p=0.9),
              SamplingParams(temperature=1.0, min_p=0.05)]  # batch 1: the temperature row
    logits = make_logits(batch, 128256, shape, seed=batch)
    rows = make_rows(batch, 128256, lambda i: params[i % len(params)])
    k = kernel()
    for call in range(3):
        out = Sampler(frozenset({0}), seed=9 + call, staging=PINNED, kernel=k)(logits.cuda(), rows)
        assert assert_inverse_cdf_tokens(logits, rows, 9 + call, out.token_ids, frozenset({0})) <= 1
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        assert [out.token_ids[i] for i in greedy] == logits[greedy].argmax(dim=-1).tolist()
        raw = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(out.token_ids)[:, None])
        torch.testing.assert_close(torch.tensor(out.logprobs), raw[:, 0], rtol=1e-5, atol=1e-4)
        _, arrivals = k._work[torch.cuda.current_device()]
        assert int(arrivals.abs().sum()) == 0


def test_split_launch_refusals_name_the_fix() -> None:
    from platforms.cuda.build import load_ops

    ops = load_ops()
    logits = torch.randn(2, 4096, device="cuda")
    rowf = torch.zeros(2, 8, dtype=torch.float64, device="cuda")
    rowi = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    edits = torch.zeros(0, 4, dtype=torch.int32, device="cuda")
    state = torch.zeros(0, 4, dtype=torch.int32, device="cuda")
    outs = (torch.empty(2, dtype=torch.int64, device="cuda"), torch.empty(2, device="cuda"),
            torch.empty(2, device="cuda"))
    with pytest.raises(RuntimeError, match=r"splits 600 must be in \[1, 512\]"):
        ops.sample_rows(*outs, logits, rowf, rowi, edits, state, 4096, 600)
    with pytest.raises(RuntimeError, match="needs part, a contiguous 8-byte aligned tensor of at least 384 bytes"):
        ops.sample_rows(*outs, logits, rowf, rowi, edits, state, 4096, 4)
    part = torch.empty(48, dtype=torch.float64, device="cuda")
    with pytest.raises(RuntimeError, match="needs arrivals, a contiguous int32 tensor of at least 2 zeros"):
        ops.sample_rows(*outs, logits, rowf, rowi, edits, state, 4096, 4, part, None)
