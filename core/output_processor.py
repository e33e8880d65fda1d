"""The ``update`` of a step: append sampled tokens, detokenize, decide who stops, and
turn the result into :class:`~core.outputs.RequestOutput` objects."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from core.detokenizer import IncrementalDetokenizer, StopChecker
from core.model_runner import ModelRunnerOutput, SampledToken
from core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from core.request import Request, Sequence, SequenceStatus
from core.scheduler import Scheduler, SchedulerOutput


@dataclass
class _SeqState:
    detok: IncrementalDetokenizer | None
    stops: StopChecker | None
    text: str = ""
    decode_at_end: bool = False
    """Final-only output without stop strings: decode once at the end, not per token."""
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)


@dataclass
class _ReqState:
    request: Request
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    first_scheduled: float | None = None
    first_token: float | None = None
    final_only: bool = False
    """Emit only the finished output (offline use); skips per-step output building."""


@dataclass
class StepCounters:
    """Totals since start, read by the metrics endpoint."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_requests: int = 0


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, tokenizer, eos_token_ids: frozenset[int], max_model_len: int):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos = eos_token_ids
        self.max_model_len = max_model_len
        self._reqs: dict[str, _ReqState] = {}
        self._seqs: dict[int, _SeqState] = {}
        self._pending: list[RequestOutput] = []
        self.counters = StepCounters()

    def add_request(self, request: Request, final_only: bool = False) -> None:
        """Track a request. ``final_only``: its consumer wants just the finished output."""
        plp = None
        if request.params.prompt_logprobs is not None:
            plp = [None] * len(request.prompt_token_ids)
        self._reqs[request.request_id] = _ReqState(request, plp, final_only=final_only)
        self.counters.prompt_tokens += len(request.prompt_token_ids)

    def abort(self, request_id: str) -> None:
        """Emit a final output for an aborted request at the next update."""
        state = self._reqs.get(request_id)
        if state is not None:
            self._pending.append(self._finish_request(state))

    # ---- the step ---------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        for rid in sched.aborted:  # the scheduler gave up: the request can never fit
            state = self._reqs.get(rid)
            if state is not None:
                outputs.append(self._finish_request(state))
        now = time.monotonic()
        touched: dict[str, _ReqState] = {}
        for s in sched.scheduled:
            state = self._reqs.get(s.request_id)
            if state is None:  # aborted between schedule and update
                continue
            state.first_scheduled = state.first_scheduled or now
            if s.seq_id in result.prompt_logprobs and state.prompt_logprobs is not None:
                for k, lp in enumerate(result.prompt_logprobs[s.seq_id]):
                    state.prompt_logprobs[s.start_pos + 1 + k] = lp
            tok = result.sampled.get(s.seq_id)
            if tok is not None:
                seq = next(q for q in state.request.seqs if q.seq_id == s.seq_id)
                self._append(seq, tok, state.final_only)
                state.first_token = state.first_token or now
                touched[s.request_id] = state
        for state in touched.values():
            if state.request.finished:
                outputs.append(self._finish_request(state))
            elif not state.final_only:
                outputs.append(self._output(state, finished=False))
        return outputs

    def _append(self, seq: Sequence, tok: SampledToken, final_only: bool) -> None:
        st = self._seqs.get(seq.seq_id) or self._new_seq_state(seq, final_only)
        seq.output_token_ids.append(tok.token_id)
        seq.cumulative_logprob += tok.logprob
        self.counters.generation_tokens += 1
        if tok.top_logprobs is not None:
            st.logprobs.append(tok.top_logprobs)
        text_before = st.text
        delta = st.detok.add_tokens([tok.token_id]) if st.detok else ""
        st.text += delta
        status = self._stop_status(seq, st, tok.token_id, len(delta))
        if status is None:
            return
        stopped_by_token = status is SequenceStatus.FINISHED_STOPPED and not isinstance(
            seq.stop_reason, str
        )
        if stopped_by_token and not seq.params.include_stop_str_in_output:
            # EOS / stop token ids end the text before the token's own text.
            st.text = text_before
        elif st.detok is not None and not isinstance(seq.stop_reason, str):
            st.text += st.detok.finish()
        if st.decode_at_end:
            ids = seq.output_token_ids
            if stopped_by_token and not seq.params.include_stop_str_in_output:
                ids = ids[:-1]
            st.text = self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)
        self.scheduler.finish_sequence(seq, status)

    def _stop_status(self, seq: Sequence, st: _SeqState, token: int, delta_len: int) -> SequenceStatus | None:
        p = seq.params
        n_out = len(seq.output_token_ids)
        if n_out >= p.min_tokens:
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
            if not p.ignore_eos and token in self.eos:
                return SequenceStatus.FINISHED_STOPPED
            if st.stops is not None:
                matched, keep = st.stops.check(st.text, delta_len)
                if matched is not None:
                    st.text = st.text[:keep]
                    seq.stop_reason = matched
                    return SequenceStatus.FINISHED_STOPPED
        if (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _new_seq_state(self, seq: Sequence, final_only: bool) -> _SeqState:
        p = seq.params
        detok = None
        can_detok = p.detokenize and self.tokenizer is not None
        if can_detok and final_only and not p.stop:
            st = _SeqState(None, None, decode_at_end=True)
            self._seqs[seq.seq_id] = st
            return st
        if can_detok:
            detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, p.skip_special_tokens)
            # A forked sibling inherits no outputs (it forks before its first token).
            if seq.output_token_ids:
                detok.add_tokens(seq.output_token_ids)
        stops = StopChecker(p.stop, p.include_stop_str_in_output) if p.stop else None
        st = _SeqState(detok, stops)
        self._seqs[seq.seq_id] = st
        return st

    # ---- outputs ----------------------------------------------------------------------
    def _output(self, state: _ReqState, finished: bool) -> RequestOutput:
        req = state.request
        comps = []
        for seq in sorted(req.seqs, key=lambda q: q.index):
            st = self._seqs.get(seq.seq_id)
            text = st.text if st else ""
            if st and st.stops and not seq.status.finished:
                # never show text that a stop string completed later would trim away
                text = text[: st.stops.streamable_len(text)]
            comps.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=tuple(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=tuple(st.logprobs) if st and req.params.logprobs is not None else None,
                    finish_reason=seq.status.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=state.first_scheduled,
            first_token_time=state.first_token,
            finished_time=time.monotonic() if finished else None,
        )
        plp = tuple(state.prompt_logprobs) if state.prompt_logprobs is not None else None
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, tuple(comps), finished, plp, metrics)

    def _finish_request(self, state: _ReqState) -> RequestOutput:
        out = self._output(state, finished=True)
        self._reqs.pop(state.request.request_id, None)
        for seq in state.request.seqs:
            self._seqs.pop(seq.seq_id, None)
        self.counters.finished_requests += 1
        return out

    def has_pending(self) -> bool:
        return bool(self._pending)
