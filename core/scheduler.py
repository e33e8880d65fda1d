"""Continuous-batching scheduler: which sequences run this step, and how many tokens each.

(The Scheduler class is below the output types.)

One step, in importance order (FCFS: arrival; priority: lower value, then arrival):

* every running sequence gets its next tokens: a decode (one token) or a prefill chunk.
  Decodes are served first from the token budget: a prefill chunk may only use what is
  left after every running decode got its token;
* a swapped sequence is brought back, a waiting one admitted (prefix-cache hits count as
  computed), while blocks, the token budget, ``max_num_seqs`` and, for new prefills, the
  ``watermark_blocks`` reserve allow. Once one cannot be admitted, later ones wait too,
  except that a prompt refused only because ``max_num_partial_prefills`` prompts are
  already mid-prefill is skipped over;
* when blocks run short, the least important running sequence behind the current one is
  preempted (recompute: blocks freed, ``num_computed_tokens`` reset; swap: blocks moved to
  the host pool, recompute when the pool is full); if there is none, the current one is.
  Waiting/swapped sequences preempt running ones (for blocks, not for ``max_num_seqs``
  slots) only under the priority policy and only those of strictly lower priority.

Because the order is total and fixed, a sequence is never preempted by a less important
one, so preemption cannot ping-pong and the most important sequence always progresses.

After the step ran, :meth:`Scheduler.update` owns the token-level half: it appends the
sampled ids, applies EOS / stop token ids / min_tokens / max_tokens / max_model_len, frees
finished sequences, registers computed blocks with the prefix cache and returns one
:class:`~core.engine_core.types.RequestDelta` per request that changed. Text (stop strings,
detokenization) belongs to the front end, which finishes a sample through
:meth:`Scheduler.stop_sample`.

Asynchronous scheduling: step N+1 may be scheduled before ``update`` has step N's tokens
(at most one step in flight). A sequence whose step N samples counts that token as
*pending* (``Sequence.num_pending``): step N+1 gives it the next position, a slot and, if
needed, a block for it, with the input id :data:`~core.request.PLACEHOLDER_TOKEN` (the runner
feeds the token it sampled on the device). ``update(N)`` then appends the token and applies
the stops; a sequence that stopped at N has an extra token in step N+1, which ``update(N+1)``
drops (its blocks were freed at N). A sequence whose in-flight token is its last
(max_tokens, max_model_len) is not scheduled again. Requests that need every token on the
host before their next step (a grammar; penalties where the sampler reads the history from
the schedule) make :meth:`Scheduler.needs_sync` true: the engine then updates before it
schedules.

Penalty history: by default every sampled step of a penalised sequence carries its prompt
and output ids. Where the runner keeps the penalty state itself (``penalty_state``, the
executor's start-up report; :mod:`core.sampler.penalties`) only the step on which a
sequence joins that state carries them: its first sampled step since it was admitted, or
since it was preempted or left out of a step (the runner drops the state of a sequence
missing from a step). Those sequences then need no sync: a later step's placeholder token
was counted on the device when it was sampled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from core.block_manager import BlockManager
from core.config import SchedulerConfig
from core.engine_core.types import RequestDelta, SampleDelta
from core.pooling import skips_prefix_cache
from core.request import PLACEHOLDER_TOKEN, Request, Sequence, SequenceStatus
from core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from core.model_runner import ModelRunnerOutput, SampledToken
    from core.structured_output.bitmask import StepBitmask

logger = logging.getLogger(__name__)


def needs_host_tokens(params: SamplingParams, penalty_state: bool = False) -> bool:
    """Whether a request's next step needs its previous token on the host: a grammar (its
    matcher advances with each accepted token) and penalties, unless the runner keeps the
    penalty state (``penalty_state``: the sampler then reads no history after the join)."""
    return (params.needs_token_history and not penalty_state) or params.structured is not None


class ScheduledSequence(msgspec.Struct, frozen=True, gc=False):
    """One sequence's work in a step.

    A frozen ``msgspec.Struct``, not a frozen dataclass: every step builds one per scheduled
    sequence, and a frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field)
    cost ~2.5 us against ~0.15 us (docs/benchmarks/scheduler.md). Not tracked by the garbage
    collector: it holds only ints, strings, tuples of ints and the request's parameters,
    never a reference back (a plugin must not keep schedule objects in ``params.extra``).
    Copy with ``msgspec.structs.replace``."""

    seq_id: int
    request_id: str
    token_ids: tuple[int, ...]
    """The tokens to compute this step (their KV gets written)."""
    start_pos: int
    """Position of token_ids[0] = tokens already in the cache for this sequence."""
    block_table: tuple[int, ...]
    """Block ids covering positions [0, start_pos + len(token_ids)), in order."""
    sample: bool
    """Sample the next token from the last row (False for a non-final prefill chunk)."""
    params: SamplingParams
    output_index: int
    """How many tokens this sequence has generated so far (seeds per-token randomness)."""
    prompt_token_ids: tuple[int, ...] = ()
    """Set when prompt logprobs are asked for, and with ``output_token_ids``."""
    output_token_ids: tuple[int, ...] = ()
    """Set when the sampler needs history (penalties): every sampled step, or only the step
    on which the sequence joins the runner's penalty state (``Scheduler.penalty_state``)."""
    blocks_needed: int = 0
    """Further KV blocks this sequence may still need to reach its maximum length
    (prompt + max_tokens, capped at max_model_len) beyond its block table."""

    @property
    def is_prefill(self) -> bool:
        return len(self.token_ids) > 1 or not self.sample


