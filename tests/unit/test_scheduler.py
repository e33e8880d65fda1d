"""Scheduler: continuous batching, chunked prefill, prefix caching, preemption (both
policies, both modes), n > 1 forking, aborts (core/scheduler.py).

``FakeEngine`` plays the engine and the runner without a model: it keeps a simulated KV
cache in which every slot holds the token id computed there, applies the block moves in
the documented order (swap-out, copy, swap-in), checks that every scheduled sequence reads
its exact history from that cache, and samples a "next token" that is a hash of what it
read. Outputs therefore change if the scheduler or block manager ever mixes up KV, and
they are compared with a reference computed directly from the prompts.

With ``pipelined=True`` it drives the scheduler as the asynchronous engine loop does:
step N+1 is scheduled and "run" before ``update`` gets step N's tokens. Its device keeps
each sequence's true token list, feeds placeholder inputs from it and checks that every
known input id the host sent is right.
"""

from __future__ import annotations

import random
import zlib
from array import array
from collections import defaultdict

import pytest

from core.block_manager import NULL_BLOCK, BlockManager, blocks_for
from core.config import SchedulerConfig
from core.engine_core.types import RequestDelta, SampleDelta
from core.model_runner import ModelRunnerOutput, SampledToken
from core.request import PLACEHOLDER_TOKEN, Request, Sequence, SequenceStatus
from core.sampling_params import SamplingParams
from core.scheduler import Scheduler, SchedulerOutput

BS = 4
VOCAB = 97
STOP_MOD = 23  # a sampled token divisible by this stops the sequence (when stop=True)


def fake_next(tokens: list[int], index: int) -> int:
    """The fake model: a deterministic function of the whole context and sample index."""
    return zlib.crc32(array("q", [*tokens, index]).tobytes()) % VOCAB


def reference(prompt: tuple[int, ...], max_tokens: int, index: int, stops: bool, max_len: int):
    out: list[int] = []
    while True:
        out.append(fake_next([*prompt, *out], index))
        done = len(out) >= max_tokens or len(prompt) + len(out) >= max_len
        if done or (stops and out[-1] % STOP_MOD == 0):
            return out


