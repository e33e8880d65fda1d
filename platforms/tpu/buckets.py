"""Static-shape bucket policy of the TPU platform (pure Python, no torch-xla needed).

XLA compiles one program per distinct set of input shapes, so the attention backend never
hands XLA a shape taken straight from the batch. Each step's attention inputs are padded:

* **sequences**: the number of prefill sequences and the number of decode sequences are
  each padded to the next power of two, at least ``min_seqs`` (8);
* **query rows per prefill**: the longest prefill chunk of the step is padded to the next
  power of two, at least ``min_query`` (16); every prefill sequence gets that many rows;
* **context blocks per sequence** (block-table width): the longest context of the group,
  in blocks, is padded to the next power of two, at least ``min_blocks`` (1).

Padding rows are inert: a padded query reads block 0 at position 0 (a finite softmax over
one real key) and its output is dropped; padded block-table entries are 0 and lie past
every sequence's length, so they are masked. Padding never writes the cache (the backend
handles negative slots separately).

Powers of two waste at most half of each padded dimension and keep the number of compiled
attention shapes logarithmic: with ``S`` sequence buckets, ``Q`` query buckets and ``B``
block buckets up to the engine's limits there are at most ``S*Q*B`` prefill shapes and
``S*B`` decode shapes (see :meth:`BucketPolicy.max_shapes`). A decode batch of fixed size
whose contexts grow keeps its shape until the context crosses a power of two in blocks, so
steady-state decoding does not recompile.
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
class PrefillPlan:
    """Padded layout of a step's prefill rows: sequence ``i``'s query ``j`` sits at
    padded row ``i * query_len + j``."""

    num_seqs: int
    """Bucketed number of prefill sequences."""
    query_len: int
    """Bucketed query rows per sequence."""
    num_blocks: int
    """Bucketed block-table width."""
    gather_rows: tuple[int, ...]
    """[num_seqs * query_len] flat prefill row that fills each padded row (padding: 0)."""
    positions: tuple[int, ...]
    """[num_seqs * query_len] absolute position of each padded row (padding: 0)."""
    scatter_rows: tuple[int, ...]
    """[num_prefill_tokens] padded row holding each flat prefill row's output."""
    block_table: tuple[tuple[int, ...], ...]
    """[num_seqs][num_blocks] block ids; padding entries 0."""


@dataclass(frozen=True)
class DecodePlan:
    """Padded layout of a step's decode rows (one per sequence)."""

    num_seqs: int
    """Bucketed number of decode sequences."""
    num_blocks: int
    """Bucketed block-table width."""
    gather_rows: tuple[int, ...]
    """[num_seqs] decode row that fills each padded row (padding: 0)."""
    lengths: tuple[int, ...]
    """[num_seqs] context length including the new token; padding 1, never 0 (an empty
    context would make the softmax undefined)."""
    block_table: tuple[tuple[int, ...], ...]
    """[num_seqs][num_blocks] block ids; padding entries 0."""


def _pad_table(rows: list[list[int]], num_seqs: int, num_blocks: int, used: list[int]):
    """Rows cut to their ``used`` blocks and zero-padded to ``num_seqs`` x ``num_blocks``."""
    table = [tuple(r[:u]) + (0,) * (num_blocks - u) for r, u in zip(rows, used)]
    table += [(0,) * num_blocks] * (num_seqs - len(rows))
    return tuple(table)


@dataclass(frozen=True)
class BucketPolicy:
    """Minimum bucket sizes; everything else follows from :func:`next_bucket`."""

    min_seqs: int = 8
    min_query: int = 16
    min_blocks: int = 1

    def max_shapes(self, max_seqs: int, max_query: int, max_blocks: int) -> int:
        """Upper bound on distinct attention shapes (prefill + decode) under these limits."""
        s = bucket_count(max_seqs, self.min_seqs)
        q = bucket_count(max_query, self.min_query)
        b = bucket_count(max_blocks, self.min_blocks)
        return s * q * b + s * b

    def plan_prefill(
        self,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
    ) -> PrefillPlan:
        """Layout of the prefill sequences (``query_lens[i]`` new rows over
        ``context_lens[i]`` cached tokens, rows flattened in sequence order)."""
        n = len(query_lens)
        num_seqs = next_bucket(n, self.min_seqs)
        qlen = next_bucket(max(query_lens), self.min_query)
        used = [blocks_for(c + q, block_size) for q, c in zip(query_lens, context_lens)]
        num_blocks = next_bucket(max(used), self.min_blocks)
        gather = [0] * (num_seqs * qlen)
        positions = [0] * (num_seqs * qlen)
        scatter: list[int] = []
        flat = 0
        for i, (q, c) in enumerate(zip(query_lens, context_lens)):
            for j in range(q):
                gather[i * qlen + j] = flat + j
                positions[i * qlen + j] = c + j
                scatter.append(i * qlen + j)
            flat += q
        table = _pad_table(block_tables, num_seqs, num_blocks, used)
        return PrefillPlan(
            num_seqs, qlen, num_blocks, tuple(gather), tuple(positions), tuple(scatter), table
        )

    def plan_decode(
        self, seq_lens: list[int], block_tables: list[list[int]], block_size: int
    ) -> DecodePlan:
        """Layout of the decode sequences (``seq_lens[i]`` includes the new token)."""
        n = len(seq_lens)
        num_seqs = next_bucket(n, self.min_seqs)
        used = [blocks_for(s, block_size) for s in seq_lens]
        num_blocks = next_bucket(max(used), self.min_blocks)
        gather = tuple(range(n)) + (0,) * (num_seqs - n)
        lengths = tuple(seq_lens) + (1,) * (num_seqs - n)
        table = _pad_table(block_tables, num_seqs, num_blocks, used)
        return DecodePlan(num_seqs, num_blocks, gather, lengths, table)
