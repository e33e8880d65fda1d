"""The static-shape sampler (core/sampler/static.py) against the subset pipeline.

Both samplers get the same seed and the same fresh random logits; batches mix greedy,
seeded and unseeded temperature, top-k, top-p, min-p, penalties, logit bias and min_tokens
rows. Tokens, logprobs and top logprobs must be identical (not close): the static path
claims the pipeline's arithmetic per row.
"""

from __future__ import annotations

import random

import pytest
import torch

from core.sampler import Sampler
from core.sampler.kernel import pack
from core.sampler.static import MIN_EDITS, StaticShapeSampling, pad_edits
from core.sampling_params import SamplingParams
from tests.unit.test_sampler import EOS, row

KINDS = [
    dict(temperature=0),
    dict(temperature=0, repetition_penalty=1.3, presence_penalty=0.5),
    dict(temperature=0.7, seed=11),
    dict(temperature=1.0),
    dict(temperature=0.9, top_k=5, seed=3),
    dict(temperature=1.2, top_p=0.8),
    dict(temperature=0.8, top_k=40, top_p=0.9, seed=5),
    dict(temperature=1.0, min_p=0.1, seed=7),
    dict(temperature=0.6, top_p=0.95, min_p=0.05),
    dict(temperature=1.1, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3, seed=1),
    dict(temperature=0.9, logit_bias={3: 2.5, 4: -1.0}, top_k=12),
    dict(temperature=1.0, min_tokens=50, seed=9, stop_token_ids=[6]),
    dict(temperature=0, logit_bias={10: 5.0}),
    dict(temperature=1.0, top_p=0.999),
]


def _batch(rng: random.Random, vocab: int, n: int):
    rows = []
    for _ in range(n):
        kind = dict(rng.choice(KINDS), logprobs=rng.choice([None, None, 3]))
        out = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
        rows.append(row(SamplingParams(max_tokens=100, **kind), prompt, out))
    return rows


@pytest.mark.parametrize("vocab", [300, 2500])
@pytest.mark.parametrize("candidates", [None, 0])
def test_static_shapes_match_the_subset_path(vocab, candidates):
    subset = Sampler(frozenset({EOS}), seed=4, top_p_candidates=candidates)
    static = Sampler(frozenset({EOS}), seed=4, top_p_candidates=candidates, kernel=StaticShapeSampling())
    rng, gen = random.Random(vocab), torch.Generator().manual_seed(vocab)
    for step in range(8):
        rows = _batch(rng, vocab, rng.randrange(1, 24))
        if step == 0:
            rows = [row(SamplingParams(temperature=0))] * 3  # nothing processed, all greedy
        logits = torch.randn(len(rows), vocab, generator=gen) * rng.choice([1.0, 4.0])
        want, got = subset(logits.clone(), rows), static(logits.clone(), rows)
        assert got.token_ids == want.token_ids, step
        assert got.logprobs == want.logprobs, step
        assert got.top_logprobs == want.top_logprobs, step


def test_non_finite_rows_take_the_same_fallback():
    vocab = 64
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, 5] = float("inf")
    logits[1] = float("-inf")
    logits[2, 7] = float("nan")
    for kind in (dict(temperature=1.0), dict(temperature=0.5, repetition_penalty=1.2)):
        rows = [row(SamplingParams(**kind), [1, 2], [3]) for _ in range(4)]
        want = Sampler(seed=1)(logits.clone(), rows)
        got = Sampler(seed=1, kernel=StaticShapeSampling())(logits.clone(), rows)
        assert got.token_ids == want.token_ids


def test_edits_are_padded_to_a_power_of_two_with_repeats_of_the_last():
    vocab = 50
    none = pack([row(SamplingParams(temperature=1.0))], vocab, frozenset(), {0: 0.5})
    assert none.edits.shape[0] == 0 and pad_edits(none).edits.shape == (MIN_EDITS, 4)
    assert not pad_edits(none).edits.any()
    rows = [row(SamplingParams(repetition_penalty=1.2), list(range(20)), [21])]
    some = pack(rows, vocab, frozenset(), {0: 0.5})
    padded = pad_edits(some)
    assert some.edits.shape[0] == 21 and padded.edits.shape[0] == 32
    assert torch.equal(padded.edits[21:], some.edits[-1:].expand(11, -1))
    assert torch.equal(padded.rowi, some.rowi)
