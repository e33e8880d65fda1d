"""The fused sampling kernel's source (csrc/sampling/sample_row.cuh), run on the host, against
the torch sampler.

tests/unit/sampler_kernel_host.py compiles the very template the GPU runs, with each block
thread a fiber and every phase between barriers run in a shuffled thread order, so a
divergent barrier or an order-dependent shared-memory access fails here on CPU-only CI.
The kernel draws by the same definitions and from the same uniform numbers as the torch
pipeline, so tokens must be identical (rounding could in principle move a boundary; these
fixed cases have none) and logprobs equal to float32 rounding. Cases cover every path of
the kernel: greedy, plain temperature, min-p, top-k / top-p from shared-memory
candidates, and the exact bisection fallback (nuclei larger than the candidate buffer,
boundaries beyond the histogram, heavy ties), and rows split across several blocks.
"""

from __future__ import annotations

import collections

import pytest
import torch

from core.sampler import Sampler
from core.sampler.kernel import TOP_K, edit_list, pack
from core.sampling_params import SamplingParams
from tests.unit.sampler_kernel_host import HostKernel
from tests.unit.test_sampler import chi_square, row
from tests.unit.test_sampler_exact import EOS, _batch


def _both(logits, rows, seed, threads, order_seed=0, splits=1):
    want = Sampler(frozenset({EOS}), seed=seed)(logits, rows)
    kernel = HostKernel(threads, order_seed, splits)
    got = Sampler(frozenset({EOS}), seed=seed, kernel=kernel)(logits, rows)
    assert kernel.calls == 1
    return want, got


def _assert_same(want, got, what) -> None:
    assert got.token_ids == want.token_ids, what
    torch.testing.assert_close(
        torch.tensor(got.logprobs), torch.tensor(want.logprobs), rtol=1e-5, atol=1e-5, msg=what
    )
    for w, g in zip(want.top_logprobs, got.top_logprobs):
        assert (w is None) == (g is None), what
        if w is not None:
            assert list(w) == list(g), what
            assert [x.rank for x in w.values()] == [x.rank for x in g.values()], what


@pytest.mark.parametrize("threads", [1, 4, 32])
def test_kernel_samples_like_the_torch_pipeline_on_mixed_batches(threads: int) -> None:
    # Temperature, top-k, top-p, min-p, the three penalties, logit bias, min_tokens, seeds,
    # logprobs; vocabularies of 50 to 3000; logits with ties (tests/unit/test_sampler_exact).
    for seed in range(60):
        logits, rows = _batch(seed)
        want, got = _both(logits, rows, seed, threads, order_seed=seed)
        _assert_same(want, got, f"batch seed {seed}")


@pytest.mark.parametrize("threads,splits", [(4, 3), (8, 8), (32, 7)])
def test_split_rows_sample_like_the_torch_pipeline_on_mixed_batches(threads: int, splits: int) -> None:
    # The same batches with several blocks per row: greedy and plain-temperature rows are
    # shared by the blocks (slices of 8 to 3000 tokens, some empty), the others sampled by
    # block 0 alone; the blocks of a row finish in a shuffled order.
    for seed in range(60):
        logits, rows = _batch(seed)
        want, got = _both(logits, rows, seed, threads, order_seed=seed, splits=splits)
        _assert_same(want, got, f"batch seed {seed}, {splits} blocks a row")