class FakeEngine:
    def __init__(self, num_blocks: int, num_host_blocks: int = 0, caching: bool = True,
                 pipelined: bool = False, **cfg):
        cfg.setdefault("max_model_len", 256)
        self.cfg = SchedulerConfig(**cfg)
        self.bm = BlockManager(num_blocks, BS, caching, num_host_blocks)
        self.sched = Scheduler(self.cfg, self.bm)
        self.kv: dict[int, list[int | None]] = defaultdict(lambda: [None] * BS)
        self.host: dict[int, list[int | None]] = defaultdict(lambda: [None] * BS)
        self.requests: dict[str, Request] = {}
        self.stops: dict[str, bool] = {}
        self.aborted: set[str] = set()
        self.history: list[SchedulerOutput] = []
        self.deltas: list[RequestDelta] = []
        self.generated: dict[int, int] = {}
        self.swap_in_first = False  # copies and swap-ins may run in either order
        self.pipelined = pipelined
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self.truth: dict[int, list[int]] = {}
        """seq id -> every token the device knows (sampled ones before the host does)."""

    def add(
        self,
        rid: str,
        prompt,
        max_tokens: int = 4,
        *,
        n: int = 1,
        priority: int = 0,
        arrival: float | None = None,
        stops: bool = False,
        **params,
    ) -> Request:
        if stops:  # the fake model's "stop tokens": sampled ids divisible by STOP_MOD
            params["stop_token_ids"] = tuple(range(0, VOCAB, STOP_MOD))
        sp = SamplingParams(max_tokens=max_tokens, n=n, **params)
        req = Request(rid, tuple(prompt), sp, priority=priority)
        if arrival is not None:
            req.arrival_time = arrival
            for s in req.seqs:
                s.arrival_time = arrival
        self.sched.add_request(req)  # raises for a request that can never fit
        self.requests[rid] = req
        self.stops[rid] = stops
        return req

    def seq(self, seq_id: int) -> Sequence:
        return next(s for r in self.requests.values() for s in r.seqs if s.seq_id == seq_id)

    def run_arrivals(self, arrivals: dict[int, list], to_abort: dict[str, int]) -> None:
        """Step until done, adding ``arrivals[step]`` (``((id, prompt, max_tokens), kwargs)``)
        and aborting ``to_abort`` ids at their steps (the aborted ones go to ``self.aborted``)."""
        step = 0
        while self.sched.has_unfinished_requests() or self.in_flight or step <= max(arrivals):
            for args, kwargs in arrivals.get(step, []):
                self.add(*args, **kwargs)
            for rid, when in to_abort.items():
                if when == step and self.sched.abort_request(rid):
                    self.aborted.add(rid)
            self.step()
            step += 1
            assert step < 3000, "no progress"

    def step(self) -> SchedulerOutput | None:
        """One step; pipelined: schedule and run step N+1, then update with step N (or only
        update once nothing is left to schedule; then None)."""
        out = None
        if not self.pipelined or self.sched.has_unfinished_requests():
            out = self.sched.schedule()
            self.history.append(out)
            self.aborted.update(out.aborted)
            self._check(out)
            result = self._execute(out)
        if not self.pipelined:
            self.deltas += self.sched.update(out, result)
        else:
            previous, self.in_flight = self.in_flight, (out, result) if out is not None else None
            if previous is not None:
                self.deltas += self.sched.update(*previous)
        self.bm.check_invariants()
        for r in self.requests.values():  # generated tokens are never taken back
            for q in r.seqs:
                assert len(q.output_token_ids) >= self.generated.get(q.seq_id, 0)
                self.generated[q.seq_id] = len(q.output_token_ids)
        return out

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for dev, host in out.blocks_to_swap_out:  # always first (see SchedulerOutput)
            self.host[host] = list(self.kv[dev])
        moves = [self._copy(out), self._swap_in(out)]
        for move in moves[:: -1 if self.swap_in_first else 1]:
            move()
        # The forward pass: all cached context is read before this step's KV is written,
        # so a sequence may only rely on blocks computed in earlier steps.
        sampled, inputs = {}, {}
        for e in out.scheduled:
            seq = self.seq(e.seq_id)
            truth = self.truth.setdefault(e.seq_id, list(seq.token_ids_from(0, seq.num_tokens)))
            end = e.start_pos + len(e.token_ids)
            ids = [t if t != PLACEHOLDER_TOKEN else truth[e.start_pos + i] for i, t in enumerate(e.token_ids)]
            assert ids == truth[e.start_pos : end], f"seq {e.seq_id}: wrong input ids"
            context = [self.kv[e.block_table[p // BS]][p % BS] for p in range(e.start_pos)]
            assert context == truth[: e.start_pos], f"seq {e.seq_id}: bad KV"
            inputs[e.seq_id] = ids
            if e.sample:
                assert end == len(truth)
                sampled[e.seq_id] = fake_next(truth, seq.index)
        for e in out.scheduled:
            for i, tok in enumerate(inputs[e.seq_id]):
                pos = e.start_pos + i
                self.kv[e.block_table[pos // BS]][pos % BS] = tok
        for sid, tok in sampled.items():
            self.truth[sid].append(tok)
        return ModelRunnerOutput({sid: SampledToken(tok, 0.0, None) for sid, tok in sampled.items()}, {})

    def _copy(self, out: SchedulerOutput):
        def run():
            # Batched: every source is read before any destination is written.
            sources = [list(self.kv[src]) for src, _ in out.blocks_to_copy]
            for (_, dst), data in zip(out.blocks_to_copy, sources):
                self.kv[dst] = data

        return run

    def _swap_in(self, out: SchedulerOutput):
        def run():
            for host, dev in out.blocks_to_swap_in:
                self.kv[dev] = list(self.host[host])

        return run

    def _check(self, out: SchedulerOutput) -> None:
        entries = out.scheduled
        assert out.num_batched_tokens == sum(len(e.token_ids) for e in entries)
        assert out.num_batched_tokens <= self.cfg.max_num_batched_tokens
        assert len(entries) <= self.cfg.max_num_seqs
        assert self.sched.stats().num_running <= self.cfg.max_num_seqs
        assert [e.is_prefill for e in entries] == [True] * out.num_prefills + [False] * (
            len(entries) - out.num_prefills
        )
        assert len({e.seq_id for e in entries}) == len(entries)
        for e in entries:
            seq = self.seq(e.seq_id)
            end = e.start_pos + len(e.token_ids)
            assert len(e.token_ids) >= 1 and seq.status is SequenceStatus.RUNNING
            # Known positions carry their id, in-flight ones (pipelined only) the placeholder.
            known = seq.token_ids_from(e.start_pos, min(end, seq.num_tokens))
            assert end == seq.num_computed_tokens and e.token_ids == known + (PLACEHOLDER_TOKEN,) * (
                end - e.start_pos - len(known)
            )
            pending = seq.num_pending - e.sample  # in flight before this step
            assert pending <= (1 if self.pipelined else 0)
            assert e.sample == (end == seq.num_tokens + pending)
            assert len(e.block_table) == blocks_for(end, BS) and NULL_BLOCK not in e.block_table
            assert e.output_index == len(seq.output_token_ids) + pending
            max_len = min(seq.num_prompt_tokens + seq.params.max_tokens, self.cfg.max_model_len)
            assert e.blocks_needed == max(0, blocks_for(max_len, BS) - len(e.block_table))
            # Never a token past max_tokens / max_model_len, even with one in flight.
            assert seq.num_tokens + seq.num_pending <= max_len

    def run(self, max_steps: int = 2000, arrivals: dict[int, list] | None = None) -> int:
        steps = 0
        while (self.sched.has_unfinished_requests() or self.in_flight is not None
               or (arrivals and max(arrivals) >= steps)):
            for args in (arrivals or {}).get(steps, []):
                self.add(*args[0], **args[1])
            self.step()
            steps += 1
            assert steps < max_steps, "the scheduler does not make progress"
        return steps

    def outputs(self, rid: str) -> list[list[int]]:
        return [
            list(s.output_token_ids) for s in sorted(self.requests[rid].seqs, key=lambda s: s.index)
        ]

    def expected(self, rid: str) -> list[list[int]]:
        req = self.requests[rid]
        return [
            reference(
                req.prompt_token_ids,
                req.params.max_tokens,
                i,
                self.stops[rid],
                self.cfg.max_model_len,
            )
            for i in range(req.params.n)
        ]

    def assert_all_free(self) -> None:
        assert not self.sched.has_unfinished_requests()
        stats = self.sched.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
        assert self.bm.num_free_blocks == self.bm.num_usable_blocks
        assert self.bm.num_free_host_blocks == self.bm.num_host_blocks
        assert stats.kv_cache_usage == 0.0
        # Nothing per sequence outlives it (a server runs for days): the cached sort keys.
        assert not self.sched._fixed, f"per-sequence state left for sequences {sorted(self.sched._fixed)}"


def shape(out: SchedulerOutput) -> list[tuple[int, int, int, bool]]:
    return [(e.seq_id, e.start_pos, len(e.token_ids), e.sample) for e in out.scheduled]


def prompt(n: int, start: int = 1) -> list[int]:
    return [(start + i) % VOCAB for i in range(n)]


# --------------------------------------------------------------- batching basics


def test_chunked_prefill_spreads_a_long_prompt_over_steps():
    eng = FakeEngine(num_blocks=64, max_num_batched_tokens=8)
    s = eng.add("a", prompt(20), max_tokens=3).seqs[0].seq_id
    shapes = [shape(eng.step()) for _ in range(5)]
    assert shapes == [
        [(s, 0, 8, False)],
        [(s, 8, 8, False)],
        [(s, 16, 4, True)],
        [(s, 20, 1, True)],
        [(s, 21, 1, True)],
    ]
    assert not eng.sched.has_unfinished_requests()
    assert eng.outputs("a") == eng.expected("a")
    eng.assert_all_free()


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    eng = FakeEngine(num_blocks=64, max_num_batched_tokens=10, enable_chunked_prefill=False)
    a = eng.add("a", prompt(3), max_tokens=5, arrival=0).seqs[0].seq_id
    b = eng.add("b", prompt(10, 50), max_tokens=1, arrival=1).seqs[0].seq_id
    # Step 1: a (3 tokens) leaves 7, too few for b's 10: b waits instead of being split.
    assert shape(eng.step()) == [(a, 0, 3, True)]
    # Step 2: a decodes (1 token), 9 left: b still waits; once a is done b runs whole.
    assert shape(eng.step()) == [(a, 3, 1, True)]
    eng.run()
    assert [sh for out in eng.history for sh in shape(out) if sh[0] == b][0] == (b, 0, 10, True)
    # A prompt longer than a whole step can never run without chunking: refused at once.
    with pytest.raises(ValueError, match=r"11 tokens, more than max_num_batched_tokens \(10\).*enable it"):
        eng.add("c", prompt(11), max_tokens=1)
    assert not eng.sched.has_unfinished_requests()
    eng.assert_all_free()


def test_decodes_get_their_token_before_prefill_chunks():
    eng = FakeEngine(num_blocks=64, max_num_batched_tokens=10, policy="priority")
    d = eng.add("d", prompt(2), max_tokens=10, priority=1).seqs[0].seq_id
    eng.step()
    # "l" is more important, but the running decode keeps its token: l gets 10 - 1.
    l_ = eng.add("l", prompt(30, 40), max_tokens=1, priority=0).seqs[0].seq_id
    out = eng.step()
    assert shape(out) == [(l_, 0, 9, False), (d, 2, 1, True)]
    assert out.num_prefills == 1 and out.num_batched_tokens == 10


def test_token_budget_and_max_num_seqs_hold_every_step():
    eng = FakeEngine(num_blocks=64, max_num_batched_tokens=12, max_num_seqs=3)
    for i in range(10):
        eng.add(f"r{i}", prompt(5, 7 * i), max_tokens=4, arrival=i)
    eng.run()  # FakeEngine._check asserts both limits on every step
    assert max(len(out.scheduled) for out in eng.history) == 3
    assert max(out.num_batched_tokens for out in eng.history) == 12
    # Step 1: r0, r1 whole (10 tokens), then r2 gets the 2 tokens left (a chunk).
    assert [(sp, k) for _, sp, k, _ in shape(eng.history[0])] == [(0, 5), (0, 5), (0, 2)]
    for i in range(10):
        assert eng.outputs(f"r{i}") == eng.expected(f"r{i}")
    eng.assert_all_free()


def test_max_num_partial_prefills_caps_prompts_mid_prefill():
    def scenario(cap: int):
        eng = FakeEngine(
            num_blocks=64,
            max_num_batched_tokens=10,
            policy="priority",
            max_num_partial_prefills=cap,
        )
        long1 = eng.add("l1", prompt(30), max_tokens=1, priority=5).seqs[0].seq_id
        assert shape(eng.step()) == [(long1, 0, 10, False)]
        long2 = eng.add("l2", prompt(30, 60), max_tokens=1, priority=0).seqs[0].seq_id
        short = eng.add("s", prompt(3, 30), max_tokens=1, priority=1).seqs[0].seq_id
        return shape(eng.step()), long1, long2, short

    # cap 1: l2 would become a second prompt mid-prefill, so it waits; the short prompt
    # (which completes this step) goes ahead and l1 continues with what is left.
    got, long1, long2, short = scenario(1)
    assert got == [(short, 0, 3, True), (long1, 10, 7, False)]
    # cap 2: l2 (most important) takes the whole budget.
    got, long1, long2, short = scenario(2)
    assert got == [(long2, 0, 10, False)]


def test_history_fields_only_when_the_sampler_needs_them():
    eng = FakeEngine(num_blocks=64)
    eng.add("plain", prompt(5), max_tokens=3)
    eng.add("pen", prompt(5, 20), max_tokens=3, repetition_penalty=1.2)
    eng.add("plp", prompt(5, 40), max_tokens=3, prompt_logprobs=1)
    eng.step()
    out = eng.step()
    by_req = {e.request_id: e for e in out.scheduled}
    assert by_req["plain"].prompt_token_ids == () and by_req["plain"].output_token_ids == ()
    for rid in ("pen", "plp"):
        seq = eng.requests[rid].seqs[0]
        assert by_req[rid].prompt_token_ids == seq.prompt_token_ids
        # (the fake engine has appended this step's token since)
        assert by_req[rid].output_token_ids == tuple(seq.output_token_ids[:1])
    # blocks_needed: 5 prompt + 3 max_tokens = 8 tokens = 2 blocks; the table has 2 at
    # position 5 (computing token 5 of 0..5).
    assert by_req["plain"].blocks_needed == 0 and by_req["plain"].output_index == 1


# ----------------------------------------------------------------- prefix cache


def _shared_prefix_requests(eng: FakeEngine, count: int, arrival0: float = 0.0) -> None:
    system = prompt(12, 200)  # 3 full blocks shared by every request
    for i in range(count):
        eng.add(f"r{i}", system + [i, i, i, i, (i + 1) % VOCAB], max_tokens=2, arrival=arrival0 + i)


def test_prefix_cache_hits_for_32_requests_sharing_three_blocks():
    eng = FakeEngine(num_blocks=200, max_num_batched_tokens=1000)
    _shared_prefix_requests(eng, 1)
    eng.step()  # r0 computes its 17 tokens; its 3 full prefix blocks are cached after it
    for i in range(1, 32):
        system = prompt(12, 200)
        eng.add(f"r{i}", system + [i, i, i, i, (i + 1) % VOCAB], max_tokens=2, arrival=i)
    out = eng.step()
    prefills = [e for e in out.scheduled if e.is_prefill]
    assert len(prefills) == 31 and all((e.start_pos, len(e.token_ids)) == (12, 5) for e in prefills)
    stats = eng.sched.stats()
    # Queries: 32 prompts x 17 tokens; hits: 31 later prompts x 3 blocks x 4 tokens.
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (32 * 17, 31 * 12)
    assert stats.prefix_cache_hit_rate == pytest.approx(372 / 544)
    eng.run()
    for i in range(32):
        assert eng.outputs(f"r{i}") == eng.expected(f"r{i}")
    eng.assert_all_free()
    assert eng.bm.num_cached_blocks > 0  # freed cached blocks stay until evicted


def test_prefix_cache_hits_when_all_arrive_together_under_a_small_budget():
    # With a 17-token budget r0's prefill fills step 1, so everything after it is admitted
    # once r0's prefix blocks are computed: every later request hits 12 tokens.
    eng = FakeEngine(num_blocks=200, max_num_batched_tokens=17)
    _shared_prefix_requests(eng, 32)
    eng.run()
    stats = eng.sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (32 * 17, 31 * 12)
    for i in range(32):
        assert eng.outputs(f"r{i}") == eng.expected(f"r{i}")
    eng.assert_all_free()


def test_prompt_logprobs_requests_compute_their_whole_prompt():
    eng = FakeEngine(num_blocks=200, max_num_batched_tokens=1000)
    _shared_prefix_requests(eng, 1)
    eng.step()
    system = prompt(12, 200)
    plp = eng.add("plp", system + [1, 2, 3], max_tokens=1, prompt_logprobs=0).seqs[0]
    hit = eng.add("hit", system + [4, 5, 6], max_tokens=1).seqs[0]
    starts = {e.seq_id: e.start_pos for e in eng.step().scheduled if e.is_prefill}
    assert starts == {plp.seq_id: 0, hit.seq_id: 12}
    eng.run()
    eng.assert_all_free()


def test_prefix_caching_off_computes_everything():
    eng = FakeEngine(num_blocks=200, max_num_batched_tokens=17, caching=False)
    _shared_prefix_requests(eng, 8)
    eng.run()
    assert sum(out.num_batched_tokens for out in eng.history) == 8 * 17 + 8 * 1  # + 2nd tokens
    stats = eng.sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    eng.assert_all_free()


# ------------------------------------------------------------------- preemption


def _pressure(mode: str, policy: str, host: int = 8):
    """Usable blocks 4. A: 8-token prompt (2 blocks), B and C: 3 tokens (1 block each).
    After step 1 the cache is full; in step 2 A's position 8 needs a new block."""
    eng = FakeEngine(
        num_blocks=5,
        num_host_blocks=host,
        max_num_batched_tokens=64,
        preemption_mode=mode,
        policy=policy,
    )
    a = eng.add("A", prompt(8), max_tokens=6, arrival=0, priority=1).seqs[0]
    b = eng.add("B", prompt(3, 30), max_tokens=6, arrival=1, priority=5).seqs[0]
    c = eng.add("C", prompt(3, 60), max_tokens=6, arrival=2, priority=0).seqs[0]
    out = eng.step()
    assert out.num_prefills == 3 and eng.bm.num_free_blocks == 0
    return eng, a, b, c


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_order_and_unchanged_outputs(policy: str, mode: str):
    eng, a, b, c = _pressure(mode, policy)
    victim_request = eng.sched.get_request((c if policy == "fcfs" else b).request_id)
    admitted = victim_request.scheduled_time  # the first admission's time stamp (metrics)
    assert admitted is not None
    out = eng.step()
    # FCFS preempts the newest arrival (C); priority the highest priority value (B).
    victim = c if policy == "fcfs" else b
    assert out.preempted == (victim.seq_id,)
    assert eng.sched.stats().num_preemptions == 1
    assert victim.seq_id not in {e.seq_id for e in out.scheduled}
    if mode == "recompute":
        assert victim.status is SequenceStatus.WAITING and victim.num_computed_tokens == 0
        assert out.blocks_to_swap_out == () and eng.sched.stats().num_waiting == 1
    else:
        assert victim.status is SequenceStatus.SWAPPED and victim.num_computed_tokens == 3
        assert len(out.blocks_to_swap_out) == 1 and eng.sched.stats().num_swapped == 1
    assert len(victim.output_token_ids) == 1  # its first token is kept either way
    eng.run()
    if mode == "swap":  # it comes back from the host block it went to
        swap_ins = [p for o in eng.history for p in o.blocks_to_swap_in]
        assert swap_ins[0][0] == out.blocks_to_swap_out[0][1]
    for rid in "ABC":
        assert eng.outputs(rid) == eng.expected(rid)
    eng.assert_all_free()
    assert victim_request.scheduled_time == admitted  # re-admission keeps the first stamp


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    eng, a, b, c = _pressure("swap", "fcfs", host=0)
    out = eng.step()
    assert out.preempted == (c.seq_id,) and out.blocks_to_swap_out == ()
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0
    eng.run()
    for rid in "ABC":
        assert eng.outputs(rid) == eng.expected(rid)
    eng.assert_all_free()


def test_priority_orders_admission_and_preempts_lower_priority_for_a_waiting_one():
    eng = FakeEngine(num_blocks=64, max_num_seqs=1, policy="priority")
    for rid, prio in (("p3", 3), ("p1", 1), ("p2", 2)):
        eng.add(rid, prompt(4), max_tokens=2, priority=prio)
    eng.run()
    first_step = {}
    for i, out in enumerate(eng.history):
        for e in out.scheduled:
            first_step.setdefault(e.request_id, i)
    assert sorted(first_step, key=first_step.get) == ["p1", "p2", "p3"]
    # A more important arrival takes the blocks of a running less important one.
    eng = FakeEngine(num_blocks=5, policy="priority")  # 4 usable blocks
    low = eng.add("low", prompt(12), max_tokens=3, priority=5).seqs[0]
    eng.step()  # low holds 3 blocks, 1 is free
    high = eng.add("high", prompt(6, 40), max_tokens=1, priority=0).seqs[0]  # needs 2
    out = eng.step()
    assert out.preempted == (low.seq_id,) and low.status is SequenceStatus.WAITING
    assert [e.seq_id for e in out.scheduled] == [high.seq_id]
    eng.run()
    assert eng.outputs("low") == eng.expected("low")
    eng.assert_all_free()


def test_a_lower_priority_arrival_does_not_preempt():
    eng = FakeEngine(num_blocks=5, policy="priority", max_num_batched_tokens=64)
    run = eng.add("run", prompt(12), max_tokens=3, priority=0).seqs[0]
    eng.step()  # 3 blocks
    eng.add("late", prompt(8, 40), max_tokens=3, priority=9)  # needs 2 + its next: waits
    out = eng.step()
    assert out.preempted == () and [e.seq_id for e in out.scheduled] == [run.seq_id]
    eng.run()
    eng.assert_all_free()


def test_watermark_keeps_free_blocks_for_running_sequences():
    eng = FakeEngine(num_blocks=11, watermark_blocks=3)  # 10 usable
    eng.add("a", prompt(15), max_tokens=20)
    eng.step()  # a holds 4 blocks (positions 0..15), 6 free
    b = eng.add("b", prompt(9, 40), max_tokens=1).seqs[0]  # 3 blocks: 6 - 3 = 3 >= 3
    eng.add("c", prompt(5, 70), max_tokens=1)  # 2 blocks: 3 - 2 = 1 < 3, waits
    out = eng.step()
    assert {e.request_id for e in out.scheduled} == {"a", "b"}
    assert b.status is SequenceStatus.FINISHED_LENGTH
    eng.run()
    eng.assert_all_free()


# ---------------------------------------------------------------- n > 1 forking


def test_n_samples_share_the_prompt_blocks_exactly_once():
    eng = FakeEngine(num_blocks=64)
    req = eng.add("r", prompt(10), max_tokens=3, n=3)
    s0 = req.seqs[0]
    out = eng.step()
    # Prompt minus its last token, no sampling: positions 0..8 -> blocks b0 b1 b2.
    assert shape(out) == [(s0.seq_id, 0, 9, False)] and not req.forked
    b0, b1, b2 = out.scheduled[0].block_table
    out = eng.step()
    assert req.forked and len(req.seqs) == 3 and [s.index for s in req.seqs] == [0, 1, 2]
    assert sorted(shape(out)) == sorted((s.seq_id, 9, 1, True) for s in req.seqs)
    # Position 9 lands in the shared b2: two samples copy it, the third writes in place.
    assert [src for src, _ in out.blocks_to_copy] == [b2, b2]
    tables = [e.block_table for e in out.scheduled]
    assert all(t[:2] == (b0, b1) for t in tables) and eng.bm.ref_count(b0) == 3
    assert len({t[2] for t in tables}) == 3
    assert eng.bm.num_usable_blocks - eng.bm.num_free_blocks == 2 + 3  # prompt held once
    eng.run()
    assert eng.outputs("r") == eng.expected("r")
    assert len({tuple(o) for o in eng.outputs("r")}) == 3  # the samples differ
    eng.assert_all_free()


def test_n_samples_of_a_one_token_prompt_fork_at_once():
    eng = FakeEngine(num_blocks=64)
    req = eng.add("r", [5], max_tokens=2, n=2)
    out = eng.step()
    assert req.forked and sorted(shape(out)) == sorted((s.seq_id, 0, 1, True) for s in req.seqs)
    assert out.blocks_to_copy == ()
    eng.run()
    assert eng.outputs("r") == eng.expected("r")
    eng.assert_all_free()


def test_n_samples_reuse_a_cached_prompt_and_fork_on_admission():
    eng = FakeEngine(num_blocks=64)
    eng.add("warm", prompt(9), max_tokens=1)
    eng.run()
    req = eng.add("r", prompt(9), max_tokens=2, n=2)
    out = eng.step()  # 8 cached tokens = the prompt minus its last: fork at once
    assert req.forked and sorted(shape(out)) == sorted((s.seq_id, 8, 1, True) for s in req.seqs)
    eng.run()
    assert eng.outputs("r") == eng.expected("r")
    eng.assert_all_free()


# ------------------------------------------------------------ aborts and limits


def test_abort_frees_waiting_running_and_swapped_sequences():
    eng, a, b, c = _pressure("swap", "fcfs")
    eng.add("D", prompt(6, 80), max_tokens=3, arrival=3)
    eng.step()  # C is swapped out, D waits
    assert c.status is SequenceStatus.SWAPPED
    assert eng.sched.abort_request("C") == [c] and c.status is SequenceStatus.FINISHED_ABORTED
    assert eng.sched.abort_request("D")[0].status is SequenceStatus.FINISHED_ABORTED
    assert eng.sched.abort_request("A") == [a] and eng.sched.abort_request("A") == []
    assert eng.sched.abort_request("nope") == []
    assert eng.sched.get_request("A") is None and eng.sched.get_request("B") is not None
    eng.sched.abort_request("B")
    eng.assert_all_free()
    assert eng.step().scheduled == ()


def test_abort_of_a_forked_request_aborts_every_sample():
    eng = FakeEngine(num_blocks=64)
    req = eng.add("r", prompt(6), max_tokens=5, n=2)
    eng.step()
    eng.step()
    assert req.forked
    assert {s.seq_id for s in eng.sched.abort_request("r")} == {s.seq_id for s in req.seqs}
    eng.assert_all_free()


def test_requests_that_can_never_fit_are_refused_at_admission():
    eng = FakeEngine(num_blocks=6, max_num_seqs=2, max_model_len=64)  # 5 usable = 20 tokens
    with pytest.raises(ValueError, match="up to 30 tokens need 8 KV blocks of 4 tokens but the cache has 5"):
        eng.add("big", prompt(10), max_tokens=20)  # 30 tokens = 8 blocks > 5
    with pytest.raises(ValueError, match="n=3 samples but max_num_seqs is 2"):
        eng.add("wide", prompt(3), max_tokens=1, n=3)
    # n=2 of a 3-token prompt (no full block to share): up to 8 tokens need 2 x 2 = 4 blocks
    # and fit; up to 15 tokens need 2 x 4 = 8.
    with pytest.raises(ValueError, match="2 sample\\(s\\) of up to 15 tokens need 8 KV blocks"):
        eng.add("n2", prompt(3), max_tokens=12, n=2)
    eng.add("fits", prompt(3), max_tokens=5, n=2)
    eng.add("ok", prompt(3), max_tokens=2)
    assert not eng.sched.has_unfinished_requests() or eng.sched.get_request("big") is None
    eng.run()
    assert eng.outputs("ok") == eng.expected("ok") and eng.outputs("fits") == eng.expected("fits")
    assert not any(out.aborted for out in eng.history)
    eng.assert_all_free()


def test_a_lone_sequence_that_cannot_grow_is_aborted_not_looped(caplog):
    eng = FakeEngine(num_blocks=6)  # 5 usable
    eng.bm.allocate(-1, prompt(12), 12)  # 3 blocks held outside the scheduler
    eng.add("r", prompt(7), max_tokens=5)  # fits the cache in principle (3 blocks)
    eng.step()  # prompt 0..6: 2 blocks, the cache is now full
    eng.step()  # position 7 still fits the second block
    out = eng.step()  # position 8 needs a third block that can never come
    assert out.aborted == ("r",) and out.scheduled == ()
    assert "aborting request r" in caplog.text and "cache has 5 in all" in caplog.text
    assert not eng.sched.has_unfinished_requests()
    eng.bm.free(-1)
    eng.assert_all_free()


def test_duplicate_request_id_and_bad_config_are_refused():
    eng = FakeEngine(num_blocks=8)
    eng.add("x", prompt(3))
    with pytest.raises(ValueError, match="already scheduled"):
        eng.add("x", prompt(3))
    with pytest.raises(ValueError, match="policy 'lifo'"):
        Scheduler(SchedulerConfig(policy="lifo"), BlockManager(8, BS))
    with pytest.raises(ValueError, match="max_num_partial_prefills must be >= 1"):
        Scheduler(SchedulerConfig(max_num_partial_prefills=0), BlockManager(8, BS))


def test_stats_track_queues_usage_and_preemptions():
    eng, a, b, c = _pressure("swap", "fcfs")
    st = eng.sched.stats()
    assert (st.num_running, st.num_waiting, st.num_swapped, st.num_preemptions) == (3, 0, 0, 0)
    assert st.kv_cache_usage == 1.0
    eng.step()
    st = eng.sched.stats()
    assert (st.num_running, st.num_swapped, st.num_preemptions) == (2, 1, 1)
    assert st.kv_cache_usage == 1.0  # C's block went to A
    with pytest.raises(AttributeError):
        st.num_running = 0  # frozen


# ------------------------------------------------------------ random workloads


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workloads_finish_with_reference_outputs_and_free_blocks(
    policy: str, mode: str, chunked: bool, caching: bool, seed: int, pipelined: bool
):
    rng = random.Random(f"{policy}{mode}{chunked}{caching}{seed}")
    eng = FakeEngine(
        pipelined=pipelined,
        num_blocks=33,  # 32 usable: room for the largest request, far from all at once
        num_host_blocks=rng.choice([0, 6, 40]),
        caching=caching,
        max_num_batched_tokens=rng.choice([48, 64]),
        max_num_seqs=rng.choice([4, 8, 16]),
        max_model_len=64,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
        policy=policy,
        watermark_blocks=rng.choice([0, 2]),
        max_num_partial_prefills=rng.choice([1, 2]),
    )
    eng.swap_in_first = seed % 2 == 1
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    arrivals: dict[int, list] = defaultdict(list)
    for i in range(28):
        head = rng.choice(systems) if rng.random() < 0.6 else []
        body = head + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 24))]
        kwargs = {
            "n": rng.choice([1, 1, 1, 2, 3]),
            "priority": rng.randrange(3),
            "arrival": float(i),
            "stops": rng.random() < 0.5,
            "prompt_logprobs": 0 if rng.random() < 0.15 else None,
        }
        arrivals[rng.randrange(12)].append(((f"r{i}", body[:40], rng.randrange(1, 20)), kwargs))
    to_abort = {f"r{i}": rng.randrange(30) for i in rng.sample(range(28), 3)}

    eng.run_arrivals(arrivals, to_abort)

    assert len(eng.requests) == 28
    for rid, req in eng.requests.items():
        want = eng.expected(rid)
        got = eng.outputs(rid)
        if rid in eng.aborted:
            assert all(
                s.status is SequenceStatus.FINISHED_ABORTED or s.status.finished for s in req.seqs
            )
            assert all(g == w[: len(g)] for g, w in zip(got, want))
        else:
            assert got == want, rid
    assert_deltas_match_outputs(eng)
    eng.assert_all_free()


def assert_deltas_match_outputs(eng: FakeEngine) -> None:
    """Each sample's reported tokens are exactly its outputs (no extra token, none lost), a
    finish reason comes with its last token only, and nothing follows a finished delta."""
    reported: dict[tuple[str, int], list[SampleDelta]] = defaultdict(list)
    finished: set[str] = set()
    for d in eng.deltas:
        assert d.request_id not in finished, f"{d.request_id}: a delta after its final one"
        if d.finished:
            finished.add(d.request_id)
        for sd in d.samples:
            reported[(d.request_id, sd.index)].append(sd)
    for rid, req in eng.requests.items():
        for seq in req.seqs:
            got = reported[(rid, seq.index)]
            assert [sd.token_id for sd in got] == seq.output_token_ids, (rid, seq.index)
            reasons = [sd.finish_reason for sd in got]
            assert all(r is None for r in reasons[:-1])
            if rid not in eng.aborted and seq.status is not SequenceStatus.FINISHED_ABORTED:
                assert reasons and reasons[-1] == seq.status.finish_reason


# ---- update: the token-level half of a step ------------------------------------------------
EOS = 2


def _sched(num_blocks: int = 32, **cfg) -> Scheduler:
    cfg.setdefault("max_model_len", 64)
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, BS, True, 0), frozenset({EOS}))


