"""core/sampler/padding.py: sampled rows padded to a bucket with copies of the last row
(static-shape devices). The real rows' tokens and logprobs must be exactly the unpadded
sampler's, for greedy, seeded random and mixed rows, and the recorded ids must carry one
value per persistent-batch row."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from core.sampler import Sampler, Staging
from core.sampler.padding import pad_sampled_rows
from core.sampling_params import SamplingParams


@dataclass
class Row:
    params: SamplingParams
    request_id: str = "r"
    output_index: int = 3
    prompt_token_ids: list = field(default_factory=lambda: [1, 2, 3])
    output_token_ids: list = field(default_factory=lambda: [4, 5, 6])


ROWS = {
    "greedy": [Row(SamplingParams(temperature=0)) for _ in range(5)],
    "seeded": [Row(SamplingParams(temperature=0.9, top_k=7, seed=s)) for s in range(5)],
    # unseeded: the copies draw after the real rows, so this call's real draws are unchanged
    "unseeded": [Row(SamplingParams(temperature=1.0)) for _ in range(3)],
    "mixed": [Row(SamplingParams(temperature=0)), Row(SamplingParams(temperature=1.1, top_p=0.8, seed=4)),
              Row(SamplingParams(temperature=0.7, min_p=0.05, seed=9, repetition_penalty=1.3)),
              Row(SamplingParams(temperature=0, presence_penalty=0.5))],
}


@pytest.mark.parametrize("kind", sorted(ROWS))
@pytest.mark.parametrize("size", [None, 8, 16])
def test_real_rows_sample_as_without_padding(kind, size):
    rows = ROWS[kind]
    n = len(rows)
    hidden = torch.randn(n, 300, generator=torch.Generator().manual_seed(n))
    want = Sampler(seed=1)(hidden, rows)
    padded = pad_sampled_rows(rows, list(range(n)), [10 + i for i in range(n)], size or n)
    assert len(padded.rows) == len(padded.hidden_rows) == len(padded.batch_rows) == (size or n)
    assert padded.rows[n:] == [rows[-1]] * ((size or n) - n) and padded.hidden_rows[n:] == [n - 1] * ((size or n) - n)
    logits = hidden.index_select(0, torch.tensor(padded.hidden_rows))
    got = Sampler(seed=1)(logits, padded.rows)
    assert got.token_ids[:n] == want.token_ids and got.logprobs[:n] == want.logprobs


def test_recorded_ids_take_the_real_rows_value_for_every_copy():
    rows = ROWS["greedy"][:3]
    padded = pad_sampled_rows(rows, [4, 9, 11], [2, 0, 5], 8)
    ids = torch.arange(100, 108)
    got = padded.recorded(ids, Staging()).tolist()
    assert got == [100, 101, 102] + [102] * 5 and padded.batch_rows == [2, 0, 5] + [5] * 5
    exact = pad_sampled_rows(rows, [4, 9, 11], [2, 0, 5], 3)
    assert not exact.padded and exact.recorded(ids[:3], Staging()) is not None


def test_a_bucket_smaller_than_the_rows_is_refused():
    with pytest.raises(ValueError, match="cannot pad 3 sampled rows to 2"):
        pad_sampled_rows(ROWS["greedy"][:3], [0, 1, 2], [0, 1, 2], 2)