@dataclass(frozen=True)
class SchedulerOutput:
    """The plan for one step, consumed by the model runner. Prefills come first.

    Before the forward pass the runner applies ``blocks_to_swap_out`` first: the device
    blocks it reads are free again and may be the destinations of this step's copies,
    swap-ins and new tokens. ``blocks_to_copy`` and ``blocks_to_swap_in`` touch disjoint
    blocks (a copy's source is still held after the step is planned), so their order is free.
    """

    scheduled: tuple[ScheduledSequence, ...]
    """Prefill (and chunked-prefill) sequences first, then decodes."""
    num_prefills: int
    """How many leading entries of ``scheduled`` are prefills."""
    num_batched_tokens: int
    """Sum of len(token_ids) over ``scheduled``."""
    blocks_to_copy: tuple[tuple[int, int], ...] = ()
    """(src, dst) copy-on-write pairs to run before the forward pass."""
    blocks_to_swap_in: tuple[tuple[int, int], ...] = ()
    """(host block, device block) pairs to copy in before the forward pass."""
    blocks_to_swap_out: tuple[tuple[int, int], ...] = ()
    """(device block, host block) pairs to copy out before the forward pass."""
    preempted: tuple[int, ...] = ()
    """seq ids preempted this step (for stats/logs)."""
    aborted: tuple[str, ...] = ()
    """Request ids the scheduler gave up on in this step (a lone sequence that can no
    longer grow within the cache; an error was logged). Their sequences are
    FINISHED_ABORTED and hold no blocks; ``update`` reports them with the reason."""
    grammar: StepBitmask | None = None
    """Structured output: the masks of the constrained rows that sample this step (set by
    the engine core after ``schedule()``; the scheduler leaves it None)."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for logs and the metrics endpoint. Counts are of sequences."""

    num_running: int
    """Sequences holding device blocks (including those mid-prefill)."""
    num_waiting: int
    """Sequences waiting for admission (new, or preempted by recompute)."""
    num_swapped: int
    """Sequences whose KV sits in the host pool."""
    kv_cache_usage: float
    """Fraction of usable KV blocks held by sequences (cached-but-free blocks are free)."""
    num_preemptions: int
    """Preemptions since start (recompute and swap)."""
    prefix_cache_queries: int
    """Tokens looked up in the prefix cache since start (known tokens at each admission)."""
    prefix_cache_hits: int
    """Tokens of those served from the cache."""

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


class _Touched(msgspec.Struct, gc=False):
    """What ``update`` collected for one request (a ``msgspec.Struct``: one per request per
    step, ~0.1 us to build against a slots dataclass's ~0.6 us)."""

    first_scheduled: float | None
    """Request.scheduled_time on the request's first delta, else None."""
    received: float | None = None
    samples: list[SampleDelta] = msgspec.field(default_factory=list)
    prompt_logprobs: tuple[int, tuple] | None = None


class _Fixed:
    """What the scheduler derives once per sequence from inputs that never change (its
    request order, priority, parameters, prompt; the config): every step reads them for
    every live sequence."""

    __slots__ = ("key", "max_len", "max_blocks")

    def __init__(self, key: tuple, max_len: int, max_blocks: int):
        self.key = key
        """:meth:`Scheduler._key`: the sort key of each step."""
        self.max_len = max_len
        """:meth:`Scheduler._max_len`: prompt + max_tokens, capped at max_model_len."""
        self.max_blocks = max_blocks
        """KV blocks that ``max_len`` positions fill."""