def _step_with(sched: Scheduler, tokens: dict[str, int | list[int]]) -> list[RequestDelta]:
    """Run schedule(), 'sample' the given token for each request (a list: per sample index)
    and return update()'s deltas."""
    out = sched.schedule()
    sampled = {}
    for e in out.scheduled:
        if e.sample:
            t = tokens[e.request_id]
            seq = next(q for q in sched.get_request(e.request_id).seqs if q.seq_id == e.seq_id)
            sampled[e.seq_id] = SampledToken(t[seq.index] if isinstance(t, list) else t, -0.5, None)
    return sched.update(out, ModelRunnerOutput(sampled, {}))


@pytest.mark.parametrize(
    ("params", "tokens", "reason", "stop_reason", "n_out"),
    [
        (dict(max_tokens=10), [5, 6, EOS, 7], "stop", None, 3),
        (dict(max_tokens=10, ignore_eos=True), [5, EOS, 6], "length", None, 10),
        (dict(max_tokens=10, stop_token_ids=(6,)), [5, 6, 7], "stop", 6, 2),
        (dict(max_tokens=10, min_tokens=3, stop_token_ids=(6,)), [EOS, 6, 6, 6], "stop", 6, 3),
        (dict(max_tokens=3), [5], "length", None, 3),
        (dict(max_tokens=None), [5], "length", None, 64 - 5),  # max_model_len
    ],
)
def test_update_applies_the_token_level_stops(params, tokens, reason, stop_reason, n_out):
    sched = _sched()
    sched.add_request(Request("r", tuple(prompt(5)), SamplingParams(**params)))
    got: list[SampleDelta] = []
    steps = 0
    while sched.has_unfinished_requests():
        tok = tokens[min(steps, len(tokens) - 1)]
        deltas = _step_with(sched, {"r": tok})
        steps += 1
        assert len(deltas) == 1 and deltas[0].request_id == "r"
        assert (deltas[0].first_scheduled is not None) == (steps == 1)
        got += deltas[0].samples
    assert len(got) == n_out and all(d.logprob == -0.5 for d in got)
    assert [d.finish_reason for d in got] == [None] * (n_out - 1) + [reason]
    assert got[-1].stop_reason == stop_reason and deltas[0].finished
    assert sched.get_request("r") is None and sched.bm.num_free_blocks == sched.bm.num_usable_blocks


