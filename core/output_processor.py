"""The front end's output half: turn the engine core's token deltas into cumulative
:class:`~core.outputs.RequestOutput` values: detokenize, match stop strings, keep logprobs
and timings.

It never touches the scheduler. A stop string found in a sample's text finishes the sample
here at once; :meth:`OutputProcessor.process` returns those samples so the caller tells the
engine core (:class:`~core.engine_core.types.RequestDelta` tokens that arrive for a finished
sample afterwards are dropped).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from core.detokenizer import IncrementalDetokenizer, StopChecker, decode_complete
from core.engine_core.types import EngineRequest, RequestDelta, SampleDelta
from core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


@dataclass
class _Sample:
    index: int
    detok: IncrementalDetokenizer | None
    stops: StopChecker | None
    decode_at_end: bool = False
    """Final-only output without stop strings: decode once at the end, not per token."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _ReqState:
    request: EngineRequest
    prompt: str | None
    samples: list[_Sample]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    final_only: bool
    """Emit only the finished output (offline use); skips per-step output building."""
    first_scheduled: float | None = None
    engine_received: float | None = None
    first_token: float | None = None
    pooled: tuple[float, ...] | None = None

    @property
    def finished(self) -> bool:
        for s in self.samples:  # a loop, not all(<generator>): read per delta per step
            if s.finish_reason is None:
                return False
        return True


