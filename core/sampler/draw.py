"""Drawing: the row-wise logsumexp, one uniform number per row, and the inverse CDF that
turns it into a token.

A seeded row draws its number from (seed, output_index) only, so the token it gets does not
depend on what else is in the batch; other rows draw from the sampler's generator.
"""

from __future__ import annotations

import torch

CDF_CHUNK = 1024
"""Inverse CDF works on chunks of this many tokens: a float32 sum per chunk, a float64
cumulative sum over chunks, then a float64 cumulative sum inside the chosen chunk only.
This keeps each token's share exact to ~1e-7 of its chunk's mass without a float64 pass
over the whole vocabulary."""

_U64 = (1 << 64) - 1


def logsumexp(logits: torch.Tensor, row_max: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp reusing the row maxima already computed, in the scratch ``buf``."""
    shift = torch.where(torch.isfinite(row_max), row_max, 0.0)
    return torch.sub(logits, shift[:, None], out=buf).exp_().sum(dim=-1).log_().add_(shift)


def seeded_uniform(seed: int, index: int) -> float:
    """The ``index``-th output of SplitMix64 started at ``seed``, as a float in [0, 1).

    A counter-based draw: token ``index`` of a seeded request gets the same number whatever
    the batch, the step or the process, with no generator state to carry between steps.
    """
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


def chunk_sums(p: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R, ceil(V / chunk)] float64: float32 sums of consecutive chunks."""
    vocab = p.shape[1]
    whole = vocab // CDF_CHUNK * CDF_CHUNK
    parts = []
    if whole:
        parts.append(p[:, :whole].unflatten(1, (whole // CDF_CHUNK, CDF_CHUNK)).sum(dim=-1))
    if whole < vocab:
        parts.append(p[:, whole:].sum(dim=-1, keepdim=True))
    return torch.cat(parts, dim=1).double()


def inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token per row drawn from unnormalised weights ``p`` [R, V] (>= 0): the first token
    whose cumulative weight exceeds ``u * total``, in vocabulary order; -1 for a row whose
    total is not a positive finite number (NaN or infinite logits, nothing left)."""
    vocab = p.shape[1]
    csum = chunk_sums(p).cumsum(dim=-1)
    target = u * csum[:, -1]  # < total: u <= 1 - 2**-53 and float64 rounds to nearest
    chunk = torch.searchsorted(csum, target[:, None], right=True)[:, 0]
    chunk.clamp_(max=csum.shape[1] - 1)
    base = torch.where(chunk > 0, csum.gather(1, (chunk - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    width = min(CDF_CHUNK, vocab)  # a small vocabulary is a single, narrower chunk
    cols = chunk[:, None] * CDF_CHUNK + torch.arange(width, device=p.device)
    inside = cols < vocab
    local = p.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(~inside, 0.0).double()
    lcum = base[:, None] + local.cumsum(dim=-1)
    j = torch.searchsorted(lcum, target[:, None], right=True)[:, 0].clamp_(max=width - 1)
    # Where rounding put the target past the chunk's last positive weight, take that weight.
    # (Computed for every row rather than after a device read of whether any row needs it.)
    bad = local.gather(1, j[:, None])[:, 0] <= 0
    pos = torch.arange(width, device=p.device).expand_as(local)
    ok = (local > 0) & (pos <= j[:, None])
    last = torch.where(ok, pos, -1).amax(dim=-1)
    j = torch.where(bad & (last >= 0), last, j)
    total = csum[:, -1]
    drawn = cols.gather(1, j[:, None])[:, 0]
    return torch.where(torch.isfinite(total) & (total > 0), drawn, -1)
