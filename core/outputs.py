"""What the engine returns for a request after each step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token, with its rank in the distribution (1 = most likely)."""

    logprob: float
    rank: int
    decoded: str | None = None


TokenLogprobs = dict[int, Logprob]
"""token id -> Logprob for one position: the top-k plus the chosen token."""


@dataclass(frozen=True)
class CompletionOutput:
    """One sample of a request, cumulative since the start."""

    index: int
    """Which of the request's n samples."""
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float
    logprobs: tuple[TokenLogprobs, ...] | None
    """Per generated token, when SamplingParams.logprobs is set."""
    finish_reason: str | None
    """stop | length | abort, or None while running."""
    stop_reason: int | str | None = None
    """The stop token id or stop string matched (None for EOS or length)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    """``time.monotonic()`` stamps of a request (CLOCK_MONOTONIC: the engine core's agree
    with the front end's)."""

    arrival_time: float
    """The front end took the request."""
    first_scheduled_time: float | None = None
    """The engine core scheduled the step that computed its first tokens."""
    first_token_time: float | None = None
    finished_time: float | None = None
    engine_received_time: float | None = None
    """The engine core took the request (after tokenization and the IPC)."""


@dataclass(frozen=True)
class RequestOutput:
    """The state of one request after a step: every sample's output so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    """Per prompt token (None for the first), when SamplingParams.prompt_logprobs is set."""
    metrics: RequestMetrics | None = field(default=None, compare=False)
    pooled: tuple[float, ...] | None = None
    """A pooling (embedding) request's vector, once its prompt ran (core/pooling.py)."""
