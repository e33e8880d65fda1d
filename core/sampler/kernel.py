"""The contract of a fused sampling kernel: one call turns a step's logits into tokens.

A platform may supply a :class:`SamplingKernel` (the ``sampling_kernel`` entry of its op
table; the CUDA platform's is ``csrc/sampling``). :meth:`Sampler.draw
<core.sampler.Sampler.draw>` then packs the rows' parameters here, on the host, into three
small tensors that reach the device without waiting for it, and makes one kernel call
instead of the torch pipeline's dozens of launches. Where no kernel is supplied, or it
declines the logits, the torch pipeline runs.

The kernel computes what the torch pipeline computes (same processors, same order, same
cut-off definitions, inverse CDF in vocabulary order from the same uniform number per row),
up to float rounding; see csrc/sampling/sample_row.cuh. A token therefore matches the
torch pipeline's except where a rounding difference moves a cut-off or the draw across a
token boundary: seeded draws are reproducible per platform, and equal across platforms
with overwhelming probability, not by contract.

Packed layout (mirrored by the ``RowF`` / ``RowI`` / ``EditField`` enums of the kernel):

* ``rowf`` [B, 8] float64: temperature (0 = greedy), top_p, min_p, repetition, frequency
  and presence penalties, the row's uniform number, and 1 in every row when some row of
  the call is processed (min_tokens, logit bias or a penalty: the torch pipeline then
  clears NaN and +inf logits of every row; a fused kernel may ignore it).
* ``rowi`` [B, 4] int32: top_k (0 = off), first and end index of the row's edits, and the
  row's slot in the device penalty state (-1: none; :mod:`core.sampler.penalties`).
* ``state``: that table ([slots, ceil4(vocab)] int32, on the logits' device), or an empty
  tensor when no row has a slot. A row with a slot reads its penalties from it, so its edits
  carry only min_tokens and logit bias (no repetition flag, no counts).
* ``edits`` [E, 4] int32: one (row, token) pair a processor changes, rows in order and
  tokens ascending within a row: token, count in the output (presence/frequency), flags
  (1: masked by min_tokens, 2: in the repetition history), logit bias (float32 bits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from core.sampler.processors import check_history, flat_ids, min_tokens_pairs
from core.sampler.rows import SampleRow, Staging

TEMPERATURE, TOP_P, MIN_P, REPETITION, FREQUENCY, PRESENCE, UNIFORM, PROCESSED = range(8)
ROW_F = 8
TOP_K, EDIT_BEGIN, EDIT_END, PENALTY_ROW = range(4)
ROW_I = 4
EDIT_FIELDS = 4
EDIT_MASK, EDIT_REPEAT = 1, 2


@dataclass(frozen=True)
class KernelInputs:
    """One call's packed parameters (see the module docstring for the layout)."""

    rowf: torch.Tensor
    rowi: torch.Tensor
    edits: torch.Tensor
    state: torch.Tensor = field(default_factory=lambda: torch.zeros((0, 4), dtype=torch.int32))
    """The device penalty state (already on the device), or empty."""

    def to(self, device: torch.device, stage: Staging) -> KernelInputs:
        """The same inputs on ``device``, copied the way ``stage`` copies (no wait with
        pinned staging); the state is on the device already."""
        moved = (stage(t, t.dtype, device) for t in (self.rowf, self.rowi, self.edits))
        state = self.state if self.state.numel() else torch.empty((0, 4), dtype=torch.int32, device=device)
        return KernelInputs(*moved, state)


class SamplingKernel(Protocol):
    """A platform's fused sampler. A kernel with a true ``reads_penalty_state`` attribute
    reads ``inputs.state``; for any other the sampler lists the penalties as edits."""

    def accepts(self, logits: torch.Tensor) -> bool:
        """Whether this kernel runs on these (checked float32 [B, V]) logits; decided
        from their device, dtype and shape only (no device read)."""

    def __call__(
        self, logits: torch.Tensor, inputs: KernelInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [B] int64, raw logprobs of the tokens [B] float32, logsumexp of each
        raw row [B] float32), on the logits' device, queued without waiting for it."""


class NoKernel:
    """The default op: no fused kernel, the torch pipeline samples."""

    def accepts(self, logits: torch.Tensor) -> bool:
        return False

    def __call__(self, logits: torch.Tensor, inputs: KernelInputs):
        raise RuntimeError("NoKernel accepts no logits; the sampler runs its torch pipeline")


NO_KERNEL = NoKernel()


