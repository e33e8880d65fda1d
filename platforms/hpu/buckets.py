"""The HPU bucket policy: which padded shapes the attention computation may see.

HPU graphs (and the Gaudi graph compiler in lazy mode) compile one graph per distinct
input shape, so every dynamic size is rounded up to a *bucket* before it reaches a kernel.
One rule serves all sizes: round ``n`` up to the next power of two while that is below
``step``, and to the next multiple of ``step`` beyond it::

    step 8:  1 2 4 8 16 24 32 40 ...        (n = 3 -> 4, n = 9 -> 16, n = 17 -> 24)

Powers of two keep small batches cheap; the linear tail keeps the waste of a large size
below ``step``. For sizes up to ``N`` there are at most ``log2(step) + 1 + N / step``
buckets, so a warm-up pass can compile all of them ahead of time (see :meth:`values`).

The HPU platform's batch shaper (:mod:`core.batch_shape`) pads every step with this policy
before upload: the rows (tokens) of the step, the sequences of each group (prefills and
decodes are separate groups), the longest prefill query and the block-table width.
"""

from __future__ import annotations

from dataclasses import dataclass


def bucket(n: int, step: int) -> int:
    """Smallest bucket >= ``n``: a power of two capped at ``step``, else a multiple of step.

    :param n: the real size, >= 1.
    :param step: where powers of two give way to multiples of ``step``, >= 1.
    """
    if n < 1 or step < 1:
        raise ValueError(f"bucket sizes need n >= 1 and step >= 1, got n={n}, step={step}")
    if n <= step:
        return min(1 << (n - 1).bit_length(), step)
    return -(-n // step) * step


def bucket_values(max_n: int, step: int) -> tuple[int, ...]:
    """Every bucket that sizes ``1..max_n`` can be padded to, ascending."""
    return tuple(sorted({bucket(n, step) for n in _candidates(max_n, step)}))


def _candidates(max_n: int, step: int) -> list[int]:
    # One representative size per bucket is enough: powers of two, step, then its multiples.
    small = [1 << i for i in range(step.bit_length()) if (1 << i) <= min(step, max_n)]
    return [*small, *range(min(step, max_n), max_n + 1, step), max_n]


@dataclass(frozen=True)
class BucketPolicy:
    """Bucket steps of a padded step (a :class:`core.batch_shape.ShapeBuckets`).

    The defaults suit Gaudi with 128-token blocks: the rows of a step double up to 256,
    then grow by 256; up to 32 sequences double, then grow by 32; prefill queries double up
    to 128 tokens, then grow by 128; context doubles up to 8 blocks (1,024 tokens), then
    grows by 8 blocks.
    """

    token_step: int = 256
    """Bucket step of the rows (tokens) of a step."""
    seq_step: int = 32
    """Bucket step of the number of sequences in a group."""
    query_step: int = 128
    """Bucket step of the longest prefill query (tokens)."""
    block_step: int = 8
    """Bucket step of the context length, in blocks."""

    def pad_tokens(self, n: int) -> int:
        return bucket(n, self.token_step)

    def pad_seqs(self, n: int) -> int:
        return bucket(n, self.seq_step)

    def pad_query(self, n: int) -> int:
        return bucket(n, self.query_step)

    def pad_blocks(self, n: int) -> int:
        return bucket(n, self.block_step)

    def values(self, max_seqs: int, max_query: int, max_blocks: int) -> dict[str, tuple[int, ...]]:
        """All buckets per dimension for the given limits (what a warm-up would compile)."""
        return {
            "seqs": bucket_values(max_seqs, self.seq_step),
            "query": bucket_values(max_query, self.query_step),
            "blocks": bucket_values(max_blocks, self.block_step),
        }
