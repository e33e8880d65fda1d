"""Sampled rows padded to a bucket, for devices that compile one program per shape.

After a step's forward pass the runner gathers one hidden row per sampled sequence, runs
the LM head and the sampler on them, and keeps the sampled ids on the device for the next
step. On a lazily traced device (XLA) all of that is one program whose shapes follow the
number of sampled rows ``n``, so without padding every new ``n`` compiles it again. The
platform's batch shaper (:meth:`core.batch_shape.BatchShaper.pad_sampled`) names a bucket
``b >= n``; :func:`pad_sampled_rows` fills rows ``n .. b-1`` with copies of the last real
row (its hidden row, its parameters, its persistent-batch row), so:

* every stage of the sampler sees ``b`` rows. Such a platform also samples without row
  subsets (:mod:`core.sampler.static`, its ``sampling_kernel``), so rows that mix sampling
  parameters keep the program's shapes at ``b`` too: one program per bucket (and per
  padded edit count where penalties, bias or min_tokens apply). The subset pipeline that
  other platforms run would size its subsets by the data;
* the copies' results are dropped: token ids and logprobs are read for the first ``n`` rows
  only, and the next step's placeholder tokens are recorded from the real rows alone
  (:meth:`PaddedRows.recorded`, a fixed-size gather, so duplicate writes carry one value).

A copy of a random row draws a uniform of its own, so on a bucketed platform the sampler's
generator advances by ``b`` per step instead of ``n``: unseeded random streams differ from
an unpadded platform's; seeded rows do not (their uniforms come from the seed and the
output index).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from core.sampler.rows import SampleRow, Staging


@dataclass(frozen=True)
class PaddedRows:
    """One step's sampled rows, padded (see the module docstring)."""

    rows: list[SampleRow]
    """The real rows, then copies of the last one: the sampler's rows."""
    hidden_rows: list[int]
    """Hidden-state row of each entry of :attr:`rows`."""
    batch_rows: list[int]
    """Persistent-batch row of each entry of :attr:`rows`."""
    real: int
    """How many of :attr:`rows` are real (the first ones)."""

    @property
    def padded(self) -> bool:
        return len(self.rows) > self.real

    def recorded(self, token_ids: torch.Tensor, stage: Staging) -> torch.Tensor:
        """``token_ids`` [len(rows)] with each copy's entry replaced by its real row's, so
        that recording them at :attr:`batch_rows` writes one value per persistent row."""
        if not self.padded:
            return token_ids
        src = list(range(self.real)) + [self.real - 1] * (len(self.rows) - self.real)
        return token_ids.index_select(0, stage(src, torch.int64, token_ids.device))


def pad_sampled_rows(
    rows: Sequence[SampleRow], hidden_rows: Sequence[int], batch_rows: Sequence[int], size: int
) -> PaddedRows:
    """``rows`` (at least one) padded to ``size`` entries with copies of the last.

    :raises ValueError: ``size`` is smaller than the number of rows (a bucket rule bug).
    """
    n = len(rows)
    if size < n or n == 0:
        raise ValueError(f"cannot pad {n} sampled rows to {size}: a bucket holds at least the rows it pads")
    extra = size - n
    return PaddedRows(
        rows=[*rows, *[rows[-1]] * extra],
        hidden_rows=[*hidden_rows, *[hidden_rows[-1]] * extra],
        batch_rows=[*batch_rows, *[batch_rows[-1]] * extra],
        real=n,
    )
