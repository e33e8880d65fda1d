"""Filters: top-k, top-p (on the top-k survivors, renormalised) and min-p.

Each filter becomes one cut-off value per row; a token survives when its scaled logit is at
least the row's largest cut-off, so ties are always kept or dropped together. The per-row
parameters are host lists, so deciding what runs reads nothing back from the device.
"""

from __future__ import annotations

import torch

from core.sampler.draw import chunk_sums
from core.sampler.rows import Scratch, Staging

SORT_ROWS = 16
"""Rows per full sort in the top-p fallback (16 x 128k floats = 8 MB per temporary)."""


def apply_filters(
    z: torch.Tensor,
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
    candidates: int,
    ws: Scratch,
    stage: Staging,
    ready: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Weights ``exp(z - max)`` of scaled logits ``z`` [R, V] with tokens below each
    row's top-k / top-p / min-p cut-off set to 0, in scratch ``exp``. ``z`` is only read;
    the per-row parameters are host lists, so deciding what to run reads nothing back.
    ``ready``: ``(max, exp(z - max))`` when the caller computed them already (the second is
    scratch ``exp`` itself)."""
    dev = z.device
    z_max = z.amax(dim=-1) if ready is None else ready[0]
    k_cut = torch.full((z.shape[0],), float("-inf"), device=dev)
    k_rows = [i for i, k in enumerate(top_k) if k > 0]
    if k_rows:
        idx = stage(k_rows, torch.int64, dev)
        ks = stage([top_k[i] for i in k_rows], torch.int64, dev)
        kth = ws.rows("sub", z, idx).topk(max(top_k), dim=-1).values
        k_cut[idx] = kth.gather(1, (ks - 1)[:, None])[:, 0]
    cut = k_cut
    if any(m > 0 for m in min_p):
        min_p_t = stage(min_p, torch.float32, dev)
        cut = torch.maximum(cut, z_max + torch.log(min_p_t))  # p_i >= min_p * p_max
    if ready is None:
        p = torch.sub(z, z_max[:, None], out=ws.get("exp", z.shape, z)).exp_()
    else:
        p = ready[1]
    p_rows = [i for i, tp in enumerate(top_p) if tp < 1.0]
    if p_rows:
        idx = stage(p_rows, torch.int64, dev)
        p_cut = _top_p_cutoff(
            z,
            p,
            idx,
            z_max[idx],
            k_cut[idx],
            [top_k[i] for i in p_rows],
            [top_p[i] for i in p_rows],
            candidates,
            ws,
            stage,
        )
        cut = cut.index_put((idx,), torch.maximum(cut[idx], p_cut))
    if k_rows or p_rows or any(m > 0 for m in min_p):
        p.masked_fill_(torch.lt(z, cut[:, None], out=ws.get("mask", z.shape, z, torch.bool)), 0.0)
    return p


def _top_p_cutoff(
    z: torch.Tensor,
    p: torch.Tensor,
    idx: torch.Tensor,
    z_max: torch.Tensor,
    k_cut: torch.Tensor,
    top_k_rows: list[int],
    top_p_rows: list[float],
    candidates: int,
    ws: Scratch,
    stage: Staging,
) -> torch.Tensor:
    """The smallest scaled logit top-p keeps, for the rows ``idx`` of ``z``.

    The top-p set is taken on the distribution after top-k (tokens with z >= ``k_cut``):
    a token is kept while the mass of the tokens above it is below ``top_p``. The cut-off
    is searched among the first ``candidates`` sorted values (at least top_k + 1); rows
    whose nucleus reaches past them are sorted in full, which takes one read-back of
    whether any row does. ``candidates <= 0`` sorts every row (no read-back).
    """
    vocab, dev = z.shape[1], z.device
    zi = ws.rows("sub", z, idx)
    top_p = stage(top_p_rows, torch.float64, dev)
    with_k = stage([k > 0 for k in top_k_rows], torch.bool, dev)
    # Rows without top-k normalise over the whole row; rows with top-k over their
    # candidates, which then hold every survivor (checked below).
    mass = torch.where(with_k, float("nan"), chunk_sums(p).sum(dim=-1)[idx])
    k = min(vocab, max(candidates, max(top_k_rows) + 1))
    if candidates <= 0 or k == vocab:
        every = torch.arange(len(idx), device=z.device)
        return _sorted_cutoffs(zi, every, z_max, k_cut, top_p, mass)
    vals = zi.topk(k, dim=-1).values
    cutoff, kept = _nucleus(vals, z_max, k_cut, top_p, mass)
    covered = (kept < k) & (~with_k | (vals[:, -1] < k_cut))
    if not bool(covered.all()):
        miss = (~covered).nonzero()[:, 0]
        cutoff[miss] = _sorted_cutoffs(zi, miss, z_max[miss], k_cut[miss], top_p[miss], mass[miss])
    return cutoff


def _sorted_cutoffs(
    z: torch.Tensor,
    rows: torch.Tensor,
    z_max: torch.Tensor,
    k_cut: torch.Tensor,
    top_p: torch.Tensor,
    mass: torch.Tensor,
) -> torch.Tensor:
    """Top-p cut-offs of ``z[rows]`` from full sorts (the other tensors are per ``rows``),
    a few rows at a time so that the sort's temporaries stay small enough for the
    allocator to reuse instead of faulting in fresh pages for each."""
    out = torch.empty(len(rows), dtype=z.dtype, device=z.device)
    for start in range(0, len(rows), SORT_ROWS):
        b = slice(start, start + SORT_ROWS)
        vals = z.index_select(0, rows[b]).sort(dim=-1, descending=True).values
        out[b] = _nucleus(vals, z_max[b], k_cut[b], top_p[b], mass[b])[0]
    return out


def _nucleus(
    vals: torch.Tensor,
    z_max: torch.Tensor,
    k_cut: torch.Tensor,
    top_p: torch.Tensor,
    mass: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p over descending ``vals`` [n, K] (each row's largest is ``z_max``). ``mass`` is
    each row's total weight ``sum(exp(z - z_max))``, or NaN to use the candidates' own
    (top-k rows). Returns the cut-off value and how many candidates are kept."""
    q = torch.sub(vals, z_max[:, None]).exp_().masked_fill_(vals < k_cut[:, None], 0.0).double()
    cum = q.cumsum(dim=-1)
    total = torch.where(torch.isnan(mass), cum[:, -1], mass)
    above = cum - q  # mass of the more likely candidates
    # >= 1: above[0] == 0, unless top_p * total underflows to 0 (top_p=5e-324): keep the top one
    kept = (above < (top_p * total)[:, None]).sum(dim=-1).clamp_(min=1)
    return vals.gather(1, (kept - 1)[:, None])[:, 0], kept