def test_stop_sample_finishes_one_sample_and_the_rest_run_on():
    sched = _sched()
    sched.add_request(Request("r", tuple(prompt(6)), SamplingParams(n=3, max_tokens=4)))
    deltas = _step_with(sched, {"r": [10, 11, 12]})  # the prompt but its last token
    assert deltas[0].samples == () and deltas[0].first_scheduled is not None
    deltas = _step_with(sched, {"r": [10, 11, 12]})  # forked: each sample's first token
    assert sorted(d.index for d in deltas[0].samples) == [0, 1, 2] and deltas[0].first_scheduled is None
    sched.stop_sample("r", 1)  # the front end matched a stop string in sample 1
    sched.stop_sample("r", 1)  # idempotent
    seen = []
    while sched.has_unfinished_requests():
        seen += [d.index for d in _step_with(sched, {"r": [10, 11, 12]})[0].samples]
    assert sorted(seen) == [0, 0, 0, 2, 2, 2]
    assert sched.get_request("r") is None  # forgotten, nothing held
    assert sched.bm.num_free_blocks == sched.bm.num_usable_blocks
    sched.stop_sample("r", 0)  # unknown now: ignored


def test_update_registers_computed_blocks_with_the_prefix_cache():
    sched = _sched()
    shared = tuple(prompt(9))  # two full blocks of 4, then one token
    sched.add_request(Request("a", shared, SamplingParams(max_tokens=8)))
    _step_with(sched, {"a": 5})  # the prompt's KV is written by this executed step
    assert sched.bm.match_prefix(shared) == 8  # both full blocks are reusable now
    sched.add_request(Request("b", shared, SamplingParams(max_tokens=1)))
    deltas = _step_with(sched, {"a": 5, "b": 6})
    assert {d.request_id for d in deltas} == {"a", "b"}
    assert sched.stats().prefix_cache_hits >= 8


