"""Requests and the sequences the scheduler moves between queues.

A :class:`Request` is what a user submitted; it owns one :class:`Sequence` per sample.
With ``n > 1`` the request starts with a single sequence that computes the prompt except
its last token, then forks into ``n`` sequences that share those KV blocks (reference
counts) and each compute the last prompt token and sample on their own.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from dataclasses import dataclass, field

from core.sampling_params import SamplingParams

_seq_ids = itertools.count()

PLACEHOLDER_TOKEN = -1
"""A scheduled input id that is not known on the host yet: the token the previous step
sampled for this sequence, which the model runner reads on the device (asynchronous
scheduling; see :mod:`core.input_batch`)."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        """OpenAI finish_reason: stop | length | abort (None while unfinished)."""
        return self.value if self.finished else None


@dataclass
class Sequence:
    """One token stream. Mutated only by the scheduler (``schedule`` and ``update``)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    index: int = 0
    """Which of the request's n samples this is."""
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Positions whose KV is in the cache or being written by a launched step (reset to 0
    when preempted by recompute). With a token in flight it may exceed ``num_tokens``."""
    num_pending: int = 0
    """Tokens sampled by launched steps whose ids the host does not know yet (0 or 1 when
    a step is scheduled; up to 2 between scheduling step N+1 and updating with step N).
    They follow ``output_token_ids``; ``num_tokens`` does not count them."""
    status: SequenceStatus = SequenceStatus.WAITING
    stop_reason: int | str | None = None
    """The stop token id or stop string that finished the sequence, if any."""
    cumulative_logprob: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_id(self, pos: int) -> int:
        """Token at absolute position ``pos`` (prompt then output)."""
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < p else self.output_token_ids[pos - p]

    def token_ids_from(self, start: int, end: int) -> tuple[int, ...]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return tuple(self.output_token_ids[start - p : end - p])
        return self.prompt_token_ids[start:] + tuple(self.output_token_ids[: end - p])

    def fork(self, index: int) -> Sequence:
        """A sibling sample: same prompt and computed prefix, fresh id, own outputs.

        A seeded request gives sample ``index`` the seed ``seed + index`` so the n samples
        differ from each other yet stay reproducible.
        """
        params = self.params
        if params.seed is not None and index:
            params = dataclasses.replace(params, seed=(params.seed + index) % 2**63)
        return Sequence(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            params=params,
            arrival_time=self.arrival_time,
            priority=self.priority,
            index=index,
            output_token_ids=list(self.output_token_ids),
            num_computed_tokens=self.num_computed_tokens,
            status=self.status,
            cumulative_logprob=self.cumulative_logprob,
        )


@dataclass
class Request:
    """A user's request: prompt, parameters and its sequences."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False
    """True once an n > 1 request has split into its n sequences."""
    started: bool = False
    """True once an executed step computed some of its tokens (set by Scheduler.update)."""
    received_time: float | None = None
    """``time.monotonic()`` when the engine core took the request (EngineCore.add_request)."""
    scheduled_time: float | None = None
    """``time.monotonic()`` when a step first admitted it (Scheduler.schedule): with
    asynchronous scheduling that step runs once the one in flight has finished."""

    def __post_init__(self) -> None:
        if not self.seqs:
            self.seqs.append(
                Sequence(
                    self.request_id,
                    self.prompt_token_ids,
                    self.params,
                    self.arrival_time,
                    self.priority,
                )
            )

    @property
    def finished(self) -> bool:
        return (self.forked or self.params.n == 1) and all(s.status.finished for s in self.seqs)
