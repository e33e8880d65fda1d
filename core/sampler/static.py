"""The sampler for static-shape devices: every stage on every row, no row subsets.

The torch pipeline of :mod:`core.sampler.sampler` takes row subsets (the greedy rows, the
random rows, the top-k rows, the top-p rows, the rows a processor edits) and sizes some
stages by the data (``topk(max(top_k))``). On a device that compiles one program per set of
shapes (XLA), a batch whose rows mix parameters then compiles a new program whenever a
subset's size changes. :class:`StaticShapeSampling` is a :class:`~core.sampler.kernel.SamplingKernel`
written in torch that runs each stage on all ``B`` rows with neutral values where a row does
not use it (no top-k: cut-off ``-inf``; top-p 1 and min-p 0: no cut-off; greedy rows: the
argmax, chosen by a ``where``), so its shapes are ``B``, the vocabulary and the padded edit
count only (:func:`pad_edits`: a power of two, at least :data:`MIN_EDITS`). A static-shape
platform supplies it as its ``sampling_kernel`` op (the TPU does).

Its tokens and logprobs are the torch pipeline's, bit for bit: the same arithmetic per row,
top-k and top-p cut-offs read from one full descending sort (the pipeline's candidate search
finds the same values in a prefix of it), and the same uniform numbers (drawn by the sampler
for the random rows only, so the generator advances alike). It costs a full sort of every
row each step, which the subset path avoids; that is why other platforms keep that path.
"""

from __future__ import annotations

import dataclasses

import torch

from core.sampler.draw import chunk_sums, inverse_cdf, logsumexp
from core.sampler.filters import _nucleus
from core.sampler.kernel import (
    EDIT_BEGIN,
    EDIT_END,
    EDIT_MASK,
    EDIT_REPEAT,
    FREQUENCY,
    MIN_P,
    PRESENCE,
    PROCESSED,
    REPETITION,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    UNIFORM,
    KernelInputs,
)

MIN_EDITS = 16
"""Smallest padded edit count: small histories share one program."""


def pad_edits(inputs: KernelInputs) -> KernelInputs:
    """``inputs`` (on the host) with the edit list padded to a power of two >= MIN_EDITS.

    Padding entries copy the last real edit (its row's writes then carry one value twice),
    or are all-zero edits of row 0 (neutral: nothing masked, counted, penalised or biased)
    when there is none. No row's [begin, end) range covers them."""
    edits = inputs.edits
    e = edits.shape[0]
    size = max(MIN_EDITS, 1 << max(e - 1, 0).bit_length())
    if size == e:
        return inputs
    fill = edits[-1:] if e else torch.zeros((1, edits.shape[1]), dtype=edits.dtype)
    return dataclasses.replace(inputs, edits=torch.cat([edits, fill.expand(size - e, -1)]))


class StaticShapeSampling:
    """Samples with shapes that depend on the batch only (see the module docstring)."""

    pads_edits = True
    """The sampler pads the edit list with :func:`pad_edits` before the inputs move."""

    def accepts(self, logits: torch.Tensor) -> bool:
        return True

    def __call__(
        self, logits: torch.Tensor, inputs: KernelInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rowf, rowi = inputs.rowf, inputs.rowi
        top, argmax = logits.max(dim=-1)
        lse = logsumexp(logits, top, torch.empty_like(logits))
        temp = rowf[:, TEMPERATURE].float()
        greedy = temp == 0
        temp = torch.where(greedy, 1.0, temp)  # greedy rows count as temperature 1
        work = _processed(logits / temp[:, None], rowf, rowi, inputs.edits, temp.reciprocal())
        weights = _filtered(work, rowf, rowi)
        drawn = inverse_cdf(weights, rowf[:, UNIFORM])
        # No usable weights (a +inf or NaN logit): the raw argmax, as the pipeline does.
        drawn = torch.where(drawn >= 0, drawn, argmax)
        tokens = torch.where(greedy, work.argmax(dim=-1), drawn)
        chosen = logits.gather(1, tokens[:, None])[:, 0]
        return tokens, chosen - lse, lse


def _processed(
    work: torch.Tensor, rowf: torch.Tensor, rowi: torch.Tensor, edits: torch.Tensor, inv_t: torch.Tensor
) -> torch.Tensor:
    """min_tokens, logit bias, repetition then presence/frequency penalties applied to the
    edited (row, token) pairs of ``work`` (scaled logits), in the pipeline's order."""
    b = work.shape[0]
    begin, end = rowi[:, EDIT_BEGIN].long(), rowi[:, EDIT_END].long()
    pos = torch.arange(edits.shape[0], device=work.device)
    # Row of each edit: the last row with edits that starts at or before it (padding
    # entries, past every range, land on the last real edit's row, or row 0).
    starts = (begin[None, :] <= pos[:, None]) & (begin < end)[None, :]
    rows = torch.where(starts, torch.arange(b, device=work.device)[None, :], -1).amax(dim=1).clamp(min=0)
    tokens, count, flags = edits[:, 0].long(), edits[:, 1], edits[:, 2]
    bias = edits[:, 3].view(torch.float32)
    g = work[rows, tokens]
    g = torch.where((flags & EDIT_MASK) != 0, float("-inf"), g)
    g = torch.where(bias != 0, g + bias * inv_t[rows], g)
    pen = rowf[:, REPETITION].float()[rows]
    g = torch.where((flags & EDIT_REPEAT) != 0, torch.where(g > 0, g / pen, g * pen), g)
    freq, pres = rowf[:, FREQUENCY].float()[rows], rowf[:, PRESENCE].float()[rows]
    g = torch.where(count > 0, g - (freq * count + pres) * inv_t[rows], g)
    work = work.index_put((rows, tokens), g)
    # The pipeline clears NaN / +inf of every row when any row is processed.
    # (torch.nan_to_num with nan=-inf, written out: XLA refuses an infinite replacement.)
    cleared = torch.where(torch.isnan(work), float("-inf"), work)
    cleared = torch.where(cleared == float("inf"), torch.finfo(work.dtype).max, cleared)
    return torch.where(rowf[:, PROCESSED, None] != 0, cleared, work)


def _filtered(z: torch.Tensor, rowf: torch.Tensor, rowi: torch.Tensor) -> torch.Tensor:
    """Weights ``exp(z - max)`` with tokens below each row's top-k / min-p / top-p cut-off
    set to 0 (:func:`core.sampler.filters.apply_filters` on every row)."""
    neg_inf = float("-inf")
    top_k = rowi[:, TOP_K].long()
    min_p, top_p = rowf[:, MIN_P].float(), rowf[:, TOP_P]
    z_max = z.amax(dim=-1)
    vals = z.sort(dim=-1, descending=True).values
    k_cut = torch.where(top_k > 0, vals.gather(1, (top_k - 1).clamp(min=0)[:, None])[:, 0], neg_inf)
    cut = torch.where(min_p > 0, torch.maximum(k_cut, z_max + torch.log(min_p)), k_cut)
    p = torch.sub(z, z_max[:, None]).exp_()
    # Rows without top-k normalise over the whole row, rows with top-k over their survivors.
    mass = torch.where(top_k > 0, float("nan"), chunk_sums(p).sum(dim=-1))
    p_cut = _nucleus(vals, z_max, k_cut, top_p, mass)[0]
    cut = torch.where(top_p < 1.0, torch.maximum(cut, p_cut), cut)
    return p.masked_fill_(z < cut[:, None], 0.0)


__all__ = ["MIN_EDITS", "StaticShapeSampling", "pad_edits"]
