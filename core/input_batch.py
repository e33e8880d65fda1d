"""The model runner's persistent batch: device-side rows that outlive a step.

Each scheduled sequence owns a *row* of preallocated device buffers while it is scheduled in
consecutive steps: its block table and the last token the runner sampled for it. A step
changes those rows by difference only:

* a sequence seen for the first time (or again after a step without it, or preempted) gets
  a free row and its whole block table is written once;
* a sequence that stays keeps its row; only the blocks appended since the last step are
  written (a changed first or last known block, as after copy-on-write, rewrites the row);
* rows of sequences that left the batch are zeroed and freed.

The per-token inputs of a step (ids, positions) and the per-sequence lengths are O(tokens)
host arrays; they travel with the block-table changes in two packed host tensors (page-locked
where the platform can pin memory), i.e. two host-to-device copies per step. Block tables of
the step and the slot mapping are then gathered on the device from the persistent rows, so
no step costs host work of O(batch x blocks).

Placeholder input ids: a decode row scheduled with the token id :data:`PLACEHOLDER_TOKEN`
(-1) takes its input id from the row's last sampled token, which never left the device.
That lets the host schedule step N+1 before it has read step N's tokens back (asynchronous
scheduling). It is an error for a row that did not sample in the previous step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from core.attention import AttentionMetadata
from core.batch_shape import BatchShaper, HostStep
from core.request import PLACEHOLDER_TOKEN
from core.scheduler import ScheduledSequence

__all__ = ["PLACEHOLDER_TOKEN", "PersistentBatch", "StepInputs"]


@dataclass(frozen=True)
class StepInputs:
    """A step's model inputs on the device, and where each scheduled sequence sits."""

    input_ids: torch.Tensor
    """[num_tokens] int64."""
    positions: torch.Tensor
    """[num_tokens] int64."""
    metadata: AttentionMetadata
    rows: tuple[int, ...]
    """Persistent row of each scheduled sequence, in schedule order."""