def test_a_step_aborted_request_comes_back_as_a_delta_with_the_reason():
    sched = _sched(num_blocks=6)  # 5 usable
    sched.bm.allocate(-1, prompt(12), 12)  # 3 blocks held outside the scheduler
    sched.add_request(Request("r", tuple(prompt(7)), SamplingParams(max_tokens=5)))
    _step_with(sched, {"r": 5})  # prompt 0..6: 2 blocks, the cache is now full
    _step_with(sched, {"r": 5})  # position 7 still fits the second block
    deltas = _step_with(sched, {"r": 5})  # position 8 needs a block that can never come
    assert [(d.request_id, d.finished) for d in deltas] == [("r", True)]
    assert "can no longer fit the KV cache" in deltas[0].abort_reason
    assert not sched.has_unfinished_requests()


# ---- asynchronous scheduling: one step in flight -----------------------------------------------
def _appearances(eng: FakeEngine, seq_id: int) -> int:
    return sum(e.seq_id == seq_id for out in eng.history for e in out.scheduled)


def test_pipelined_decode_feeds_the_placeholder_and_counts_the_pending_token():
    eng = FakeEngine(num_blocks=16, pipelined=True)
    seq = eng.add("r", prompt(5), max_tokens=3).seqs[0]
    eng.step()  # the prompt; its token is in flight
    assert seq.num_pending == 1 and seq.output_token_ids == []
    out = eng.step()  # the next decode is scheduled before update() has that token
    (e,) = out.scheduled
    assert e.token_ids == (PLACEHOLDER_TOKEN,) and e.start_pos == 5 and e.output_index == 1
    assert len(seq.output_token_ids) == 1 and seq.num_pending == 1  # step 1 known, step 2 not
    eng.run()
    assert eng.outputs("r") == eng.expected("r")
    # prompt + 2 decodes: the third token is the last (max_tokens), so no step computes it
    assert _appearances(eng, seq.seq_id) == 3
    assert_deltas_match_outputs(eng)
    eng.assert_all_free()


