"""Structured output inside the engine core: compiling off the loop, parking requests until
their grammar is ready, one matcher per sample, and each step's bitmask.

The scheduler never sees a request whose grammar is still compiling: :meth:`admit` hands a
request to it at once when its grammar is cached, and parks it otherwise;
:meth:`release_ready` (at the start of every step) hands over the parked requests whose
compile finished, and finishes those whose compile failed. After ``schedule()``,
:meth:`step_bitmask` fills one mask row per constrained sample row in one parallel call;
after ``update()``, :meth:`accept` advances each sample's matcher by its new token.

Every step with a constrained row is synchronous: its mask needs the previous token
accepted first (``SamplingParams.structured is not None`` is what tells the scheduler).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from core.engine_core.types import RequestDelta
from core.structured_output.bitmask import StepBitmask, allocate_bitmask
from core.structured_output.compiler import CompiledGrammar, GrammarCompiler
from core.structured_output.matcher import GrammarMatcher, fill_bitmasks

if TYPE_CHECKING:
    from core.request import Request
    from core.scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)

PARKED_WAIT_S = 0.02
"""How long an otherwise idle loop waits for a compile before it looks for commands again."""


def needs_sync_step(sched: SchedulerOutput) -> bool:
    """Whether a step must run synchronously: one of its rows samples under a grammar, whose
    mask needs the row's previous token accepted first (for the asynchronous scheduler)."""
    return any(s.sample and s.params.structured is not None for s in sched.scheduled)


class StructuredOutputs:
    """The engine core's structured-output state (one per engine core).

    :param load_tokenizer: returns the HF tokenizer; called once, at the first constrained
        request (an engine that never sees one never builds the grammar tokenizer).
    :param vocab_size: the model's logits width.
    :param eos_token_ids: the engine's EOS set: the grammar allows them where output may end.
    :param pin_memory: fill the masks into page-locked memory (a device with memory of its
        own: the copy to it then does not wait for the step's forward pass).
    """

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: Iterable[int],
                 pin_memory: bool = False):
        self._pin = pin_memory
        self._load_tokenizer = load_tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._parked: dict[str, tuple[Request, Future[CompiledGrammar]]] = {}
        self._grammars: dict[str, CompiledGrammar] = {}
        self._matchers: dict[tuple[str, int], GrammarMatcher] = {}
        self._seq_index: dict[int, tuple[str, int]] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._load_tokenizer(), self._vocab_size, self._eos or None)
        return self._compiler

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def has_parked(self) -> bool:
        return bool(self._parked)

    def is_parked(self, request_id: str) -> bool:
        return request_id in self._parked

    @property
    def active(self) -> bool:
        """Some scheduled request has a grammar (else a step needs no masks)."""
        return bool(self._grammars)

    # ---- requests -----------------------------------------------------------------------
    def admit(self, request: Request, add: Callable[[Request], None]) -> None:
        """Give ``request`` to ``add`` (the scheduler's) now if its grammar is compiled, else
        park it until :meth:`release_ready` finds it compiled.

        :raises GrammarError: the grammar library refuses the spec (a ``ValueError``: the
            request is refused, nothing is kept).
        """
        spec = request.params.structured
        self.compiler.check(spec)
        fut = self.compiler.submit(spec)
        if fut.done() and fut.exception() is None:
            add(request)
            self._grammars[request.request_id] = fut.result()
        else:
            self._parked[request.request_id] = (request, fut)

    def release_ready(self, add: Callable[[Request], None]) -> list[RequestDelta]:
        """Hand the parked requests whose grammar is ready to ``add``; a request whose
        compile failed (or that ``add`` refuses) is finished with the reason."""
        failed: list[RequestDelta] = []
        for rid, (request, fut) in list(self._parked.items()):
            if not fut.done():
                continue
            del self._parked[rid]
            try:
                compiled = fut.result()
                add(request)
            except Exception as e:  # noqa: BLE001 - the request fails, the engine goes on
                logger.error("request %s: %s", rid, e)
                failed.append(RequestDelta(rid, finished=True, abort_reason=str(e)))
                continue
            self._grammars[rid] = compiled
        return failed

    def wait_for_compile(self, timeout: float = PARKED_WAIT_S) -> None:
        """Block until a parked compile finishes or ``timeout`` passes (an idle loop with
        only parked requests would otherwise spin)."""
        futures = [fut for _, fut in self._parked.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def forget(self, request_id: str) -> None:
        """Drop everything kept for a request (aborted, or finished)."""
        self._parked.pop(request_id, None)
        self._grammars.pop(request_id, None)
        for key in [k for k in self._matchers if k[0] == request_id]:
            del self._matchers[key]
        for seq_id in [s for s, k in self._seq_index.items() if k[0] == request_id]:
            del self._seq_index[seq_id]

    # ---- steps --------------------------------------------------------------------------
    def step_bitmask(self, sched: SchedulerOutput, scheduler: Scheduler) -> StepBitmask | None:
        """Masks for the constrained rows that sample this step, or None when there are none."""
        entries = [s for s in sched.scheduled if s.sample and s.params.structured is not None]
        if not entries:
            return None
        matchers = [self._matcher(s.request_id, s.seq_id, scheduler) for s in entries]
        bitmask = allocate_bitmask(len(entries), self._vocab_size, pin_memory=self._pin)
        live = [i for i, m in enumerate(matchers) if m.error is None]
        fill_bitmasks(self.compiler, [matchers[i] for i in live], live, bitmask)
        for i in set(range(len(entries))) - set(live):
            self._eos_only(bitmask[i])  # a matcher in error: end the sample rather than run on
        return StepBitmask(tuple(s.seq_id for s in entries), bitmask)

    def accept(self, deltas: list[RequestDelta]) -> None:
        """Advance each constrained sample by the token it got this step."""
        for d in deltas:
            for sd in d.samples:
                m = self._matchers.get((d.request_id, sd.index))
                if m is not None and not m.accept(sd.token_id):
                    logger.warning("request %s sample %d: token %d rejected by its grammar (%s); only EOS "
                                   "is allowed from here", d.request_id, sd.index, sd.token_id, m.error)
                if sd.finish_reason is not None:
                    self._matchers.pop((d.request_id, sd.index), None)
            if d.finished:
                self.forget(d.request_id)

    def _matcher(self, request_id: str, seq_id: int, scheduler: Scheduler) -> GrammarMatcher:
        key = self._seq_index.get(seq_id)
        if key is None:
            request = scheduler.get_request(request_id)
            index = next(s.index for s in request.seqs if s.seq_id == seq_id)
            key = self._seq_index[seq_id] = (request_id, index)
        m = self._matchers.get(key)
        if m is None:  # a sample's first token (n > 1: each sample from the start)
            m = self._matchers[key] = GrammarMatcher(self._grammars[request_id])
        return m

    def _eos_only(self, row: torch.Tensor) -> None:
        row.zero_()
        for t in self._eos:
            row[t // 32] |= 1 << (t % 32) if t % 32 < 31 else -(2**31)

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()
