"""The sampler's narrow view of a step: the row type it reads, and the per-row parameters of
one call as host lists (for host decisions) and device tensors (for the arithmetic)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from core.sampling_params import SamplingParams


class SampleRow(Protocol):
    """What the sampler reads of one row (``core.scheduler.ScheduledSequence`` is one)."""

    seq_id: int
    """Identifies the sequence across steps (the device penalty state is kept per id)."""
    request_id: str
    params: SamplingParams
    output_index: int
    """Tokens generated so far: seeds the row's draw and gates ``min_tokens``."""
    prompt_token_ids: Sequence[int]
    """Needed by the repetition penalty (and prompt logprobs)."""
    output_token_ids: Sequence[int]
    """Needed by every penalty: ``len == output_index`` on the host-built path; with the
    device penalty state (:mod:`core.sampler.penalties`) only when a sequence joins it."""


@dataclass(frozen=True)
class Staging:
    """How host values reach the logits' device.

    :param pinned: through page-locked memory and a non-blocking copy (a blocking copy first
        waits for everything queued on the device). The caching host allocator keeps each
        pinned block until its copy is done. False: a plain copy (no-op on the host).
    """

    pinned: bool = False

    def __call__(self, values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        t = t.to(dtype)
        if self.pinned:
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row parameters of one call. Which rows are greedy and which optional stages run
    are decided from the host lists, never from device reads; the tensors are built on the
    device once per call, on first use."""

    greedy_rows: list[int]
    random_rows: list[int]
    temperatures: list[float]  # 1 for greedy rows (never used for them)
    top_k: list[int]  # 0 = off
    top_p: list[float]  # 1 = off
    min_p: list[float]  # 0 = off
    scaled: bool  # some row's temperature is not 1
    needs_processing: bool  # any min_tokens mask, logit bias or penalty this call
    device: torch.device
    stage: Staging
    slots: list[int] | None = None
    """Penalty-state slot of each row (-1: none), or None: penalties from the host history."""
    _tensors: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def build(
        rows: Sequence[SampleRow],
        vocab_size: int,
        device: torch.device,
        stage: Staging,
        slots: list[int] | None = None,
    ) -> SamplingBatch:
        ps = [r.params for r in rows]
        greedy = [p.greedy for p in ps]
        temps = [1.0 if g else p.temperature for g, p in zip(greedy, ps)]
        processing = any(
            p.logit_bias or p.needs_token_history or r.output_index < p.min_tokens
            for r, p in zip(rows, ps)
        )
        return SamplingBatch(
            greedy_rows=[i for i, g in enumerate(greedy) if g],
            random_rows=[i for i, g in enumerate(greedy) if not g],
            temperatures=temps,
            top_k=[p.top_k if 0 < p.top_k < vocab_size else 0 for p in ps],
            top_p=[p.top_p for p in ps],
            min_p=[p.min_p for p in ps],
            scaled=any(t != 1.0 for t in temps),
            needs_processing=processing,
            device=device,
            stage=stage,
            slots=slots,
        )

    def tensor(self, name: str, values, dtype: torch.dtype) -> torch.Tensor:
        """``values`` on the device, staged once per call under ``name``."""
        t = self._tensors.get(name)
        if t is None:
            t = self._tensors[name] = self.stage(values, dtype, self.device)
        return t

    def temperature(self) -> torch.Tensor:
        """[B] float32 on the device."""
        return self.tensor("temperature", self.temperatures, torch.float32)

    def index(self, rows: list[int]) -> torch.Tensor:
        return self.stage(rows, torch.int64, self.device)


class Scratch:
    """Buffers reused across calls, by role name.

    On CPU a fresh [256, 128k] float32 tensor costs more in page faults (~50 ms) than the
    arithmetic done in it (~7 ms for a subtraction), and the allocator returns such blocks
    to the OS each time; reusing them removes that cost. Roles and lifetimes in one call:
    ``exp`` (logsumexp temporary, then the sampling weights), ``work`` (scaled logits, then
    the logprob rows), ``rows`` (the random rows of ``work``), ``sub`` (row subsets inside
    the filters), ``mask`` (comparison masks). No buffer escapes a call.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(
        self,
        name: str,
        shape: tuple[int, ...],
        like: torch.Tensor,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        dtype = dtype or like.dtype
        n = 1
        for d in shape:
            n *= d
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != like.device:
            buf = torch.empty(n, dtype=dtype, device=like.device)
            self._bufs[name] = buf
        return buf[:n].view(shape)

    def rows(self, name: str, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x[idx]: x itself when idx is every row, else a copy into buffer ``name``."""
        if len(idx) == x.shape[0]:
            return x
        return torch.index_select(x, 0, idx, out=self.get(name, (len(idx), x.shape[1]), x))