def test_pipelined_max_tokens_1_is_scheduled_once():
    eng = FakeEngine(num_blocks=16, pipelined=True)
    seq = eng.add("r", prompt(6), max_tokens=1).seqs[0]
    eng.run()
    assert eng.outputs("r") == eng.expected("r") and _appearances(eng, seq.seq_id) == 1
    eng.assert_all_free()


def test_pipelined_stop_drops_the_extra_token_computed_after_it():
    # Find a prompt whose second generated token is a stop token of the fake model.
    p = next(prompt(7, start) for start in range(VOCAB)
             if reference(tuple(prompt(7, start)), 10, 0, True, 256)[1:2]
             and reference(tuple(prompt(7, start)), 10, 0, True, 256)[1] % STOP_MOD == 0)
    eng = FakeEngine(num_blocks=16, pipelined=True)
    seq = eng.add("r", p, max_tokens=10, stops=True).seqs[0]
    eng.run()
    assert eng.outputs("r") == eng.expected("r") and len(seq.output_token_ids) == 2
    # prompt, the decode that sampled the stop token, and one more already in flight when
    # the stop became known: its token was computed but never reported
    assert _appearances(eng, seq.seq_id) == 3
    assert_deltas_match_outputs(eng)
    eng.assert_all_free()


def test_pipelined_abort_in_flight_drops_its_tokens_and_frees_blocks():
    eng = FakeEngine(num_blocks=16, pipelined=True)
    eng.add("a", prompt(9), max_tokens=8)
    eng.add("b", prompt(5, 40), max_tokens=8)
    eng.step()
    eng.step()  # a and b are both in flight
    kept = len(eng.requests["a"].seqs[0].output_token_ids)
    eng.sched.abort_request("a")
    eng.aborted.add("a")
    eng.run()
    assert eng.outputs("a") == [eng.expected("a")[0][:kept]]
    assert eng.outputs("b") == eng.expected("b")
    assert_deltas_match_outputs(eng)
    eng.assert_all_free()