@dataclass
class _Step:
    """Scratch state of one ``schedule()`` call."""

    budget: int
    pending_decodes: set[int]
    """Running decodes not yet visited; prefill chunks leave one token for each."""
    entries: list[ScheduledSequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    deferred_swap_ins: list[tuple[Sequence, int]] = field(default_factory=list)
    """(sequence, tokens) swapped in after every swap-out of the step (host blocks that
    a swap-in frees must not be reused by a swap-out whose copy runs first)."""
    reserved: int = 0
    """Device blocks promised to the deferred swap-ins."""
    preempted: list[int] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    """Requests given up on in this step."""
    admission_closed: bool = False


class Scheduler:
    """Decides each step's batch; owns the waiting, running and swapped queues.

    Invariants between calls: every unfinished sequence of a known request is in exactly
    one queue matching its status; running sequences hold a device block table covering
    ``num_computed_tokens`` positions, swapped ones a host table, waiting ones nothing;
    the running sequences (counting an unforked n > 1 request as n) never exceed
    ``max_num_seqs``. Finished requests are forgotten.
    """

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: frozenset[int] = frozenset(),
        max_in_flight: int = 1, penalty_state: bool = False,
    ):
        if config.policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling policy {config.policy!r} is unknown; use 'fcfs' or 'priority'"
            )
        if config.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode {config.preemption_mode!r} is unknown; use 'recompute' or 'swap'"
            )
        limits = {
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_num_partial_prefills": config.max_num_partial_prefills,
        }
        for name, value in limits.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if config.watermark_blocks < 0:
            raise ValueError(f"watermark_blocks must be >= 0, got {config.watermark_blocks}")
        self.config = config
        self.bm = block_manager
        self.eos_token_ids = eos_token_ids
        self.max_in_flight = max_in_flight
        """Pipeline parallelism keeps this many steps (micro-batches) in flight. Above 1, a
        sequence whose sampled token is still in flight is left out of the next steps until
        ``update`` has it (no step carries a placeholder token), and one step takes at most
        1/max_in_flight of the live sequences, so that the stages get batches of similar
        size to overlap on."""
        self.penalty_state = penalty_state
        """The runner keeps each penalised sequence's penalty state from its first sampled
        step for as long as every step schedules it and does not preempt it
        (:class:`core.sampler.penalties.PenaltyState`): only the joining step carries the
        history, and penalties do not count in :meth:`needs_sync`."""
        self._in_penalty_state: set[int] = set()
        """With ``penalty_state``: the sequences whose state the runner holds once it has
        run the last schedule (kept in step with ``PenaltyState.begin_step``/``slots``)."""
        self._requests: dict[str, Request] = {}
        self._order: dict[str, int] = {}
        self._next_order = 0
        self._fixed: dict[int, _Fixed] = {}
        """seq id -> :class:`_Fixed` of each live sequence that was scheduled at least once."""
        self._waiting: dict[int, Sequence] = {}
        self._running: dict[int, Sequence] = {}
        self._swapped: dict[int, Sequence] = {}
        self._aborted: dict[str, str] = {}
        """Request id -> why it was aborted during schedule(), until update() reports it."""
        self._num_preemptions = 0
        self._num_host_token_requests = 0
        """Live requests for which ``needs_host_tokens`` holds."""

    # ------------------------------------------------------------- public API

    def add_request(self, request: Request) -> None:
        """Queue a request.

        :raises ValueError: the request can never run with this cache and these limits (the
            message has the numbers and what to change), or its id is already in use.
        """
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        reason = self._never_fits(request)
        if reason is not None:
            raise ValueError(reason)
        self._requests[request.request_id] = request
        self._num_host_token_requests += needs_host_tokens(request.params, self.penalty_state)
        self._order[request.request_id] = self._next_order
        self._next_order += 1
        for seq in request.seqs:
            if not seq.status.finished:
                seq.status = SequenceStatus.WAITING
                self._waiting[seq.seq_id] = seq

    def abort_request(self, request_id: str) -> list[Sequence]:
        """Finish every unfinished sequence of the request as aborted and free its blocks.

        :return: the sequences aborted now; ``[]`` for an unknown or finished request.
        """
        request = self._requests.get(request_id)
        return self._abort(request) if request is not None else []

    def stop_sample(self, request_id: str, index: int) -> None:
        """Finish sample ``index`` of a request as stopped (the front end matched a stop
        string in its text); no-op when the request or sample already finished."""
        request = self._requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:  # samples get tokens, and so stop strings, only once forked
            if seq.index == index:
                self._finish(seq, SequenceStatus.FINISHED_STOPPED)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark a sequence finished (stop/length) and free its blocks; its computed full
        blocks stay in the prefix cache."""
        if seq.status.finished:
            return
        if seq.seq_id in self._running:
            self._offer_to_cache(seq)
        self._drop(seq)
        seq.status = status
        request = self._requests.get(seq.request_id)
        if request is not None and request.finished:
            self._forget(request)

    # --------------------------------------------------------------- update

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestDelta]:
        """Apply an executed step: append each sampled token, finish the sequences that
        reached a token-level stop, register computed blocks with the prefix cache.

        The next step may have been scheduled since ``sched`` (asynchronous scheduling): a
        sequence preempted meanwhile still gets its token; one that finished or was aborted
        meanwhile has its token dropped, never reported.

        :return: one delta per request that got tokens, prompt logprobs, its first
            scheduled step, or an abort in this step.
        """
        deltas = [RequestDelta(rid, finished=True, abort_reason=self._aborted.pop(rid, "aborted"))
                  for rid in sched.aborted]
        touched: dict[str, _Touched] = {}
        running = self._running
        for s in sched.scheduled:
            seq = running.get(s.seq_id) or self._live(s.seq_id)
            if seq is None:  # finished or aborted since this step was scheduled
                continue
            if s.sample:
                seq.num_pending -= 1
            t = touched.get(s.request_id)
            if t is None:
                request = self._requests[s.request_id]
                first = not request.started
                t = touched[s.request_id] = _Touched(
                    first_scheduled=request.scheduled_time if first else None,
                    received=request.received_time if first else None,
                )
                request.started = True
            if s.seq_id in result.prompt_logprobs:
                t.prompt_logprobs = (s.start_pos + 1, tuple(result.prompt_logprobs[s.seq_id]))
            tok = result.sampled.get(s.seq_id)
            if tok is not None:
                t.samples.append(self._append(seq, tok))
            elif seq.status is SequenceStatus.RUNNING:
                self._offer_to_cache(seq)
        for rid, t in touched.items():
            if t.samples or t.prompt_logprobs is not None or t.first_scheduled is not None:
                deltas.append(RequestDelta(rid, tuple(t.samples), rid not in self._requests,
                                           first_scheduled=t.first_scheduled,
                                           prompt_logprobs=t.prompt_logprobs, received=t.received))
        return deltas

    def _append(self, seq: Sequence, tok: SampledToken) -> SampleDelta:
        seq.output_token_ids.append(tok.token_id)
        seq.cumulative_logprob += tok.logprob
        status, stop_id = self._stop_status(seq, tok.token_id)
        if status is None:
            if seq.status is SequenceStatus.RUNNING:
                self._offer_to_cache(seq)
        else:
            seq.stop_reason = stop_id
            self._finish(seq, status)
        return SampleDelta(seq.index, tok.token_id, tok.logprob, tok.top_logprobs,
                           status.finish_reason if status else None, stop_id)

    def _stop_status(self, seq: Sequence, token: int) -> tuple[SequenceStatus | None, int | None]:
        """The token-level stop the sequence reached with ``token``, and the stop token id."""
        p = seq.params
        n_out = len(seq.output_token_ids)
        if n_out >= p.min_tokens:
            if token in p.stop_token_ids:
                return SequenceStatus.FINISHED_STOPPED, token
            if not p.ignore_eos and token in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED, None
        if ((p.max_tokens is not None and n_out >= p.max_tokens)
                or seq.num_tokens >= self.config.max_model_len):
            return SequenceStatus.FINISHED_LENGTH, None
        return None, None

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished or an abort is still to be reported."""
        return bool(self._requests) or bool(self._aborted)

    def needs_sync(self) -> bool:
        """True while a live request needs each step's tokens on the host before its next
        step is scheduled (see :func:`needs_host_tokens`): the engine must ``update`` with the
        step in flight before it calls ``schedule``."""
        return self._num_host_token_requests > 0

    def get_request(self, request_id: str) -> Request | None:
        """The request while it is unfinished, else None."""
        return self._requests.get(request_id)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_swapped=len(self._swapped),
            kv_cache_usage=self.bm.usage,
            num_preemptions=self._num_preemptions,
            prefix_cache_queries=self.bm.prefix_cache_queries,
            prefix_cache_hits=self.bm.prefix_cache_hits,
        )

    def schedule(self) -> SchedulerOutput:
        """Plan one step and advance ``num_computed_tokens`` of every scheduled sequence.

        At most one step may be in flight: after ``schedule`` for step N+1 the engine must
        ``update`` with step N before it schedules N+2 (and before N+1 while
        :meth:`needs_sync` is true)."""
        step = _Step(
            budget=self.config.max_num_batched_tokens,
            pending_decodes={s.seq_id for s in self._running.values() if self._remaining(s) == 1
                             and not (self.max_in_flight > 1 and s.num_pending)},
        )
        candidates = [*self._running.values(), *self._swapped.values(), *self._waiting.values()]
        share = -(-len(candidates) // self.max_in_flight)  # a micro-batch's share of them
        for seq in sorted(candidates, key=self._cached_key):
            if self.max_in_flight > 1 and len(step.entries) >= share:
                break  # the rest go to the next micro-batch
            status = seq.status
            if (status is not SequenceStatus.RUNNING and status.finished) or seq.seq_id in step.preempted:
                continue  # preempted or aborted earlier in this step
            if self.max_in_flight > 1 and seq.num_pending:
                continue  # its token is in an earlier micro-batch still in the pipe
            if status is SequenceStatus.RUNNING:
                self._schedule_running(seq, step)
            elif seq.status is SequenceStatus.SWAPPED:
                self._schedule_swapped(seq, step)
            else:
                self._schedule_waiting(seq, step)
        self._run_swap_ins(step)
        out = self._output(step)
        if self.penalty_state:
            # The runner drops the state of a sequence missing from a step or preempted in
            # it (neither is in ``scheduled``) and takes one at a sequence's sampled row.
            self._in_penalty_state = {
                e.seq_id for e in out.scheduled
                if e.params.needs_token_history and (e.sample or e.seq_id in self._in_penalty_state)
            }
        return out

    # ------------------------------------------------------- one step, per queue

    def _schedule_running(self, seq: Sequence, step: _Step) -> None:
        """A running sequence (the caller checked: not preempted in this step)."""
        if not self._ready_to_fork(seq):
            self._schedule_tokens(seq, step)
            return
        for s in (seq, *self._fork(seq)):
            if s.status is SequenceStatus.RUNNING and s.seq_id not in step.preempted:
                self._schedule_tokens(s, step)

    def _schedule_tokens(self, seq: Sequence, step: _Step) -> None:
        if seq.seq_id in step.pending_decodes:
            # One token left to compute (see schedule()): what _num_new_tokens gives a
            # decode, without recomputing its target.
            step.pending_decodes.discard(seq.seq_id)
            k = 1 if step.budget > 0 else 0
        else:
            k = self._num_new_tokens(seq, seq.num_computed_tokens, step, is_decode=False)
        if k == 0:
            return
        start = seq.num_computed_tokens
        fits = self.bm.fits_in_own_block(seq.seq_id, start) if k == 1 else (
            self.bm.num_blocks_to_append(seq.seq_id, start, start + k) == 0)
        if fits and self.bm.num_free_blocks >= step.reserved:
            # The common decode step: the token fits the sequence's own last block, so there
            # is nothing to allocate, copy or preempt for.
            step.budget -= k
            self._emit(seq, k, step)
            return

        def need() -> int:
            return self.bm.num_blocks_to_append(seq.seq_id, start, start + k)

        if not self._make_room(seq, need, step, strict_priority=False):
            if len(self._running) == 1:
                self._abort_in_step(
                    seq, step,
                    f"at {start + k} tokens it needs {need()} more KV blocks besides its "
                    f"{len(self.bm.block_table(seq.seq_id))}, but the cache has "
                    f"{self.bm.num_usable_blocks} in all",
                )
            else:
                self._preempt(seq, step)
            return
        step.copies += self.bm.append_slots(seq.seq_id, start, start + k)
        step.budget -= k
        self._emit(seq, k, step)

    def _schedule_swapped(self, seq: Sequence, step: _Step) -> None:
        if seq.num_pending:
            return  # preempted with a token in flight: back once update() has it
        if step.admission_closed or not self._has_slots(seq):
            step.admission_closed = True
            return
        remaining = self._remaining(seq)
        k = self._num_new_tokens(seq, seq.num_computed_tokens, step, remaining == 1)
        need = self.bm.num_blocks_to_swap_in_and_append(seq.seq_id, seq.num_computed_tokens + k)
        if (k == 0 and remaining > 0) or not self._make_room(
            seq, lambda: need, step, strict_priority=True
        ):
            step.admission_closed = True
            return
        step.reserved += need
        step.budget -= k
        del self._swapped[seq.seq_id]
        self._running[seq.seq_id] = seq
        seq.status = SequenceStatus.RUNNING
        step.deferred_swap_ins.append((seq, k))

    def _run_swap_ins(self, step: _Step) -> None:
        step.reserved = 0
        for seq, k in step.deferred_swap_ins:
            step.swap_in += self.bm.swap_in(seq.seq_id)
            if k:
                start = seq.num_computed_tokens
                step.copies += self.bm.append_slots(seq.seq_id, start, start + k)
                self._emit(seq, k, step)

    def _schedule_waiting(self, seq: Sequence, step: _Step) -> None:
        if seq.num_pending:
            return  # preempted with a token in flight: admitted once update() has it
        if step.admission_closed or not self._has_slots(seq):
            step.admission_closed = True
            return
        tokens = seq.token_ids_from(0, seq.num_tokens)
        # Prompt logprobs need the logits of every prompt position: no cache hits then.
        cached = self.bm.match_prefix(tokens) if seq.params.prompt_logprobs is None else 0
        cached = 0 if skips_prefix_cache(seq.params) else cached  # mean pooling reads every position
        request = self._requests[seq.request_id]
        remaining = self._target(seq) - cached
        if remaining <= 0:  # an n > 1 prompt that forks at once: n tokens, a block each
            if step.budget <= len(step.pending_decodes):
                step.admission_closed = True
                return
            fresh = request.params.n
        else:
            k = self._num_new_tokens(seq, cached, step, is_decode=False)
            if k == 0:
                step.admission_closed = True
                return
            if (
                remaining - k >= 2
                and self._num_partial_prefills() >= self.config.max_num_partial_prefills
            ):
                return  # starvation guard: let prompts that finish now go ahead
            fresh = self.bm.blocks_for(cached + k) - cached // self.bm.block_size
        reserve = self.config.watermark_blocks if self._running else 0

        def need() -> int:
            # The cached blocks to take back from the free pool, then the blocks for this
            # step's tokens. Re-evaluated after each preemption: a victim's release can turn
            # a shared hit block into a free one that must be revived.
            return self.bm.num_blocks_to_allocate(tokens, cached) + fresh + reserve

        if not self._make_room(seq, need, step, strict_priority=True):
            step.admission_closed = True
            return
        seq.num_computed_tokens = self.bm.allocate(seq.seq_id, tokens, cached)
        del self._waiting[seq.seq_id]
        self._running[seq.seq_id] = seq
        seq.status = SequenceStatus.RUNNING
        if request.scheduled_time is None:  # the first admission (not a re-admission after preemption)
            request.scheduled_time = time.monotonic()
        self._schedule_running(seq, step)

    # ---------------------------------------------------------------- helpers

    def _key(self, seq: Sequence) -> tuple:
        """Importance: smaller is more important; total (request order, sample index)."""
        fcfs = (seq.arrival_time, self._order[seq.request_id], seq.index)
        return (seq.priority, *fcfs) if self.config.policy == "priority" else fcfs

    def _fixed_of(self, seq: Sequence) -> _Fixed:
        """The sequence's :class:`_Fixed`, computed on first use; dropped with the sequence
        (:meth:`_drop`)."""
        fixed = self._fixed.get(seq.seq_id)
        if fixed is None:
            max_len = self._max_len(seq)
            fixed = self._fixed[seq.seq_id] = _Fixed(self._key(seq), max_len, self.bm.blocks_for(max_len))
        return fixed

    def _cached_key(self, seq: Sequence) -> tuple:
        """:meth:`_key` through :meth:`_fixed_of` (every step sorts every live sequence by it)."""
        return self._fixed_of(seq).key

    def _unforked(self, request: Request) -> bool:
        return request.params.n > 1 and not request.forked

    def _target(self, seq: Sequence) -> int:
        """Tokens to compute before this sequence can move on: the prompt minus its last
        token for an unforked n > 1 request (then it forks), else every known or pending
        token, except a pending last one (max_tokens, max_model_len): it needs no KV, and the
        sequence finishes once update() has it."""
        if seq.params.n > 1 and self._unforked(self._requests[seq.request_id]):
            return seq.num_prompt_tokens - 1
        pending = seq.num_pending
        n = seq.num_tokens + pending
        return n - 1 if pending and n >= self._fixed_of(seq).max_len else n

    def _remaining(self, seq: Sequence) -> int:
        return self._target(seq) - seq.num_computed_tokens

    def _max_len(self, seq: Sequence) -> int:
        max_tokens = seq.params.max_tokens
        limit = self.config.max_model_len
        return limit if max_tokens is None else min(limit, seq.num_prompt_tokens + max_tokens)

    def _slots(self, seq: Sequence) -> int:
        request = self._requests[seq.request_id]
        return request.params.n if self._unforked(request) else 1

    def _has_slots(self, seq: Sequence) -> bool:
        used = sum(self._slots(s) for s in self._running.values())
        return used + self._slots(seq) <= self.config.max_num_seqs

    def _num_partial_prefills(self) -> int:
        return sum(1 for s in self._running.values() if self._remaining(s) >= 2)

    def _num_new_tokens(self, seq: Sequence, computed: int, step: _Step, is_decode: bool) -> int:
        """Tokens to compute this step within the budget (0: none now)."""
        remaining = self._target(seq) - computed
        avail = step.budget - (0 if is_decode else len(step.pending_decodes))
        if remaining <= 0 or avail <= 0:
            return 0
        if remaining <= avail:
            return remaining
        # Without chunked prefill a prompt waits for a step with room for all of it; a
        # recomputed prompt + outputs longer than a whole step has to be chunked anyway.
        chunk = self.config.enable_chunked_prefill or remaining > self.config.max_num_batched_tokens
        return avail if chunk else 0

    def _ready_to_fork(self, seq: Sequence) -> bool:
        return (seq.params.n > 1 and self._unforked(self._requests[seq.request_id])
                and self._remaining(seq) <= 0)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """Split an n > 1 request's sequence into n sharing its blocks."""
        request = self._requests[seq.request_id]
        children = [seq.fork(i) for i in range(1, request.params.n)]
        for child in children:
            self.bm.fork(seq.seq_id, child.seq_id)
            self._running[child.seq_id] = child
        request.seqs.extend(children)
        request.forked = True
        return children

    def _make_room(
        self, seq: Sequence, need: Callable[[], int], step: _Step, strict_priority: bool
    ) -> bool:
        """Preempt less important running sequences until ``need()`` blocks are free.

        ``strict_priority`` (admissions): only under the priority policy, and only victims
        of strictly lower priority; otherwise any running sequence behind ``seq``.
        """
        while self.bm.num_free_blocks - step.reserved < need():
            victim = self._pick_victim(seq, strict_priority)
            if victim is None:
                return False
            self._preempt(victim, step)
        return True

    def _pick_victim(self, seq: Sequence, strict_priority: bool) -> Sequence | None:
        if strict_priority and self.config.policy != "priority":
            return None
        key = self._cached_key(seq)
        # Everything behind seq in importance order is still unplanned this step.
        behind = [
            v
            for v in self._running.values()
            if self._cached_key(v) > key and (not strict_priority or v.priority > seq.priority)
        ]
        return max(behind, key=self._cached_key, default=None)

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        self._num_preemptions += 1
        step.preempted.append(seq.seq_id)
        step.pending_decodes.discard(seq.seq_id)
        del self._running[seq.seq_id]
        if self.config.preemption_mode == "swap" and self.bm.can_swap_out(seq.seq_id):
            step.swap_out += self.bm.swap_out(seq.seq_id)
            seq.status = SequenceStatus.SWAPPED
            self._swapped[seq.seq_id] = seq
        else:
            # Outputs are kept: the re-admission prefills prompt + outputs.
            self.bm.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self._waiting[seq.seq_id] = seq

    def _emit(self, seq: Sequence, k: int, step: _Step) -> None:
        # Runs once per scheduled sequence per step: kept to plain attribute reads.
        start = seq.num_computed_tokens
        end = seq.num_computed_tokens = start + k
        params, pending = seq.params, seq.num_pending
        if pending and self._num_host_token_requests and needs_host_tokens(params, self.penalty_state):
            raise RuntimeError(
                f"sequence {seq.seq_id} (request {seq.request_id!r}) needs its previous token on "
                "the host, but it is still in flight; while Scheduler.needs_sync() is true, call "
                "update() with the step in flight before schedule()"
            )
        table = self.bm.block_table(seq.seq_id)
        num_outputs = len(seq.output_token_ids)
        sample = end == len(seq.prompt_token_ids) + num_outputs + pending
        prompt_ids, output_ids = self._history(seq, sample)
        # Positional (see ScheduledSequence for the fields): one entry per scheduled row per step.
        step.entries.append(ScheduledSequence(
            seq.seq_id, seq.request_id, _input_ids(seq, start, end), start, table, sample,
            params, num_outputs + pending, prompt_ids, output_ids,
            max(0, self._fixed_of(seq).max_blocks - len(table)),
        ))
        if sample:
            seq.num_pending = pending + 1

    def _history(self, seq: Sequence, sample: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The (prompt ids, output ids) an entry of ``seq`` carries this step."""
        params = seq.params
        if params.prompt_logprobs is None and not params.needs_token_history:
            return (), ()  # the common row, with or without the penalty state
        if not self.penalty_state:
            history = params.needs_token_history or params.prompt_logprobs is not None
            return (seq.prompt_token_ids, tuple(seq.output_token_ids)) if history else ((), ())
        joins = params.needs_token_history and sample and seq.seq_id not in self._in_penalty_state
        if joins and seq.num_pending:
            raise RuntimeError(
                f"sequence {seq.seq_id} (request {seq.request_id!r}) joins the runner's penalty "
                "state with a token still in flight, so its history is incomplete (scheduler "
                "bug: a sequence out of the state is scheduled only after update() has its token)"
            )
        prompt = seq.prompt_token_ids if joins or params.prompt_logprobs is not None else ()
        return prompt, tuple(seq.output_token_ids) if joins else ()

    def _output(self, step: _Step) -> SchedulerOutput:
        prefills, decodes, tokens = [], [], 0
        for e in step.entries:
            n = len(e.token_ids)
            tokens += n
            (prefills if n > 1 or not e.sample else decodes).append(e)  # e.is_prefill
        aborted = tuple(step.aborted)
        return SchedulerOutput(
            scheduled=tuple(prefills + decodes),
            num_prefills=len(prefills),
            num_batched_tokens=tokens,
            blocks_to_copy=tuple(step.copies),
            blocks_to_swap_in=tuple(step.swap_in),
            blocks_to_swap_out=tuple(step.swap_out),
            preempted=tuple(step.preempted),
            aborted=aborted,
        )

    def _offer_to_cache(self, seq: Sequence) -> None:
        """Register the sequence's computed full blocks (their KV was written by an
        launched step, so other sequences may reuse them from the next step on). Positions
        computed with an in-flight token wait until the token is known."""
        bm = self.bm
        if not bm.enable_prefix_caching:
            return
        computed = min(seq.num_computed_tokens, seq.num_tokens)
        full = computed // bm.block_size
        if full > bm.num_hashed_blocks(seq.seq_id):
            tokens = seq.token_ids_from(0, full * bm.block_size)
            bm.cache_computed(seq.seq_id, tokens, computed)

    def _live(self, seq_id: int) -> Sequence | None:
        """The unfinished sequence with this id, in whichever queue it is."""
        for queue in (self._running, self._waiting, self._swapped):
            seq = queue.get(seq_id)
            if seq is not None:
                return seq
        return None

    def _drop(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and release whatever blocks it holds."""
        for queue in (self._waiting, self._running, self._swapped):
            queue.pop(seq.seq_id, None)
        self._fixed.pop(seq.seq_id, None)
        if self.bm.has_blocks(seq.seq_id):
            self.bm.free(seq.seq_id)

    def _abort(self, request: Request) -> list[Sequence]:
        aborted = [s for s in request.seqs if not s.status.finished]
        for seq in aborted:
            self._drop(seq)
            seq.status = SequenceStatus.FINISHED_ABORTED
        self._forget(request)
        return aborted

    def _abort_in_step(self, seq: Sequence, step: _Step, reason: str) -> None:
        logger.error("aborting request %s (sequence %d): %s", seq.request_id, seq.seq_id, reason)
        self._abort(self._requests[seq.request_id])
        step.aborted.append(seq.request_id)
        self._aborted[seq.request_id] = f"the request can no longer fit the KV cache: {reason}"

    def _forget(self, request: Request) -> None:
        if self._requests.pop(request.request_id, None) is not None:
            self._num_host_token_requests -= needs_host_tokens(request.params, self.penalty_state)
        self._order.pop(request.request_id, None)

    def _never_fits(self, request: Request) -> str | None:
        """Why the request can never run with this cache and these limits, or None."""
        cfg, n = self.config, request.params.n
        p = len(request.prompt_token_ids)
        if p == 0:
            return "the prompt is empty"
        if p >= cfg.max_model_len:
            return f"the prompt has {p} tokens but max_model_len is {cfg.max_model_len}"
        if n > cfg.max_num_seqs:
            return f"n={n} samples but max_num_seqs is {cfg.max_num_seqs}; raise --max-num-seqs"
        if not cfg.enable_chunked_prefill and p > cfg.max_num_batched_tokens:
            return (
                f"the prompt has {p} tokens, more than max_num_batched_tokens "
                f"({cfg.max_num_batched_tokens}), and chunked prefill is off; enable it"
            )
        bs = self.bm.block_size
        per_seq = self.bm.max_blocks_held(self._max_len(request.seqs[0]), cfg.max_num_batched_tokens)
        shared = min(per_seq, (p - 1) // bs) if n > 1 else 0
        need = shared + n * (per_seq - shared)
        if need > self.bm.num_usable_blocks:
            return (
                f"n={n} sample(s) of up to {self._max_len(request.seqs[0])} tokens need {need} KV "
                f"blocks of {bs} tokens but the cache has {self.bm.num_usable_blocks}; lower "
                "max_tokens or n, or raise the KV cache memory"
            )
        return None


def _input_ids(seq: Sequence, start: int, end: int) -> tuple[int, ...]:
    """Input ids of positions [start, end): known tokens, then a placeholder for each
    position whose token is still in flight."""
    known = seq.num_tokens
    if end <= known:
        return seq.token_ids_from(start, end)
    if start >= known:  # an asynchronous decode step: every token is still in flight
        return (PLACEHOLDER_TOKEN,) * (end - start)
    return seq.token_ids_from(start, known) + (PLACEHOLDER_TOKEN,) * (end - known)
