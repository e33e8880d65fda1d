"""Penalty state on the device: what the repetition / presence / frequency penalties read,
kept per sequence and updated from the sampled ids without any host work per step.

The host-built path (:func:`core.sampler.processors.apply_penalties`, and the fused
kernel's edit list in :mod:`core.sampler.kernel`) lists every row's (row, token) history
pairs and deduplicates them with ``np.unique`` each step: host work and a host-to-device
copy that grow with the tokens generated so far (13.9 ms per step at batch 256 x 128,256 on
the H200). :class:`PenaltyState` keeps instead, for each sequence that uses a penalty, one
int32 word per vocabulary entry in a device table (a *slot* per sequence):

* bits 0..29 (:data:`COUNT_MASK`): how often the token occurs in the sequence's output
  (presence / frequency penalties);
* bit 30 (:data:`PROMPT_BIT`): the token occurs in the prompt. A nonzero word means the
  token was seen in the prompt or the output (the repetition penalty, HF's definition).

Lifecycle (the model runner's persistent batch keeps rows by the same rule):

* a slot is taken the first time a sequence with penalties is sampled, and filled from the
  host history the schedule carries (prompt ids, and the output ids already generated:
  after a preemption or a pause, recompute or swap alike). That is the only host work,
  once per admission, and it requires the history to be complete
  (``len(output_token_ids) == output_index``): the scheduler re-admits a sequence only once
  its in-flight token is known. A scheduler told that the runner keeps this state
  (``Scheduler(penalty_state=True)``, from the executor's start-up report) sends the history
  on that step only, by the same rules as :meth:`PenaltyState.begin_step` and
  :meth:`PenaltyState.slots`: a sequence's first sampled row since it was last missing from
  a step or preempted (a non-sampled prefill chunk takes no slot);
* each step, after the draw, the sampled token of every row with a slot is counted on the
  device (:meth:`PenaltyState.record`), *exactly once*: the token that an asynchronous step
  feeds back as a placeholder was counted when it was sampled, and a padded copy of a row
  (static-shape buckets) is not counted again;
* :meth:`PenaltyState.begin_step` frees the slots of sequences that are not in a step or
  were preempted in it (finished, aborted, paused); a freed slot is zeroed when it is
  taken again. Slots follow sequence ids, not persistent-batch rows, so rows that move or
  are reassigned in the persistent batch need nothing here.

Memory: ``4 * ceil4(vocab)`` bytes per slot, slots only for sequences that use penalties
(the table grows by doubling to the peak number of them, and is not allocated at all when
no request uses penalties): 131 MB for 256 such sequences at a 128,256-token vocabulary. A
device that cannot hold it refuses with a message naming the sizes.

Applying the penalties reads the state densely: the torch pipeline with a few elementwise
ops over [penalised rows, vocab] (:func:`apply_dense`, the same float operations as the
host-built path, so the same logits bit for bit); the fused CUDA kernel by reading each
penalised row's words next to its logits (``rowi[:, PENALTY_ROW]``, csrc/sampling).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from core.sampler.processors import flat_ids, history_filled
from core.sampler.rows import SampleRow, SamplingBatch, Staging

COUNT_MASK = (1 << 30) - 1
"""Bits of a state word that count the token in the output (mirrors kStateCount)."""
PROMPT_BIT = 1 << 30
"""The token occurs in the prompt."""


class PenaltyState:
    """Penalty state of the sequences that use penalties (see the module docstring).

    :param vocab: columns the sampler sees (the logits' width after any LM-head padding is
        cut); the table's rows are ``vocab`` rounded up to a multiple of 4 (16-byte rows).
    :param device: where the table lives (the logits' device).
    :param stage: how host index lists reach the device.
    """

    def __init__(self, vocab: int, device: torch.device, stage: Staging):
        self.vocab = vocab
        self.width = -(-vocab // 4) * 4
        self.device = device
        self.stage = stage
        self.table = torch.zeros((0, self.width), dtype=torch.int32, device=device)
        self._slot_of: dict[int, int] = {}  # seq id -> slot
        self._free: list[int] = []

    @property
    def num_slots(self) -> int:
        """Sequences holding a slot now."""
        return len(self._slot_of)

    def holds(self, seq_id: int) -> bool:
        """Whether the sequence holds a slot now (its next sampled row reads no history)."""
        return seq_id in self._slot_of

    def begin_step(self, seq_ids: Iterable[int], preempted: Sequence[int] = ()) -> None:
        """Frees the slots of sequences that are not in this step's schedule ``seq_ids`` or
        are in ``preempted``. O(sequences with slots), no device work."""
        if not self._slot_of:
            return
        keep = set(seq_ids).difference(preempted)
        gone = [sid for sid in self._slot_of if sid not in keep]
        for sid in gone:
            self._free.append(self._slot_of.pop(sid))

    def slots(self, rows: Sequence[SampleRow]) -> list[int]:
        """The slot of each row (-1: the row uses no penalty), admitting the sequences seen
        for the first time: their slots are zeroed and filled from the rows' history.

        :raises ValueError: a new row's history is incomplete or holds an id outside the
            vocabulary.
        """
        out, fresh = [], []
        for i, r in enumerate(rows):
            if not r.params.needs_token_history:
                out.append(-1)
                continue
            slot = self._slot_of.get(r.seq_id)
            if slot is None:
                check_admission(r, i)
                slot = self._take(r.seq_id)
                fresh.append((i, slot))
            out.append(slot)
        if fresh:
            self._admit(rows, fresh)
        return out

    def _take(self, seq_id: int) -> int:
        if not self._free:
            self._grow(max(8, 2 * self.table.shape[0]))
        slot = self._slot_of[seq_id] = self._free.pop()
        return slot

    def _grow(self, rows: int) -> None:
        old = self.table.shape[0]
        try:
            table = torch.zeros((rows, self.width), dtype=torch.int32, device=self.device)
        except torch.OutOfMemoryError as e:
            need = rows * self.width * 4
            raise RuntimeError(
                f"the penalty state for {rows} sequences x {self.vocab} tokens needs "
                f"{need / 2**20:.0f} MiB of device memory (4 bytes per token per sequence with "
                "a repetition/presence/frequency penalty), and the device is out of memory; "
                "run fewer penalised requests at once (lower --max-num-seqs) or leave more "
                "memory outside the KV cache (lower --gpu-memory-utilization)"
            ) from e
        table[:old] = self.table
        self.table = table
        self._free.extend(range(rows - 1, old - 1, -1))

    def _admit(self, rows: Sequence[SampleRow], fresh: list[tuple[int, int]]) -> None:
        """Zero the new slots, then mark their prompt ids and count their output ids."""
        picks = [i for i, _ in fresh]
        slot_of_row = dict(fresh)
        flat = self.table.view(-1)
        dev, w = self.device, self.width
        self.table.index_fill_(0, self.stage([s for _, s in fresh], torch.int64, dev), 0)
        r, c = flat_ids(rows, picks, lambda row: row.prompt_token_ids, self.vocab, "prompt")
        if len(r):
            slots = np.fromiter((slot_of_row[int(i)] for i in r), np.int64, len(r))
            flat.index_fill_(0, self.stage(slots * w + c, torch.int64, dev), PROMPT_BIT)
        r, c = flat_ids(rows, picks, lambda row: row.output_token_ids, self.vocab,
                        "output token history")
        if len(r):
            slots = np.fromiter((slot_of_row[int(i)] for i in r), np.int64, len(r))
            idx = self.stage(slots * w + c, torch.int64, dev)
            flat.index_add_(0, idx, torch.ones(len(r), dtype=torch.int32, device=dev))

    def record(self, slots: Sequence[int], rows: Sequence[SampleRow], tokens: torch.Tensor) -> None:
        """Count each row's sampled token (``tokens`` [len(rows)] on the device) in its
        slot: the first row of each sequence only (padded copies share its slot)."""
        seen: set[int] = set()
        picks, picked_slots = [], []
        for i, (slot, r) in enumerate(zip(slots, rows)):
            if slot >= 0 and r.seq_id not in seen:
                seen.add(r.seq_id)
                picks.append(i)
                picked_slots.append(slot)
        if not picks:
            return
        dev = self.device
        tok = tokens if len(picks) == len(tokens) else tokens.index_select(
            0, self.stage(picks, torch.int64, tokens.device))
        idx = self.stage(picked_slots, torch.int64, dev) * self.width + tok.to(dev)
        self.table.view(-1).index_add_(0, idx, torch.ones(len(picks), dtype=torch.int32, device=dev))


def check_admission(row: SampleRow, i: int) -> None:
    """A sequence's state is built from its history once: the history must be complete."""
    if not history_filled(row):
        raise ValueError(
            f"row {i} (request {row.request_id!r}, sequence {row.seq_id}) uses penalties and is "
            f"new to the penalty state, but carries {len(row.prompt_token_ids)} prompt ids and "
            f"{len(row.output_token_ids)} output ids for output_index {row.output_index}; a "
            "sequence joins with its whole history (the scheduler admits it once its in-flight "
            "token is known), and prompt_token_ids / output_token_ids must be filled when "
            "params.needs_token_history"
        )


def apply_dense(
    work: torch.Tensor,
    rows: Sequence[SampleRow],
    slots: Sequence[int],
    table: torch.Tensor,
    inv_t: torch.Tensor,
    batch: SamplingBatch,
) -> None:
    """The penalties of :func:`core.sampler.processors.apply_penalties` from the state
    ``table``: repetition on the seen tokens, then ``-= (frequency * count + presence) *
    inv_t`` on the tokens in the output, in place on the rows of ``work`` (scaled logits)
    with a slot; the same float operations, so the same values bit for bit. Other rows are
    not touched."""
    pen = [i for i, s in enumerate(slots) if s >= 0]
    if not pen:
        return
    vocab, dev = work.shape[1], work.device
    ps = [rows[i].params for i in pen]
    rep_on = [p.repetition_penalty != 1.0 for p in ps]
    pf_on = [bool(p.presence_penalty or p.frequency_penalty) for p in ps]
    whole = len(pen) == work.shape[0]
    idx = None if whole else batch.index(pen)
    st = table.index_select(0, batch.stage([slots[i] for i in pen], torch.int64, table.device))
    st = st[:, :vocab].to(dev)
    g = work if whole else work.index_select(0, idx)
    if any(rep_on):
        penalty = _per_row(rows, "repetition_penalty", batch)
        penalty = (penalty if whole else penalty[idx])[:, None]
        hit = st != 0
        if not all(rep_on):
            hit &= batch.stage(rep_on, torch.bool, dev)[:, None]
        g = torch.where(hit, torch.where(g > 0, g / penalty, g * penalty), g)
    if any(pf_on):
        count = st & COUNT_MASK
        hit = count > 0
        if not all(pf_on):
            hit &= batch.stage(pf_on, torch.bool, dev)[:, None]
        freq = _per_row(rows, "frequency_penalty", batch)
        pres = _per_row(rows, "presence_penalty", batch)
        scale = inv_t if whole else inv_t[idx]
        if not whole:
            freq, pres = freq[idx], pres[idx]
        amount = (freq[:, None] * count + pres[:, None]) * scale[:, None]
        g = torch.where(hit, g - amount, g)
    if whole:
        if g is not work:
            work.copy_(g)
    else:
        work.index_copy_(0, idx, g)


def _per_row(rows: Sequence[SampleRow], name: str, batch: SamplingBatch) -> torch.Tensor:
    return batch.tensor(name, [float(getattr(r.params, name)) for r in rows], torch.float32)