def test_pipelined_step_abort_is_reported_once():
    eng = FakeEngine(num_blocks=6, pipelined=True)  # 5 usable
    eng.bm.allocate(-1, prompt(12), 12)  # 3 blocks held outside the scheduler
    eng.add("r", prompt(7), max_tokens=5)
    while eng.sched.has_unfinished_requests() or eng.in_flight:
        eng.step()
    finals = [d for d in eng.deltas if d.finished]
    assert [d.request_id for d in finals] == ["r"]
    assert "can no longer fit the KV cache" in finals[0].abort_reason


def test_needs_sync_while_a_request_needs_host_tokens():
    sched = _sched()
    assert not sched.needs_sync()
    sched.add_request(Request("plain", tuple(prompt(5)), SamplingParams(max_tokens=4)))
    assert not sched.needs_sync()
    sched.add_request(Request("pen", tuple(prompt(6)), SamplingParams(max_tokens=4, presence_penalty=0.5)))
    assert sched.needs_sync()
    sched.abort_request("pen")
    assert not sched.needs_sync()
    sched.abort_request("plain")
    sched.add_request(Request("pen2", tuple(prompt(6)), SamplingParams(max_tokens=2, repetition_penalty=1.2)))
    while sched.has_unfinished_requests():
        _step_with(sched, {"pen2": 5})
    assert not sched.needs_sync()  # finished requests no longer count


def test_needs_sync_follows_a_stand_in_condition(monkeypatch):
    # The structured-output helper adds ``SamplingParams.structured``; any params for which
    # needs_host_tokens holds must make the scheduler ask for the in-flight step first.
    import core.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "needs_host_tokens", lambda p, penalty_state=False: p.max_tokens == 7)
    sched = _sched()
    sched.add_request(Request("x", tuple(prompt(5)), SamplingParams(max_tokens=7)))
    assert sched.needs_sync()
    sched.schedule()  # the prompt; its token in flight
    with pytest.raises(RuntimeError, match="needs_sync"):
        sched.schedule()  # scheduling on without update() would lose the token's host copy