@pytest.mark.parametrize("vocab", [1, 5, 13, 64, 1001])
def test_split_rows_with_short_and_empty_slices(vocab: int) -> None:
    """More blocks than the vocabulary has 4-token slices: trailing blocks see nothing."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=1.3),
              SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.9, top_k=3)]
    rows = [row(p, output_index=i) for i, p in enumerate(params)]
    want, got = _both(logits, rows, seed=9, threads=8, order_seed=vocab, splits=8)
    _assert_same(want, got, f"vocab {vocab}")


def _rows(params: SamplingParams, n: int) -> list:
    return [row(params, output_index=i) for i in range(n)]


FALLBACKS = {
    # A nucleus of thousands of tokens: more than the 2048 shared-memory candidates.
    "flat top-p": (lambda g: torch.randn(4, 20000, generator=g) * 0.05,
                   SamplingParams(temperature=1.0, top_p=0.9)),
    "large top-k": (lambda g: torch.randn(4, 20000, generator=g),
                    SamplingParams(temperature=0.8, top_k=3000)),
    "large top-k and top-p": (lambda g: torch.randn(4, 20000, generator=g),
                              SamplingParams(temperature=1.2, top_k=5000, top_p=0.7, min_p=0.001)),
    # One dominant token: the 50th lies beyond the histogram's range.
    "spike top-k": (lambda g: torch.cat([torch.full((4, 1), 1e5), torch.randn(4, 999, generator=g)], 1),
                    SamplingParams(temperature=0.5, top_k=50)),
    # Ties: thousands of equal values in the boundary bin.
    "ties top-k": (lambda g: (torch.randn(4, 12000, generator=g) * 0.3).round(),
                   SamplingParams(temperature=1.0, top_k=2500)),
    "ties top-p": (lambda g: (torch.randn(4, 12000, generator=g) * 0.3).round(),
                   SamplingParams(temperature=0.9, top_p=0.3)),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_kernel_fallback_paths_stay_exact(name: str) -> None:
    make, params = FALLBACKS[name]
    logits = make(torch.Generator().manual_seed(len(name)))
    want, got = _both(logits, _rows(params, logits.shape[0]), seed=5, threads=8)
    _assert_same(want, got, name)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, min_p=0.05),
        SamplingParams(temperature=0.9, top_k=40),
        SamplingParams(temperature=1.1, top_p=0.8),
        SamplingParams(temperature=0.7, top_k=100, top_p=0.9, min_p=0.01, frequency_penalty=0.4),
    ],
    ids=["temperature", "min-p", "top-k", "top-p", "all"],
)
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_tokens_follow_the_distribution(params: SamplingParams, splits: int) -> None:
    # 4000 draws of one fixed row (a few likely tokens and a long tail), each from its own
    # uniform number, against Sampler.distribution: 12 bins (11 likeliest + the rest).
    g = torch.Generator().manual_seed(3)
    base = torch.randn(1, 600, generator=g) * 2.0
    base[0, :10] += torch.linspace(4.0, 1.0, 10)
    n = 4000
    logits = base.expand(n, -1).contiguous()
    rows = [row(params, prompt=(1, 2), output=(0, 3, 0)) for _ in range(n)]
    kernel = HostKernel(4, splits=splits)  # split: plain temperature rows shared, the others block 0 alone
    tokens = Sampler(seed=11, kernel=kernel)(logits, rows).token_ids
    probs = Sampler().distribution(logits[:1], rows[:1])[0]
    order = probs.argsort(descending=True).tolist()
    top = order[:11]
    p = [float(probs[t]) for t in top]
    p.append(max(1.0 - sum(p), 0.0))
    counts = collections.Counter(t if t in top else -1 for t in tokens)
    observed = [counts[t] for t in top] + [counts[-1]]
    assert all(float(probs[t]) > 0 for t in set(tokens)), "drew a filtered-out token"
    nonzero = [(o, q) for o, q in zip(observed, p) if q > 1e-9]
    # <= 11 degrees of freedom: P(chi2 > 60) < 1e-8; the seeds fix the outcome anyway.
    assert chi_square([o for o, _ in nonzero], [q for _, q in nonzero]) < 60


def test_greedy_and_top_k_1_are_the_argmax() -> None:
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(12, 5000, generator=g) * 4
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(6)]
    rows += [row(SamplingParams(temperature=0.8, top_k=1, seed=i)) for i in range(6)]
    for splits in (1, 5):
        out = Sampler(kernel=HostKernel(16, splits=splits))(logits, rows)
        assert out.token_ids == logits.argmax(dim=-1).tolist(), f"{splits} blocks a row"


def test_top_k_at_or_beyond_the_vocabulary_is_off_in_the_packed_row() -> None:
    # top_k >= vocab (even one too large for a float64) means no cut-off: the kernel reads 0.
    rows = [row(SamplingParams(top_k=k)) for k in (-1, 0, 1, 49, 50, 51, 10**6, 10**400)]
    inputs = pack(rows, 50, frozenset(), {i: 0.5 for i in range(len(rows))})
    assert inputs.rowi[:, TOP_K].tolist() == [0, 0, 1, 49, 0, 0, 0, 0]


def test_seeded_rows_do_not_depend_on_the_batch_or_the_thread_order() -> None:
    g = torch.Generator().manual_seed(4)
    vocab = 3000
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=77)
    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=7), SamplingParams(min_p=0.2),
              SamplingParams(repetition_penalty=1.3, logit_bias={3: 5.0})]
    tokens = []
    for step in range(8):
        logits = torch.randn(5, vocab, generator=g) * 2.5
        pos = step % 5
        batch = [row(p, (1, 2), (4, 5)) for p in others]
        batch.insert(pos, row(seeded, (1, 2), (4, 5)))
        alone = Sampler(seed=1, kernel=HostKernel(8, seed=step))(
            logits[pos:pos + 1].clone(), [batch[pos]])
        mixed = Sampler(seed=2, kernel=HostKernel(4, seed=100 + step))(logits, batch)
        assert alone.token_ids[0] == mixed.token_ids[pos]
        tokens.append(alone.token_ids[0])
    assert len(set(tokens)) > 3  # really sampled


def test_edit_list_merges_every_processor_per_token() -> None:
    rows = [
        row(SamplingParams(min_tokens=5, stop_token_ids=[7], logit_bias={7: 1.5, 9: -2.0},
                           repetition_penalty=1.2, frequency_penalty=0.5),
            prompt=(9, 4), output=(4, 4, 8)),
        row(SamplingParams()),
        row(SamplingParams(presence_penalty=0.3), prompt=(1,), output=(6,)),
    ]
    edits, begin, end = edit_list(rows, 10, frozenset({2}))
    assert begin.tolist() == [0, 5, 5] and end.tolist() == [5, 5, 6]
    bias = edits[:, 3].copy().view("float32").tolist()
    # (token, count in the output, flags: 1 masked by min_tokens / 2 repetition history, bias)
    got = [(*e[:3].tolist(), b) for e, b in zip(edits, bias)]
    assert got == [
        (2, 0, 1, 0.0),  # EOS, masked
        (4, 2, 2, 0.0),
        (7, 0, 1, 1.5),  # stop id: masked, and biased
        (8, 1, 2, 0.0),
        (9, 0, 2, -2.0),  # prompt only: repetition, no count
        (6, 1, 0, 0.0),  # row 2: presence only
    ]
