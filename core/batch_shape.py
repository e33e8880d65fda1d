"""Static-shape batches: the strategy a platform returns to pad every step to its buckets.

Graph compilers (XLA on a TPU, the Gaudi graph compiler) build one program per distinct set
of input shapes. A platform whose device works that way returns a :class:`BatchShaper` from
:meth:`core.platform.Platform.batch_shaper`; the model runner then pads each step's inputs
once, on the host, before they reach the device, so the whole step (embedding, every layer,
the LM head's input) sees only bucketed shapes, and its attention backend receives
bucketed metadata and needs no host data of its own.

Layout of a shaped step (``P`` prefills, ``D`` decodes, buckets from :class:`ShapeBuckets`)::

    sequences  [P prefills][Sp - P empty prefills][D decodes][Sd - D padding decodes]
    rows       [prefill rows][D decode rows][Sd - D padding decode rows][padding up to T]

* ``Sp = pad_seqs(P)`` and ``Sd = pad_seqs(D)`` (0 for an absent group); ``num_prefills`` is
  ``Sp`` and ``num_decode_tokens`` is ``Sd``;
* ``max_query_len = pad_query(longest prefill)`` (1 without prefills): a backend lays the
  prefills out as ``[Sp, max_query_len]`` query rows;
* ``block_tables`` is ``[Sp + Sd, pad_blocks(most blocks a sequence reads)]``;
* ``T = pad_tokens(prefill rows + Sd)`` rows in ``input_ids``, ``positions`` and
  ``slot_mapping``.

Real rows keep the places they have without padding, so the runner reads each sequence's
logits from the same rows either way. Padding never writes the cache (slot -1) and never
reads anything but the null block 0: an empty prefill has no rows (context 0, ``seq_lens``
0), a padding decode has context 0 and ``seq_lens`` 1, padded table entries are 0, a padding
row has input id 0 at position 0. :func:`rows_of_groups` gives a backend the gather indices
of this layout, computed on the device from the metadata's tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from core.attention import AttentionMetadata, build_metadata


class ShapeBuckets(Protocol):
    """A platform's bucket rule per padded dimension: each maps a true size >= 1 to the
    padded size (>= it) a compiled program is built for."""

    def pad_tokens(self, n: int) -> int:
        """Rows of the step (tokens)."""

    def pad_seqs(self, n: int) -> int:
        """Sequences of one group (the prefills, or the decodes)."""

    def pad_query(self, n: int) -> int:
        """Query rows per prefill (the longest prefill chunk of the step)."""

    def pad_blocks(self, n: int) -> int:
        """Block-table width (the most blocks one sequence of the step reads)."""


@dataclass(frozen=True)
class HostStep:
    """One step's inputs on the host, before upload (int64 arrays; prefills first)."""

    input_ids: np.ndarray
    """[rows] token ids (a placeholder -1 stands for the row's last sampled token)."""
    positions: np.ndarray
    """[rows] absolute position of each row."""
    slot_mapping: np.ndarray
    """[rows] cache slot of each row; -1 = padding."""
    token_rows: np.ndarray
    """[rows] persistent-batch row of each row's sequence (placeholders read it)."""
    query_lens: np.ndarray
    """[seqs] new tokens per sequence."""
    context_lens: np.ndarray
    """[seqs] tokens cached before this step."""
    block_tables: np.ndarray
    """[seqs, width] block ids; entries past a sequence's blocks are 0."""
    num_prefills: int
    max_query_len: int | None = None
    """Bucketed longest prefill (set by a shaper); None: the true maximum."""
    max_seq_len: int | None = None
    """Bucketed context bound (set by a shaper); None: the true maximum."""

    def upload(
        self, device: torch.device, block_size: int,
        to_device: Callable[[np.ndarray], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, token_rows, metadata) on ``device``.

        :param to_device: copies one int64 array to the device (e.g. through page-locked
            staging); default ``torch.from_numpy(a).to(device)``.
        """
        move = to_device or (lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device))
        md = build_metadata(
            self.query_lens, self.context_lens, self.block_tables, block_size,
            num_prefills=self.num_prefills, device=device, slot_mapping=self.slot_mapping,
            max_query_len=self.max_query_len, max_seq_len=self.max_seq_len,
        )
        return move(self.input_ids), move(self.positions), move(self.token_rows), md


class BatchShaper(ABC):
    """Lays out each step in a platform's static shapes (a strategy object of a platform).

    Invariant: :meth:`shape` returns a step in the layout of this module's docstring whose
    real rows are the input's rows, in place, with their ids, positions and slots; every
    other row, sequence and table entry is padding as described there.
    """

    @abstractmethod
    def shape(self, step: HostStep) -> HostStep:
        """The padded step (host arrays only: no device work)."""

    def pad_sampled(self, n: int) -> int:
        """Rows the LM head and the sampler run on for ``n`` sampled sequences (>= n; the
        runner pads with copies, see :mod:`core.sampler.padding`). Default: ``n``."""
        return n


class BucketedBatchShaper(BatchShaper):
    """Pads each dimension to the bucket ``buckets`` gives it (see module docstring).

    :param before_step: called first in every :meth:`shape`, before any of the step's
        device work is queued. A lazy-tracing device (XLA) cuts the work still queued from
        the previous step (sampling bookkeeping, block copies, whose sizes follow the
        batch) into a program of its own there, so the step's program holds only the
        shaped step and its shape alone decides whether it compiles.
    """

    def __init__(
        self, buckets: ShapeBuckets, block_size: int, before_step: Callable[[], None] | None = None
    ):
        self.buckets = buckets
        self.block_size = block_size
        self.before_step = before_step

    def shape(self, step: HostStep) -> HostStep:
        if self.before_step is not None:
            self.before_step()
        b, p = self.buckets, step.num_prefills
        qlens, ctx = step.query_lens, step.context_lens
        d = len(qlens) - p
        sp = _padded(b.pad_seqs, p) if p else 0
        sd = _padded(b.pad_seqs, d) if d else 0
        rows = _padded(b.pad_tokens, int(qlens[:p].sum()) + sd)
        query = _padded(b.pad_query, int(qlens[:p].max())) if p else 1
        used = -(-(ctx + qlens) // self.block_size)
        width = _padded(b.pad_blocks, max(int(used.max(initial=0)), 1))
        tables = np.zeros((sp + sd, width), dtype=np.int32)
        keep = min(width, step.block_tables.shape[1])
        tables[:p, :keep] = step.block_tables[:p, :keep]
        tables[sp : sp + d, :keep] = step.block_tables[p:, :keep]
        return HostStep(
            input_ids=_pad_rows(step.input_ids, rows, 0),
            positions=_pad_rows(step.positions, rows, 0),
            slot_mapping=_pad_rows(step.slot_mapping, rows, -1),
            token_rows=_pad_rows(step.token_rows, rows, 0),
            query_lens=_pad_groups(qlens, p, sp, sd, 0, 1),
            context_lens=_pad_groups(ctx, p, sp, sd, 0, 0),
            block_tables=tables,
            num_prefills=sp,
            max_query_len=query,
            max_seq_len=width * self.block_size,
        )


    def pad_sampled(self, n: int) -> int:
        """The sequences bucket: a step samples at most one row per sequence."""
        return _padded(self.buckets.pad_seqs, n)


def _padded(pad: Callable[[int], int], n: int) -> int:
    """``pad(n)``, refused when it would drop entries (a bucket smaller than the size)."""
    padded = pad(n)
    if padded < n:
        raise ValueError(
            f"{getattr(pad, '__qualname__', pad)}({n}) returned {padded}: a bucket must be at "
            f"least the size it pads; fix the platform's bucket rule"
        )
    return padded


def _pad_rows(a: np.ndarray, rows: int, fill: int) -> np.ndarray:
    out = np.full(rows, fill, dtype=np.int64)
    out[: len(a)] = a
    return out


def _pad_groups(a: np.ndarray, p: int, sp: int, sd: int, prefill_fill: int, decode_fill: int):
    """Per-sequence values: prefills padded to ``sp`` entries, decodes to ``sd``."""
    d = len(a) - p
    return np.concatenate([
        a[:p], np.full(sp - p, prefill_fill, np.int64), a[p:], np.full(sd - d, decode_fill, np.int64)
    ]).astype(np.int64)


def shape_key(md: AttentionMetadata) -> tuple[int, int, int, int, int]:
    """(rows, prefill seqs, query rows, decode seqs, table width): the sizes a compiled
    program of a shaped step depends on (logs, tests)."""
    return (
        md.slot_mapping.shape[0], md.num_prefills, md.max_query_len,
        md.num_decode_tokens, md.block_tables.shape[1],
    )


@dataclass(frozen=True)
class GroupRows:
    """Device-side gather indices of a (shaped or exact) step, for backends that attend the
    prefills as ``[num_prefills, max_query_len]`` padded query rows and the decodes as one
    row each. All shapes follow from the metadata's sizes, never from its values."""

    prefill_rows: torch.Tensor
    """[num_prefills, max_query_len] int64 flat row of each padded query (clamped)."""
    prefill_valid: torch.Tensor
    """[num_prefills, max_query_len] bool: a real query row."""
    prefill_positions: torch.Tensor
    """[num_prefills, max_query_len] int64 absolute position of each query row."""
    decode_rows: torch.Tensor
    """[num_decode_tokens] int64 flat row of each decode."""
    seq_of_row: torch.Tensor
    """[rows] int64 sequence owning each flat row (rows of no sequence: the last one)."""
    index_in_seq: torch.Tensor
    """[rows] int64 query index of each flat row within its sequence (clamped >= 0)."""


def rows_of_groups(md: AttentionMetadata, num_rows: int) -> GroupRows:
    """Gather indices for ``md`` over a step of ``num_rows`` flat rows (the query's rows).

    Computed from ``query_start_loc`` and ``context_lens`` on their device, so a shaped
    step needs no host data and every tensor here has a bucketed shape."""
    dev = md.query_start_loc.device
    qsl = md.query_start_loc.long()
    sp, q = md.num_prefills, max(md.max_query_len, 1)
    starts = qsl[:sp].unsqueeze(1)
    j = torch.arange(q, device=dev)
    lens = (qsl[1 : sp + 1] - qsl[:sp]).unsqueeze(1)
    rows = torch.arange(num_rows, device=dev)
    seq = torch.searchsorted(qsl[1:].contiguous(), rows, right=True).clamp(max=md.num_seqs - 1)
    return GroupRows(
        prefill_rows=(starts + j).clamp(max=max(num_rows - 1, 0)),
        prefill_valid=j < lens,
        prefill_positions=md.context_lens[:sp].long().unsqueeze(1) + j,
        decode_rows=qsl[sp : md.num_seqs].clamp(max=max(num_rows - 1, 0)),
        seq_of_row=seq,
        index_in_seq=(rows - qsl[seq]).clamp(min=0),
    )


def scatter_groups(
    rows: GroupRows, num_prefills: int, prefill_out: torch.Tensor | None,
    decode_out: torch.Tensor | None,
) -> torch.Tensor:
    """Flat ``[rows, ...]`` output from ``prefill_out`` ``[Sp, Q, ...]`` and ``decode_out``
    ``[Sd, ...]`` (either None when its group is empty), by one gather per group. Rows of
    no sequence get some group's row (their output is unspecified)."""
    seq = rows.seq_of_row
    parts = []
    if prefill_out is not None:
        sp, q = prefill_out.shape[:2]
        s = seq.clamp(max=sp - 1)
        parts.append(prefill_out[s, rows.index_in_seq.clamp(max=q - 1)])
    if decode_out is not None:
        parts.append(decode_out[(seq - num_prefills).clamp(0, decode_out.shape[0] - 1)])
    if len(parts) == 1:
        return parts[0]
    is_prefill = (seq < num_prefills).view(-1, *([1] * (parts[0].dim() - 1)))
    return torch.where(is_prefill, parts[0], parts[1])
