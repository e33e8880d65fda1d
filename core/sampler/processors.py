"""Logit processors: ``min_tokens``, ``logit_bias`` and the token penalties.

Each edits the (already temperature-scaled) logits in place at a few (row, token) pairs
that the host lists from the rows' parameters and histories; the pairs are checked and
deduplicated on the host, so no stage waits for the device.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from core.sampler.rows import SampleRow, SamplingBatch


def flat_ids(
    rows: Sequence[SampleRow],
    picks: Sequence[int],
    ids_of: Callable[[SampleRow], Sequence[int]],
    vocab_size: int,
    what: str,
) -> tuple[np.ndarray, np.ndarray]:
    """(row index, token id) pairs on the host, flattened over the picked rows; refuses ids
    outside the vocabulary."""
    lists = [ids_of(rows[i]) for i in picks]
    r = np.repeat(np.asarray(picks, dtype=np.int64), [len(x) for x in lists])
    c = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=len(r))
    if len(c) and (int(c.max()) >= vocab_size or int(c.min()) < 0):
        bad = sorted({int(t) for t in c if t >= vocab_size or t < 0})[:5]
        raise ValueError(
            f"{what} contains token id(s) {bad} outside the vocabulary of {vocab_size} "
            f"tokens (ids 0..{vocab_size - 1})"
        )
    return r, c


def min_tokens_pairs(
    rows: Sequence[SampleRow], picks: Sequence[int], eos: frozenset[int], vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(row, token) pairs that ``min_tokens`` masks in the rows ``picks``: each row's stop
    ids, plus EOS unless it ignores EOS."""

    def stops(row: SampleRow) -> list[int]:
        ids = set(row.params.stop_token_ids)
        if not row.params.ignore_eos:
            ids |= eos
        return sorted(ids)

    return flat_ids(rows, picks, stops, vocab_size, "stop_token_ids / eos_token_ids")


def mask_min_tokens(
    logits: torch.Tensor, rows: Sequence[SampleRow], eos: frozenset[int], batch: SamplingBatch
) -> None:
    """EOS and stop tokens cannot be chosen before ``min_tokens`` tokens exist."""
    picks = [i for i, r in enumerate(rows) if r.output_index < r.params.min_tokens]
    if not picks:
        return
    r, c = min_tokens_pairs(rows, picks, eos, logits.shape[1])
    dev = logits.device
    # A Python-float value would be copied to the device from pageable memory (a sync);
    # a device scalar made by a fill kernel is not.
    neg_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=dev)
    logits.index_put_((batch.stage(r, torch.int64, dev), batch.stage(c, torch.int64, dev)), neg_inf)


def add_logit_bias(
    logits: torch.Tensor, rows: Sequence[SampleRow], inv_t: torch.Tensor, batch: SamplingBatch
) -> None:
    picks = [i for i, r in enumerate(rows) if r.params.logit_bias]
    if not picks:
        return
    r, c = flat_ids(rows, picks, lambda row: list(row.params.logit_bias), logits.shape[1],
                     "logit_bias")
    bias = [v for i in picks for v in rows[i].params.logit_bias.values()]
    dev = logits.device
    r_t = batch.stage(r, torch.int64, dev)
    bias_t = batch.stage(bias, logits.dtype, dev) * inv_t[r_t]
    logits.index_put_((r_t, batch.stage(c, torch.int64, dev)), bias_t, accumulate=True)


def apply_penalties(
    logits: torch.Tensor, rows: Sequence[SampleRow], inv_t: torch.Tensor, batch: SamplingBatch
) -> None:
    """Repetition (HF: seen logits > 0 divided, < 0 multiplied; prompt and output), then
    OpenAI presence/frequency (``-= frequency * count + presence * (count > 0)``, output
    only), on logits already scaled by ``inv_t`` per row (the subtracted amounts are
    scaled alike; the repetition penalty is scale-free). Works on the unique (row, token)
    pairs of the history, never the whole vocabulary."""
    vocab, dev = logits.shape[1], logits.device
    check_history(rows)
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        r, c = flat_ids(rows, rep, lambda row: [*row.prompt_token_ids, *row.output_token_ids],
                         vocab, "token history")
        key = np.unique(r * vocab + c)
        r_t, c_t = batch.stage(key // vocab, torch.int64, dev), batch.stage(key % vocab, torch.int64, dev)
        penalty = _per_row(rows, "repetition_penalty", batch)[r_t]
        g = logits[r_t, c_t]
        logits[r_t, c_t] = torch.where(g > 0, g / penalty, g * penalty)
    pf = [
        i
        for i, row in enumerate(rows)
        if (row.params.presence_penalty or row.params.frequency_penalty) and row.output_token_ids
    ]
    if pf:
        r, c = flat_ids(rows, pf, lambda row: row.output_token_ids, vocab, "output token history")
        key, counts = np.unique(r * vocab + c, return_counts=True)
        r_t, c_t = batch.stage(key // vocab, torch.int64, dev), batch.stage(key % vocab, torch.int64, dev)
        freq = _per_row(rows, "frequency_penalty", batch)[r_t]
        pres = _per_row(rows, "presence_penalty", batch)[r_t]
        counts_t = batch.stage(counts, torch.int64, dev)
        logits[r_t, c_t] -= (freq * counts_t + pres) * inv_t[r_t]


def _per_row(rows: Sequence[SampleRow], name: str, batch: SamplingBatch) -> torch.Tensor:
    return batch.tensor(name, [float(getattr(r.params, name)) for r in rows], torch.float32)


def history_filled(row: SampleRow) -> bool:
    """Whether the row carries its whole history (a prompt, and one output id per output
    position so far)."""
    return bool(row.prompt_token_ids) and len(row.output_token_ids) == row.output_index


def check_history(rows: Sequence[SampleRow], slots: Sequence[int] | None = None) -> None:
    """Penalties need the history the scheduler promises to fill; an empty prompt or an
    output list that disagrees with output_index means it was not filled. Rows with a
    device penalty-state slot (``slots[i] >= 0``) read no history here."""
    for i, row in enumerate(rows):
        if not row.params.needs_token_history or (slots is not None and slots[i] >= 0):
            continue
        if not history_filled(row):
            raise ValueError(
                f"row {i} (request {row.request_id!r}) uses penalties but carries "
                f"{len(row.prompt_token_ids)} prompt ids and {len(row.output_token_ids)} output "
                f"ids for output_index {row.output_index}; the scheduler must fill "
                "prompt_token_ids and output_token_ids when params.needs_token_history"
            )
