"""The token bitmask and its application to logits, for every platform.

Layout (llguidance's and xgrammar's): int32 ``[rows, ceil(vocab / 32)]``, token ``t``
allowed when bit ``t % 32`` of word ``t // 32`` is set. Masks are filled on the host; the
sampler copies the rows to the logits' device and calls :func:`apply_bitmask` there: one
unpack of all rows and one ``masked_fill``, no per-row host loop and no device sync. The
unpack reads the words as little-endian bytes (every device torch runs on is little-endian),
so the temporary is one byte per token rather than four.

:func:`apply_bitmask_compiled` runs llguidance's ``torch.compile`` kernel instead (the same
unpack and fill, fused): 30x faster than the eager ops on a CPU (docs/benchmarks/
structured_output.md), but it needs a working ``torch.compile`` backend for the device (a C++
compiler on CPU, Triton on CUDA/ROCm) and compiles for seconds on first use, so the engine
does not use it. :func:`apply_bitmask_host` is the fallback for a device that cannot run
these ops at all: the constrained rows go to the host, are masked there, and come back. All
of them take the same arguments and give the same result.

Which one the engine uses is the platform's choice, not a check at run time: the op table's
``grammar_bitmask`` entry (:data:`core.ops.DEFAULT_OPS`, overridden by
``Platform.ops()`` or a plugin's ``core_op_overrides``). The default,
:func:`apply_bitmask_default`, masks on the logits' device (numpy for logits in host
memory); a platform whose device cannot run the unpack ops supplies
:func:`apply_bitmask_host`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from core.platform import in_host_memory

BitmaskOp = Callable[[torch.Tensor, torch.Tensor, "Sequence[int] | torch.Tensor | None"], None]
"""``(logits, bitmask, rows) -> None``: every ``apply_bitmask*`` function (in place)."""


def allocate_bitmask(rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """A host bitmask with every token allowed (``pin_memory`` for a non-blocking copy)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin_memory)


