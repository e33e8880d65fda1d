"""The step shapes the (imagined) Acme NPU runs: it compiles one command program per shape.

Like XLA or a graph compiler, the NPU's command processor builds a program for each distinct
set of tensor sizes and caches it. So the platform returns core's bucketed batch shaper
(:class:`core.batch_shape.BucketedBatchShaper`) with these buckets, and every step the
runner hands to the NPU is padded to them on the host:

* rows (tokens): a multiple of 64, the NPU's row tile (powers of two below it);
* sequences of each group: a power of two, at least 4;
* query rows per prefill: a power of two, at least 16;
* block-table width: a power of two.
"""

from __future__ import annotations

from dataclasses import dataclass


def power_of_two(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= n and >= minimum."""
    if n < 1:
        raise ValueError(f"cannot pad a size of {n}: a padded dimension holds at least one entry")
    return 1 << (max(n, minimum) - 1).bit_length()


@dataclass(frozen=True)
class AcmeBuckets:
    """A :class:`core.batch_shape.ShapeBuckets` for the Acme NPU."""

    row_tile: int = 64
    min_seqs: int = 4
    min_query: int = 16

    def pad_tokens(self, n: int) -> int:
        if n <= self.row_tile:
            return power_of_two(n)
        return -(-n // self.row_tile) * self.row_tile

    def pad_seqs(self, n: int) -> int:
        return power_of_two(n, self.min_seqs)

    def pad_query(self, n: int) -> int:
        return power_of_two(n, self.min_query)

    def pad_blocks(self, n: int) -> int:
        return power_of_two(n)