@dataclass
class StepCounters:
    """Totals since start, read by the metrics endpoint."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_requests: int = 0


@dataclass(frozen=True)
class StopHit:
    """A sample finished by a stop string: the engine core must stop it too."""

    request_id: str
    index: int


class OutputProcessor:
    """Not thread-safe: the owner serializes calls.

    :param tokenizer: a transformers tokenizer (``decode`` and friends), or None to skip text
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._reqs: dict[str, _ReqState] = {}
        self.counters = StepCounters()

    def add_request(self, request: EngineRequest, prompt: str | None, final_only: bool = False) -> None:
        """Track a request before the engine core sees it (so no delta can be missed)."""
        p = request.params
        plp = [None] * len(request.prompt_token_ids) if p.prompt_logprobs is not None else None
        samples = [self._new_sample(i, request, final_only) for i in range(p.n)]
        self._reqs[request.request_id] = _ReqState(request, prompt, samples, plp, final_only)
        self.counters.prompt_tokens += len(request.prompt_token_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request as aborted now; its final output (None if it is unknown)."""
        state = self._reqs.get(request_id)
        if state is None:
            return None
        for s in state.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"
        return self._finish_request(state)

    def discard(self, request_id: str) -> None:
        """Forget a request the engine core refused (it never ran: no output, no counts)."""
        state = self._reqs.pop(request_id, None)
        if state is not None:
            self.counters.prompt_tokens -= len(state.request.prompt_token_ids)

    def has_unfinished(self) -> bool:
        return bool(self._reqs)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reqs

    # ---- one step's deltas ---------------------------------------------------------------
    def process(self, deltas: list[RequestDelta]) -> tuple[list[RequestOutput], list[StopHit]]:
        """Outputs for the requests the deltas touched (only finished ones for final-only
        requests), and the samples that stop strings finished."""
        outputs: list[RequestOutput] = []
        stops: list[StopHit] = []
        now = time.monotonic()
        for d in deltas:
            state = self._reqs.get(d.request_id)
            if state is None:  # finished or aborted here already
                continue
            if d.first_scheduled is not None:
                state.first_scheduled, state.engine_received = d.first_scheduled, d.received
            if d.pooled is not None:
                state.pooled = d.pooled
            if d.prompt_logprobs is not None and state.prompt_logprobs is not None:
                first, entries = d.prompt_logprobs
                state.prompt_logprobs[first : first + len(entries)] = entries
            for sd in d.samples:
                sample = state.samples[sd.index]
                if sample.finish_reason is None:
                    state.first_token = state.first_token or now
                    if self._append(state, sample, sd):
                        stops.append(StopHit(d.request_id, sd.index))
            if d.abort_reason is not None:
                for s in state.samples:
                    s.finish_reason = s.finish_reason or "abort"
            if state.finished:
                outputs.append(self._finish_request(state))
            elif not state.final_only and (d.samples or d.prompt_logprobs is not None):
                outputs.append(self._output(state, finished=False))
        return outputs, stops

    def _append(self, state: _ReqState, s: _Sample, sd: SampleDelta) -> bool:
        """Add one token; True when a stop string finished the sample just now."""
        p = state.request.params
        s.token_ids.append(sd.token_id)
        s.cumulative_logprob += sd.logprob
        self.counters.generation_tokens += 1
        if sd.top_logprobs is not None:
            s.logprobs.append(sd.top_logprobs)
        if s.detok is None and s.stops is None and sd.finish_reason is None:
            return False  # no text per token (final-only or detokenize off) and still running
        text_before = s.text
        delta = s.detok.add_tokens([sd.token_id]) if s.detok else ""
        s.text += delta
        # A stop string in the text wins over max_tokens (same as a character stream), but
        # not over an EOS / stop token id, which ended the sample first in the engine.
        if sd.finish_reason != "stop" and s.stops is not None and len(s.token_ids) >= p.min_tokens:
            matched, keep = s.stops.check(s.text, len(delta))
            if matched is not None:
                s.text, s.finish_reason, s.stop_reason = s.text[:keep], "stop", matched
                return sd.finish_reason is None  # still running in the engine core
        if sd.finish_reason is None:
            return False
        s.finish_reason, s.stop_reason = sd.finish_reason, sd.stop_reason
        # The engine stops only on tokens: an EOS / stop id ends the text before its own text.
        drop_token = sd.finish_reason == "stop" and not p.include_stop_str_in_output
        if drop_token:
            s.text = text_before
        elif s.detok is not None:
            s.text += s.detok.finish(drop_partial=True)  # never end in half a character
        if s.decode_at_end:
            ids = s.token_ids[:-1] if drop_token else s.token_ids
            s.text = decode_complete(self.tokenizer, ids, p.skip_special_tokens)
        return False

    def _new_sample(self, index: int, request: EngineRequest, final_only: bool) -> _Sample:
        p = request.params
        if not p.detokenize or self.tokenizer is None:
            return _Sample(index, None, None)
        if final_only and not p.stop:
            return _Sample(index, None, None, decode_at_end=True)
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, p.skip_special_tokens)
        stops = StopChecker(p.stop, p.include_stop_str_in_output) if p.stop else None
        return _Sample(index, detok, stops)

    # ---- outputs -------------------------------------------------------------------------
    def _output(self, state: _ReqState, finished: bool) -> RequestOutput:
        req = state.request
        comps = []
        for s in state.samples:
            text = s.text
            if s.stops and s.finish_reason is None:
                # never show text that a stop string completed later would trim away
                text = text[: s.stops.streamable_len(text)]
            comps.append(
                CompletionOutput(
                    index=s.index,
                    text=text,
                    token_ids=tuple(s.token_ids),
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=tuple(s.logprobs) if req.params.logprobs is not None else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=state.first_scheduled,
            first_token_time=state.first_token,
            finished_time=time.monotonic() if finished else None,
            engine_received_time=state.engine_received,
        )
        plp = tuple(state.prompt_logprobs) if state.prompt_logprobs is not None else None
        return RequestOutput(req.request_id, state.prompt, req.prompt_token_ids, tuple(comps), finished, plp, metrics,
                             state.pooled)

    def _finish_request(self, state: _ReqState) -> RequestOutput:
        out = self._output(state, finished=True)
        self._reqs.pop(state.request.request_id, None)
        self.counters.finished_requests += 1
        return out
