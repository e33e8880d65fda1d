"""Static-shape buckets of the TPU platform (pure Python, no torch-xla needed).

XLA compiles one program per distinct set of input shapes, so no shape taken straight from
the batch may reach it. The TPU platform's batch shaper (:mod:`core.batch_shape`) pads
every step to these buckets before upload; each padded dimension is the next power of two
of the true size, at least a minimum:

* **rows** of the step (tokens): at least ``min_tokens`` (16);
* **sequences** of each group (prefills, decodes): at least ``min_seqs`` (8);
* **query rows per prefill** (the longest prefill chunk): at least ``min_query`` (16);
* **block-table width** (the most blocks one sequence reads): at least ``min_blocks`` (1);
* **sampled rows** (the LM head's and the sampler's rows): the sequences bucket, at least
  ``min_seqs`` (:meth:`core.batch_shape.BatchShaper.pad_sampled`, copies of the last row,
  :mod:`core.sampler.padding`).

Powers of two waste at most half of each padded dimension and keep the number of compiled
programs logarithmic in the engine's limits (:meth:`TpuBuckets.max_shapes`). A decode batch
of fixed size whose contexts grow keeps its shape until the longest context crosses a power
of two in blocks, so steady-state decoding does not recompile.
"""

from __future__ import annotations

from dataclasses import dataclass


def next_bucket(n: int, minimum: int) -> int:
    """Smallest power of two that is >= ``n`` and >= ``minimum``."""
    if n < 1:
        raise ValueError(f"cannot bucket {n}: a padded dimension holds at least one entry")
    b = 1
    while b < max(n, minimum):
        b *= 2
    return b


def bucket_count(limit: int, minimum: int) -> int:
    """How many distinct buckets ``next_bucket(n, minimum)`` takes for ``1 <= n <= limit``."""
    count, b = 1, next_bucket(1, minimum)
    while b < limit:
        b *= 2
        count += 1
    return count


def blocks_for(length: int, block_size: int) -> int:
    """Blocks that hold ``length`` tokens."""
    return -(-length // block_size)


@dataclass(frozen=True)
class TpuBuckets:
    """Minimum bucket sizes; everything else follows from :func:`next_bucket` (a
    :class:`core.batch_shape.ShapeBuckets`)."""

    min_tokens: int = 16
    min_seqs: int = 8
    min_query: int = 16
    min_blocks: int = 1

    def pad_tokens(self, n: int) -> int:
        return next_bucket(n, self.min_tokens)

    def pad_seqs(self, n: int) -> int:
        return next_bucket(n, self.min_seqs)

    def pad_query(self, n: int) -> int:
        return next_bucket(n, self.min_query)

    def pad_blocks(self, n: int) -> int:
        return next_bucket(n, self.min_blocks)

    def max_shapes(self, max_tokens: int, max_seqs: int, max_query: int, max_blocks: int) -> int:
        """Upper bound on the distinct shaped steps under these limits: rows x prefill
        sequences (or none) x query rows x decode sequences (or none) x table widths."""
        t = bucket_count(max_tokens, self.min_tokens)
        s = bucket_count(max_seqs, self.min_seqs) + 1  # + an absent group
        q = bucket_count(max_query, self.min_query)
        b = bucket_count(max_blocks, self.min_blocks)
        return t * s * q * s * b