class PersistentBatch:
    """Rows of block tables and last sampled tokens, kept on ``device`` across steps.

    :param max_rows: rows to preallocate (the scheduler's ``max_num_seqs``); grows if a
        step schedules more.
    :param max_blocks: block-table columns to preallocate (``ceil(max_model_len /
        block_size)``); grows if a table is longer.
    :param pin: stage host inputs in page-locked memory (platforms that can pin host memory
        and have memory of their own), so the copies do not wait for the device.
    :param shaper: the platform's batch shaper (static-shape devices): each step is then
        padded on the host and uploaded whole (see :mod:`core.batch_shape`).
    """

    def __init__(
        self, max_rows: int, max_blocks: int, block_size: int, device: torch.device, pin: bool,
        shaper: BatchShaper | None = None,
    ):
        self.block_size = block_size
        self.device = device
        self.pin = pin
        self.shaper = shaper
        self._known: list[int] = []  # blocks written per row
        self._first: list[int] = []  # block 0 and the last written block of each row:
        self._last: list[int] = []  # a change there means the table was replaced
        self._sampled = np.zeros(0, dtype=bool)  # _last_tokens[row] is current
        self._row_of: dict[int, int] = {}  # seq id -> row
        self._free: list[int] = []
        self._tables = np.zeros((0, 0), dtype=np.int32)
        self._last_tokens = torch.zeros(0, dtype=torch.int64, device=device)
        self._grow(max_rows, max_blocks)

    @property
    def num_rows(self) -> int:
        return len(self._row_of)

    # ---- rows ---------------------------------------------------------------------------
    def _grow(self, rows: int, blocks: int) -> None:
        """(Re)allocate to at least ``rows`` x ``blocks`` (after start-up: a limit was
        exceeded, which is rare)."""
        old_r, old_b = self._tables.shape
        new_r, new_b = max(rows, old_r), max(blocks, old_b)
        tables = np.zeros((new_r, new_b), dtype=np.int32)
        tables[:old_r, :old_b] = self._tables
        self._tables = tables
        # Where the device is the host, ``to`` returns the host mirror itself: one table.
        host = torch.from_numpy(tables)
        self._tables_dev = host.to(self.device)
        self._shared = self._tables_dev.data_ptr() == host.data_ptr()
        extra = new_r - old_r
        self._known += [0] * extra
        self._first += [0] * extra
        self._last += [0] * extra
        self._sampled = np.concatenate([self._sampled, np.zeros(extra, bool)])
        last = torch.zeros(new_r, dtype=torch.int64, device=self.device)
        last[:old_r] = self._last_tokens
        self._last_tokens = last
        self._free.extend(range(new_r - 1, old_r - 1, -1))

    def _assign_rows(self, seqs: Sequence[ScheduledSequence], preempted: Sequence[int], known: list[int | None]):
        """Rows of ``seqs`` (in order), which of them are new, and the rows freed.
        ``known``: each sequence's row before this step (None: it has none)."""
        if not preempted and len(self._row_of) == len(seqs) and None not in known:
            return known, [False] * len(known), []  # the same sequences as last step
        keep = {s.seq_id for s in seqs}.difference(preempted)
        released = [r for sid, r in self._row_of.items() if sid not in keep]
        self._row_of = {sid: r for sid, r in self._row_of.items() if sid in keep}
        self._free.extend(released)
        self._sampled[released] = False
        if len(seqs) > len(self._row_of) + len(self._free):
            self._grow(len(seqs), self._tables.shape[1])
        rows, fresh = [], []
        for s in seqs:
            row = self._row_of.get(s.seq_id)
            fresh.append(row is None)
            if row is None:
                row = self._row_of[s.seq_id] = self._free.pop()
            rows.append(row)
        return rows, fresh, released

    def _table_changes(self, seqs, rows, fresh, released, width: int):
        """Apply block-table changes to the host mirror; return (rows zeroed, flat indices
        ``row * stride + col`` of the entries written)."""
        if width > self._tables.shape[1]:
            self._grow(self._tables.shape[0], width)
        tables, known, first, last = self._tables, self._known, self._first, self._last
        # Freed rows first: one of them may be reassigned to a new sequence below.
        clear = [r for r in released if known[r]]
        for r in clear:
            tables[r, : known[r]] = 0
            known[r] = 0
        written: list[int] = []
        stride = tables.shape[1]
        for s, row, new in zip(seqs, rows, fresh):
            bt, k = s.block_table, known[row]
            n = len(bt)
            if not new and n == k and (not n or (bt[-1] == last[row] and bt[0] == first[row])):
                continue  # the common decode step: nothing changed
            if k and (new or n < k or bt[0] != first[row] or bt[k - 1] != last[row]):
                clear.append(row)  # replaced (copy-on-write, a shorter table): rewrite it
                tables[row, :k] = 0
                k = 0
            if n > k:
                tables[row, k:n] = bt[k:]
                written.extend(range(row * stride + k, row * stride + n))
            known[row], first[row], last[row] = n, bt[0] if n else 0, bt[-1] if n else 0
        return clear, written

    # ---- one step -----------------------------------------------------------------------
    def prepare(
        self, seqs: Sequence[ScheduledSequence], num_prefills: int, preempted: Sequence[int] = ()
    ) -> StepInputs:
        """The device inputs of a step scheduling ``seqs`` (prefills first)."""
        n = len(seqs)
        qlens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=n)
        starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=n)
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(qlens, out=qsl[1:])
        total = int(qsl[-1])
        ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs), np.int64, total)
        placeholders = bool((ids < 0).any())
        known = [self._row_of.get(s.seq_id) for s in seqs]  # each sequence's row before this step
        if placeholders:  # checked before any row changes, so a refusal leaves no trace
            self._check_placeholders(seqs, preempted, ids, qsl, known, bool((qlens == 1).all()))
        width = max(len(s.block_table) for s in seqs)
        rows, fresh, released = self._assign_rows(seqs, preempted, known)
        clear, written = self._table_changes(seqs, rows, fresh, released, width)
        row_arr = np.asarray(rows, dtype=np.int64)
        self._sampled[row_arr] = False  # until record_sampled says otherwise
        seq_of_token = np.repeat(np.arange(n), qlens)
        positions = starts[seq_of_token] + (np.arange(total) - qsl[seq_of_token])
        token_rows = row_arr[seq_of_token]
        bs = self.block_size
        slots = self._tables[token_rows, positions // bs] * bs + positions % bs
        seq_lens = starts + qlens
        if self.shaper is not None:  # static shapes: pad on the host, upload bucketed tensors
            host = HostStep(ids, positions, slots, token_rows, qlens, starts,
                            self._tables[row_arr], num_prefills)
            ids_d, pos_d, rows_d, md = self.shaper.shape(host).upload(self.device, bs, self._upload)
            if placeholders:
                ids_d = torch.where(ids_d < 0, self._last_tokens[rows_d], ids_d)
            return StepInputs(ids_d, pos_d, md, tuple(rows))
        flat = np.asarray(written, dtype=np.int64)
        clear_arr = np.asarray(clear, dtype=np.int64)
        # Two packed copies, int64 and int32, split again by the views below.
        i64 = self._upload(np.concatenate([ids, positions, slots, token_rows, row_arr, flat, clear_arr]))
        vals = self._tables.reshape(-1)[flat]
        i32 = self._upload(np.concatenate([seq_lens, starts, qsl, vals]).astype(np.int32))
        t, nf = total, len(flat)
        ids_d, pos_d, slots_d = i64[:t], i64[t : 2 * t], i64[2 * t : 3 * t]
        rows_d = i64[4 * t : 4 * t + n]
        if not self._shared:
            if len(clear_arr):
                self._tables_dev.index_fill_(0, i64[4 * t + n + nf :], 0)
            if nf:
                self._tables_dev.view(-1).index_copy_(0, i64[4 * t + n : 4 * t + n + nf], i32[3 * n + 1 :])
        if placeholders:
            ids_d = torch.where(ids_d < 0, self._last_tokens[i64[3 * t : 4 * t]], ids_d)
        md = AttentionMetadata(
            num_prefills=num_prefills,
            num_prefill_tokens=int(qsl[num_prefills]),
            num_decode_tokens=n - num_prefills,
            slot_mapping=slots_d,
            seq_lens=i32[:n],
            context_lens=i32[n : 2 * n],
            query_start_loc=i32[2 * n : 3 * n + 1],
            block_tables=self._tables_dev[:, :width].index_select(0, rows_d),
            max_query_len=int(qlens.max()),
            max_seq_len=int(seq_lens.max()),
            seq_lens_host=tuple(seq_lens.tolist()),
            context_lens_host=tuple(starts.tolist()),
        )
        return StepInputs(ids_d, pos_d, md, tuple(rows))

    def _upload(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if self.pin:
            # The caching host allocator keeps this page-locked block until the copy ran, so
            # the next step's staging never overwrites a copy still in flight.
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def _check_placeholders(
        self, seqs, preempted, ids: np.ndarray, qsl: np.ndarray, known: list[int | None], one_each: bool
    ) -> None:
        # Vectorised over the sequences holding a placeholder: in an asynchronous decode
        # step that is every one of them, each step. ``known``: their rows before this step.
        held = np.flatnonzero(ids < 0)
        if one_each:  # one token per sequence (a decode step): token i is sequence i's
            idx = held
        else:
            idx = np.unique(np.searchsorted(qsl, held, side="right") - 1)
        rows = np.fromiter((-1 if (r := known[i]) is None else r for i in idx.tolist()), np.int64, len(idx))
        ok = (qsl[idx + 1] - qsl[idx] == 1) & (rows >= 0)
        ok &= self._sampled[np.where(rows >= 0, rows, 0)]
        if preempted:
            gone = set(preempted)
            ok &= np.fromiter((seqs[i].seq_id not in gone for i in idx.tolist()), bool, len(idx))
        if ok.all():
            return
        s = seqs[int(idx[np.argmin(ok)])]
        raise ValueError(
            f"sequence {s.seq_id} (request {s.request_id!r}) was scheduled with the "
            f"placeholder token {PLACEHOLDER_TOKEN} in {list(s.token_ids)[:8]}; a "
            "placeholder stands only for the single decode token of a sequence that "
            "sampled in the previous step. Pass the real token id instead."
        )

    def record_sampled(self, rows: Sequence[int], tokens: torch.Tensor) -> None:
        """Keep ``tokens`` [len(rows)] (on the device) as those rows' last sampled tokens."""
        if not rows:
            return
        idx = torch.tensor(rows, dtype=torch.int64)
        self._last_tokens.index_copy_(0, self._upload(idx.numpy()), tokens)
        self._sampled[list(rows)] = True
