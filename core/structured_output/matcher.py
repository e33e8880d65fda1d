"""Per-sequence grammar state: which tokens may come next, and the tokens taken so far.

One :class:`GrammarMatcher` per sequence (``n > 1``: one per choice, each independent).
Each step the runner fills one bitmask row per constrained sequence (:func:`fill_bitmasks`,
all rows in parallel off the GIL), the sampler applies the rows to the logits
(:mod:`core.structured_output.bitmask`), and the sampled token is passed to
:meth:`GrammarMatcher.accept`. Rollback undoes accepted tokens (speculative drafts, or a
step whose tokens the scheduler discards).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core.structured_output.compiler import CompiledGrammar, GrammarCompiler


class GrammarMatcher:
    """Matches one sequence's output against a compiled grammar."""

    def __init__(self, compiled: CompiledGrammar):
        self.compiled = compiled
        self._m = compiled.new_llmatcher()

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token. False when the grammar did not allow it (a bug
        upstream: the mask forbade it); the matcher is then in error and stays there."""
        return bool(self._m.consume_token(int(token_id)))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens and not self._m.rollback(int(num_tokens)):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._m.get_error()}")

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete: only an end-of-sequence token may follow (or one did)."""
        return bool(self._m.is_stopped())

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (it may still go on)."""
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    def reset(self) -> None:
        """Back to the start (a preempted sequence that is recomputed from its prompt)."""
        self._m.reset()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (a host int32 tensor from
        :func:`~core.structured_output.bitmask.allocate_bitmask`)."""
        _check_bitmask(bitmask, self.compiled.vocab_size)
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"bitmask row {row} out of range for {bitmask.shape[0]} rows")
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)


def fill_bitmasks(
    compiler: GrammarCompiler, matchers: Sequence[GrammarMatcher], rows: Sequence[int], bitmask: torch.Tensor
) -> None:
    """Fill ``bitmask[rows[i]]`` for ``matchers[i]``, all at once on the compiler's threads."""
    _check_bitmask(bitmask, compiler.vocab_size)
    if len(matchers) != len(rows):
        raise ValueError(f"{len(matchers)} matchers for {len(rows)} bitmask rows")
    if rows and not 0 <= min(rows) <= max(rows) < bitmask.shape[0]:
        raise IndexError(f"bitmask rows {min(rows)}..{max(rows)} out of range for {bitmask.shape[0]} rows")
    pairs = [(m._m, int(r)) for m, r in zip(matchers, rows)]
    if not pairs:  # the library refuses an empty batch
        return
    compiler.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


def _check_bitmask(bitmask: torch.Tensor, vocab_size: int) -> None:
    words = (vocab_size + 31) // 32
    if bitmask.dtype != torch.int32 or not bitmask.is_cpu or not bitmask.is_contiguous():
        raise ValueError(
            f"the bitmask must be a contiguous int32 host tensor (got {bitmask.dtype} on {bitmask.device}); "
            f"use allocate_bitmask()"
        )
    if bitmask.dim() != 2 or bitmask.shape[1] != words:
        raise ValueError(
            f"bitmask shape {tuple(bitmask.shape)} does not fit vocab_size {vocab_size}: "
            f"need (rows, {words})"
        )