def _rows_index(rows: Sequence[int] | torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    if rows is None:
        return None
    if isinstance(rows, torch.Tensor):
        return rows.to(device=device, dtype=torch.long, non_blocking=True)
    return torch.tensor(list(rows), dtype=torch.long).to(device, non_blocking=True)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[rows, vocab_size]``: True where the token is allowed."""
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [rows, words * 4], little-endian
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)
    bits = (as_bytes.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None
) -> None:
    """Set forbidden tokens' logits to ``-inf``, in place, on the logits' device.

    :param logits: ``[batch, vocab]`` float logits (vocab may exceed the bitmask's bits:
        tokens past them are forbidden; fewer is an error).
    :param bitmask: ``[len(rows), words]`` int32, on any device (moved to the logits').
    :param rows: logits row of each bitmask row; None means bitmask row i masks logits row i
        and the batch sizes must match.
    """
    batch, vocab = logits.shape
    n = _check(bitmask, batch, rows)
    bits = bitmask.shape[1] * 32
    if n == 0:
        return
    forbidden = ~unpack_bitmask(bitmask.to(logits.device, non_blocking=True), min(vocab, bits))
    if bits < vocab:  # model vocabulary past the mask (padding ids): never allowed
        pad = torch.ones(n, vocab - bits, dtype=torch.bool, device=logits.device)
        forbidden = torch.cat([forbidden, pad], dim=1)
    index = _rows_index(rows, logits.device)
    if index is None:
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        logits[index] = logits[index].masked_fill(forbidden, float("-inf"))


def apply_bitmask_compiled(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None
) -> None:
    """:func:`apply_bitmask` through llguidance's compiled kernel (see the module docstring)."""
    from llguidance.torch import apply_token_bitmask_inplace

    n = _check(bitmask, logits.shape[0], rows)
    if n == 0:
        return
    mask = bitmask.to(logits.device, non_blocking=True)
    index = _rows_index(rows, logits.device)
    if index is None:
        apply_token_bitmask_inplace(logits, mask)
        return
    part = logits[index]
    apply_token_bitmask_inplace(part, mask)
    logits[index] = part


def _check(bitmask: torch.Tensor, batch: int, rows: Sequence[int] | torch.Tensor | None) -> int:
    """The number of bitmask rows, after checking the bitmask against the logits."""
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} {tuple(bitmask.shape)}")
    n = bitmask.shape[0]
    if (rows is None and n != batch) or (rows is not None and len(rows) != n):
        got = batch if rows is None else len(rows)
        raise ValueError(f"bitmask has {n} rows for {got} logits rows; pass rows= (one logits row per bitmask row)")
    return n


def apply_bitmask_numpy(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None
) -> None:
    """:func:`apply_bitmask` for logits in host memory, in place through numpy on this
    thread. At one row of a 49k vocabulary torch's CPU ops hand the work to their thread
    pool and, on a busy host, wait milliseconds for it; numpy's unpack and ``putmask`` run
    here in a fraction of that (docs/benchmarks/structured_output.md)."""
    batch, vocab = logits.shape
    n = _check(bitmask, batch, rows)
    if n == 0:
        return
    if not in_host_memory(logits):
        raise ValueError(f"apply_bitmask_numpy needs logits in host memory, not on {logits.device}")
    arr = logits.detach().numpy()  # shares the tensor's memory (strided views too)
    allowed = np.zeros((n, vocab), dtype=bool)
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
    width = min(vocab, bits.shape[1])
    allowed[:, :width] = bits[:, :width]
    if rows is None:
        np.putmask(arr, ~allowed, -np.inf)
        return
    index = np.asarray(rows.tolist() if isinstance(rows, torch.Tensor) else list(rows), dtype=np.int64)
    arr[index] = np.where(allowed, arr[index], -np.inf)


def apply_bitmask_host(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None
) -> None:
    """:func:`apply_bitmask` for devices that cannot run its ops: same arguments and result.

    The constrained rows are gathered to the host, masked there with numpy's bit unpacking,
    and scattered back: one copy each way, and the device only indexes and copies.
    """
    batch, vocab = logits.shape
    n = _check(bitmask, batch, rows)
    if n == 0:
        return
    index = None if rows is None else _rows_index(rows, logits.device)
    part = (logits if index is None else logits[index]).to("cpu", copy=True)
    words = bitmask.to("cpu").contiguous().numpy().view(np.uint8)
    allowed = np.unpackbits(words, axis=1, bitorder="little")[:, :vocab].astype(bool)
    forbidden = np.ones((n, vocab), dtype=bool)
    forbidden[:, : allowed.shape[1]] = ~allowed
    part.masked_fill_(torch.from_numpy(forbidden), float("-inf"))
    if index is None:
        logits.copy_(part)
    else:
        logits[index] = part.to(logits.device)


def apply_bitmask_default(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None
) -> None:
    """The default ``grammar_bitmask`` op: :func:`apply_bitmask` on the logits' device, or
    :func:`apply_bitmask_numpy` for float32/float64 logits in host memory (faster there)."""
    if in_host_memory(logits) and logits.dtype in (torch.float32, torch.float64):
        apply_bitmask_numpy(logits, bitmask, rows)
    else:
        apply_bitmask(logits, bitmask, rows)


# ---- one step's masks, from the engine core to the sampler -------------------------------------
@dataclass(frozen=True)
class StepBitmask:
    """The grammar masks of one step, filled on the host by the engine core and carried to
    the runner in the :class:`~core.scheduler.SchedulerOutput` (pickled to workers as is)."""

    seq_ids: tuple[int, ...]
    """The sequence of each bitmask row; each is scheduled with ``sample=True`` this step."""
    bitmask: torch.Tensor
    """``[len(seq_ids), ceil(vocab / 32)]`` int32, on the host."""

    def for_rows(self, row_seq_ids: Sequence[int], apply: BitmaskOp = apply_bitmask_default) -> RowBitmask:
        """The masks addressed to the sampler's rows (``row_seq_ids[i]`` is row i's sequence),
        to be applied with ``apply`` (the platform's ``grammar_bitmask`` op).

        :raises ValueError: a masked sequence is not among the rows (a runner bug).
        """
        where = {s: i for i, s in enumerate(row_seq_ids)}
        missing = [s for s in self.seq_ids if s not in where]
        if missing:
            raise ValueError(f"grammar masks for sequences {missing[:5]} that this step does not sample")
        return RowBitmask(self.bitmask, tuple(where[s] for s in self.seq_ids), apply)


@dataclass(frozen=True)
class RowBitmask:
    """Bitmask rows and the logits row each one masks: the sampler's first stage."""

    bitmask: torch.Tensor
    rows: tuple[int, ...]
    op: BitmaskOp = apply_bitmask_default
    """The platform's ``grammar_bitmask`` op (see the module docstring)."""

    def apply(self, logits: torch.Tensor) -> None:
        """Forbidden tokens of the masked rows to ``-inf``, in place, with :attr:`op`."""
        if not self.rows:
            return
        rows = None if self.rows == tuple(range(logits.shape[0])) else list(self.rows)
        self.op(logits, self.bitmask, rows)