def pack(
    rows: Sequence[SampleRow],
    vocab: int,
    eos: frozenset[int],
    uniforms: dict[int, float],
    slots: Sequence[int] | None = None,
    state: torch.Tensor | None = None,
) -> KernelInputs:
    """Host tensors for one call. ``uniforms``: row index -> its uniform number, for the
    rows that are not greedy. ``slots``/``state``: each row's slot in the device penalty
    state (-1: none) and its table; None: penalties as host-built edits."""
    n = len(rows)
    rowf = np.zeros((n, ROW_F), dtype=np.float64)
    rowi = np.zeros((n, ROW_I), dtype=np.int32)
    rowi[:, PENALTY_ROW] = -1 if slots is None else slots
    if n:
        # One array conversion of every row's cached fields: a per-row numpy assignment
        # costs ~1 us a row.
        values = np.array([r.params.kernel_fields for r in rows], dtype=np.float64)  # [n, 7]
        rowf[:, :UNIFORM] = values[:, :-1]
        top_k = values[:, -1]
        rowi[:, TOP_K] = np.where((top_k > 0) & (top_k < vocab), top_k, 0)
    if uniforms:
        rowf[list(uniforms), UNIFORM] = list(uniforms.values())
    # Only rows whose params change logits can be processed or carry edits (most carry none).
    if any(r.params.changes_logits for r in rows):
        if any(r.params.logit_bias or r.params.needs_token_history or r.output_index < r.params.min_tokens
               for r in rows):
            rowf[:, PROCESSED] = 1.0
        edits, begin, end = edit_list(rows, vocab, eos, slots)
        rowi[:, EDIT_BEGIN], rowi[:, EDIT_END] = begin, end
    else:
        edits = np.zeros((0, EDIT_FIELDS), dtype=np.int32)
    host = (torch.from_numpy(rowf), torch.from_numpy(rowi), torch.from_numpy(edits))
    if slots is None or state is None:
        return KernelInputs(*host)
    return KernelInputs(*host, state)


def edit_list(
    rows: Sequence[SampleRow], vocab: int, eos: frozenset[int], slots: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(edits [E, 4] int32, first edit of each row, end of each row's edits): the union of
    the (row, token) pairs that min_tokens, logit_bias and the penalties touch; the
    penalties only of rows without a penalty-state slot (``slots``)."""
    check_history(rows, slots)
    on_host = (lambda i: True) if slots is None else (lambda i: slots[i] < 0)
    parts: dict[str, np.ndarray] = {}
    mask = [i for i, r in enumerate(rows) if r.output_index < r.params.min_tokens]
    if mask:
        r, c = min_tokens_pairs(rows, mask, eos, vocab)
        parts["mask"] = r * vocab + c
    bias_rows = [i for i, r in enumerate(rows) if r.params.logit_bias]
    bias_vals = np.asarray(
        [v for i in bias_rows for v in rows[i].params.logit_bias.values()], dtype=np.float32
    )
    if bias_rows:
        r, c = flat_ids(rows, bias_rows, lambda row: list(row.params.logit_bias), vocab, "logit_bias")
        parts["bias"] = r * vocab + c
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0 and on_host(i)]
    if rep:
        r, c = flat_ids(rows, rep, lambda row: [*row.prompt_token_ids, *row.output_token_ids],
                        vocab, "token history")
        parts["rep"] = r * vocab + c
    pf = [
        i for i, r in enumerate(rows)
        if (r.params.presence_penalty or r.params.frequency_penalty) and r.output_token_ids
        and on_host(i)
    ]
    if pf:
        r, c = flat_ids(rows, pf, lambda row: row.output_token_ids, vocab, "output token history")
        parts["count"] = r * vocab + c
    if not parts:
        empty = np.zeros(len(rows), dtype=np.int32)
        return np.zeros((0, EDIT_FIELDS), dtype=np.int32), empty, empty
    keys, inverse = np.unique(np.concatenate(list(parts.values())), return_inverse=True)
    slices, start = {}, 0
    for name, k in parts.items():
        slices[name] = inverse[start:start + len(k)]
        start += len(k)
    edits = np.zeros((len(keys), EDIT_FIELDS), dtype=np.int32)
    edits[:, 0] = keys % vocab
    if "count" in slices:
        edits[:, 1] = np.bincount(slices["count"], minlength=len(keys))
    flags = np.zeros(len(keys), dtype=np.int32)
    if "mask" in slices:
        flags[slices["mask"]] |= EDIT_MASK
    if "rep" in slices:
        flags[slices["rep"]] |= EDIT_REPEAT
    edits[:, 2] = flags
    if "bias" in slices:
        bias = np.zeros(len(keys), dtype=np.float32)
        np.add.at(bias, slices["bias"], bias_vals)
        edits[:, 3] = bias.view(np.int32)
    row_of = keys // vocab
    idx = np.arange(len(rows))
    begin = np.searchsorted(row_of, idx, side="left").astype(np.int32)
    end = np.searchsorted(row_of, idx, side="right").astype(np.int32)
    return edits, begin, end
