"""The sampler package (core/sampler/) against the single-module sampler it replaced.

tests/unit/sampler_reference.py is a verbatim copy of core/sampler.py as it stood before the
split (commit 707ff4c), kept only here. On 320 random mixed batches (temperature, top-k,
top-p, min-p, the three penalties, logit bias, min_tokens, seeds, logprobs; vocabularies
below and above one inverse-CDF chunk; logits with ties) both must give the same tokens,
logprobs and top logprobs bit for bit, and the same sampling distribution; and the
package's no-read-back top-p path (``top_p_candidates=0``, what pinned staging uses) must
give the reference's default result.
"""

from __future__ import annotations

import random

import pytest
import torch

from core.sampler import Sampler
from core.sampling_params import SamplingParams
from tests.unit import sampler_reference
from tests.unit.test_sampler import row

EOS = 2


def _params(rng: random.Random, vocab: int) -> SamplingParams:
    pick = rng.choice
    kw = dict(
        temperature=pick([0.0, 0.0, 0.5, 1.0, 1.0, 1.7]),
        top_k=pick([-1, -1, 1, 5, 40, vocab + 3]),
        top_p=pick([1.0, 1.0, 0.9, 0.5, 0.99, 0.2]),
        min_p=pick([0.0, 0.0, 0.05, 0.3]),
        repetition_penalty=pick([1.0, 1.0, 1.3, 0.8]),
        presence_penalty=pick([0.0, 0.0, 0.5, -0.7]),
        frequency_penalty=pick([0.0, 0.0, 0.4, -0.3]),
        logprobs=pick([None, None, 0, 3]),
        seed=pick([None, None, rng.randrange(1 << 40)]),
        min_tokens=pick([0, 0, 4]),
        stop_token_ids=pick([[], [], [rng.randrange(vocab)]]),
        max_tokens=50,
    )
    if rng.random() < 0.2:
        kw["logit_bias"] = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(rng.randint(1, 4))}
    return SamplingParams(**kw)


def _batch(seed: int):
    rng = random.Random(seed)
    vocab = rng.choice([50, 1000, 3000])
    n = rng.randint(1, 12)
    rows = []
    for _ in range(n):
        out = tuple(rng.randrange(vocab) for _ in range(rng.randint(0, 6)))
        prompt = tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 8)))
        rows.append(row(_params(rng, vocab), prompt=prompt, output=out))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * rng.choice([1.0, 3.0, 8.0])
    if rng.random() < 0.3:
        logits = logits.round()  # many ties
    return logits, rows


@pytest.mark.parametrize("chunk", range(8))
def test_the_package_samples_exactly_like_the_old_module(chunk: int) -> None:
    for seed in range(chunk * 40, (chunk + 1) * 40):
        logits, rows = _batch(seed)
        want = sampler_reference.Sampler(frozenset({EOS}), seed=seed)
        got = Sampler(frozenset({EOS}), seed=seed)
        for _ in range(2):  # a second call: the generators must advance alike
            w, o = want(logits, rows), got(logits, rows)
            assert o.token_ids == w.token_ids, seed
            assert o.logprobs == w.logprobs, seed
            assert o.top_logprobs == w.top_logprobs, seed
        assert torch.equal(got.distribution(logits, rows), want.distribution(logits, rows)), seed


@pytest.mark.parametrize("chunk", range(2))
def test_top_p_without_read_back_gives_the_default_result(chunk: int) -> None:
    for seed in range(1000 + chunk * 40, 1000 + (chunk + 1) * 40):
        logits, rows = _batch(seed)
        want = sampler_reference.Sampler(frozenset({EOS}), seed=seed)
        got = Sampler(frozenset({EOS}), seed=seed, top_p_candidates=0)
        w, o = want(logits, rows), got(logits, rows)
        assert (o.token_ids, o.logprobs) == (w.token_ids, w.logprobs), seed
