"""A launched step: what ``ModelRunner.launch`` / ``Executor.launch`` return.

Asynchronous scheduling splits a step in two: ``launch`` queues the forward pass and the
sampling on the device and starts copying the sampled ids back; ``result()`` waits for that
copy only (never for work queued after it) and builds the step's
:class:`ModelRunnerOutput`. Between the two the host schedules and
launches the next step, whose placeholder inputs read the sampled ids on the device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import torch

from core.outputs import Logprob


class SampledToken(msgspec.Struct, frozen=True, gc=False):
    """One sampled token of a step (a ``msgspec.Struct``: a step builds one per sampled row,
    and a frozen dataclass costs ~9x as much to build)."""

    token_id: int
    logprob: float
    top_logprobs: dict[int, Logprob] | None


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What one step produced, keyed by seq id."""

    sampled: dict[int, SampledToken]
    """Only sequences scheduled with ``sample=True``."""
    prompt_logprobs: dict[int, list[dict[int, Logprob]]]
    """For sequences that asked for prompt logprobs: one entry per prompt position
    computed this step whose next token is a prompt token (position p gives the
    logprobs of prompt token p + 1)."""
    pooled: dict[int, tuple[float, ...]] = field(default_factory=dict)
    """Pooling requests whose prompt finished this step: the pooled vector (core/pooling.py)."""


class StepHandle(ABC):
    """One launched step. ``result()`` may be called once or more; it returns the same
    output each time."""

    @abstractmethod
    def result(self) -> ModelRunnerOutput:
        """Wait for the step's sampled tokens to reach the host and return the output."""


class DoneStep(StepHandle):
    """A step whose output the host already holds (it was read back when launched)."""

    def __init__(self, output: ModelRunnerOutput):
        self._output = output

    def result(self) -> ModelRunnerOutput:
        return self._output


class HostCopy:
    """A device-to-host copy of a step's sampled ids and their logprobs, started at once.

    With ``pinned`` (a device with memory of its own that can page-lock host memory) the
    copy goes into fresh page-locked memory without blocking, and an event recorded right
    after it is what :meth:`values` waits for: work queued later (the next step) does not
    hold the read up. Without it the values stay where they are and :meth:`values` reads
    them with a plain copy (on the host itself: no wait at all).

    :param make_event: builds an event on the device (``None`` where the device has no
        events: :meth:`values` then waits through ``synchronize``).
    """

    def __init__(self, token_ids: torch.Tensor, logprobs: torch.Tensor, pinned: bool,
                 make_event, synchronize):
        # One buffer for both (token ids are exact in float64); a fresh tensor, so the next
        # step's sampler scratch can never overwrite it.
        packed = torch.stack((token_ids.double(), logprobs.double()))
        self._event = None
        self._synchronize = None
        if pinned:
            host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            packed = host
            self._event = make_event() if make_event is not None else None
            if self._event is not None:
                self._event.record()
            else:
                self._synchronize = synchronize
        self._values = packed

    def values(self) -> tuple[list[int], list[float]]:
        if self._event is not None:
            self._event.synchronize()
        elif self._synchronize is not None:
            self._synchronize()
        ids, lps = self._values.tolist()
        return [int(t) for t in ids], lps


class PendingStep(StepHandle):
    """A step whose sampled tokens are still on their way to the host."""

    def __init__(self, seq_ids: Sequence[int], copy: HostCopy,
                 prompt_logprobs: dict[int, list[dict[int, Logprob]]],
                 pooled: dict[int, tuple[float, ...]] | None = None):
        self._seq_ids = seq_ids
        self._copy = copy
        self._prompt_logprobs = prompt_logprobs
        self._pooled = pooled or {}
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            ids, lps = self._copy.values()
            sampled = {s: SampledToken(t, lp, None) for s, t, lp in zip(self._seq_ids, ids, lps)}
            self._output = ModelRunnerOutput(sampled, self._prompt_logprobs, self._pooled)
            self._copy = None  # the host buffer is no longer needed
        return self._output


def device_event_factory(device: torch.device):
    """A function making an event on ``device``'s current stream, or None when this torch
    has no events for the device type (the caller then synchronises instead)."""
    try:
        torch.Event(device=device)
    except (RuntimeError, TypeError, ValueError, AttributeError):
        return None
    return lambda: torch.Event(device=device)
