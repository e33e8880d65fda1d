"""The scheduler with a runner that keeps the penalty state (``Scheduler(penalty_state=True)``).

The runner's :class:`~core.sampler.penalties.PenaltyState` keeps each penalised sequence's
prompt flags and output counts from the first sampled step on, so the scheduler sends that
history only when a sequence joins the state (admission, resume after a preemption, the
first step after it was left out of one) and penalty requests do not make the
asynchronous loop wait (``needs_sync``). ``StateEngine`` is test_scheduler's
``FakeEngine`` with a real ``PenaltyState`` fed each schedule exactly as the model runner
feeds it (``begin_step``, ``slots`` for the sampled rows, ``record`` of the sampled ids).
At every sampled row it checks the state's words against the sequence's true history, and
that the row carries history exactly when it joins the state: a missing history at a join
makes ``slots`` raise, a history sent to a sequence the state holds fails the check.
"""

from __future__ import annotations

import pickle
import random
from collections import Counter, defaultdict

import msgspec
import numpy as np
import pytest
import torch

from core.block_manager import BlockManager
from core.config import SchedulerConfig
from core.executor.startup import StartupReport, agree_penalty_state
from core.kv_plan import plan_kv_cache
from core.request import PLACEHOLDER_TOKEN, Request
from core.sampler.penalties import COUNT_MASK, PROMPT_BIT, PenaltyState
from core.sampler.rows import Staging
from core.sampling_params import SamplingParams
from core.scheduler import Scheduler, SchedulerOutput
from core.structured_output.spec import GrammarSpec
from tests.unit.test_scheduler import VOCAB, FakeEngine, assert_deltas_match_outputs, prompt

PEN = dict(repetition_penalty=1.3, presence_penalty=0.5)


class StateEngine(FakeEngine):
    def __init__(self, *args, penalty_state: bool = True, **kw):
        super().__init__(*args, **kw)
        self.sched = Scheduler(self.cfg, self.bm, penalty_state=penalty_state)
        self.state = PenaltyState(VOCAB, torch.device("cpu"), Staging())
        self.history_rows: Counter[int] = Counter()
        """seq id -> penalised rows that carried its history (= its joins)."""
        self.penalty_placeholders = 0
        """Penalised rows fed a placeholder (their previous token still in flight)."""
        self.synced = 0
        """Steps scheduled while needs_sync() was true."""

    def step(self) -> SchedulerOutput | None:
        self.synced += self.sched.needs_sync()
        return super().step()

    def _execute(self, out: SchedulerOutput):
        self.state.begin_step([e.seq_id for e in out.scheduled], out.preempted)
        for e in out.scheduled:
            if not e.params.needs_token_history:
                continue
            joins = e.sample and not self.state.holds(e.seq_id)
            carries = bool(e.prompt_token_ids or e.output_token_ids)
            assert carries == joins, f"seq {e.seq_id}: history {carries}, joins the state {joins}"
            self.history_rows[e.seq_id] += carries
            self.penalty_placeholders += PLACEHOLDER_TOKEN in e.token_ids
        rows = [e for e in out.scheduled if e.sample]
        slots = self.state.slots(rows)  # raises for a joining row without its whole history
        result = super()._execute(out)
        for e, slot in zip(rows, slots):
            if slot >= 0:
                seq = self.seq(e.seq_id)
                # What the draw must see: the prompt and every output token before this one.
                outputs = self.truth[e.seq_id][seq.num_prompt_tokens:-1]
                want = np.zeros(VOCAB, dtype=np.int64)
                want[list(set(seq.prompt_token_ids))] = PROMPT_BIT
                np.add.at(want, outputs, 1)
                got = self.state.table[slot, :VOCAB].numpy()
                assert (got == want).all(), f"seq {e.seq_id}: the penalty state differs from its history"
                assert (got & COUNT_MASK).sum() == len(outputs)
        tokens = torch.tensor([result.sampled[e.seq_id].token_id for e in rows], dtype=torch.int64)
        self.state.record(slots, rows, tokens)
        return result


def _penalised(eng: FakeEngine) -> list[int]:
    return [s.seq_id for r in eng.requests.values() if r.params.needs_token_history for s in r.seqs]


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "async"])
def test_history_only_on_the_join_step_and_no_sync(pipelined):
    eng = StateEngine(num_blocks=64, pipelined=pipelined)
    eng.add("pen", prompt(5), max_tokens=6, **PEN)
    eng.add("plain", prompt(7, 30), max_tokens=6)
    eng.add("freq", prompt(9, 50), max_tokens=6, frequency_penalty=0.7)
    eng.add("n2", prompt(6, 70), max_tokens=5, n=2, **PEN)
    assert not eng.sched.needs_sync()  # penalties alone never make the loop wait
    eng.run()
    for rid in eng.requests:
        assert eng.outputs(rid) == eng.expected(rid), rid
    # Each penalised sequence (n=2: both samples) carried its history once: when it joined.
    penalised = _penalised(eng)
    assert len(penalised) == 4
    assert all(eng.history_rows[sid] == 1 for sid in penalised)
    assert eng.synced == 0
    # Async: the penalised decodes were scheduled with their previous token in flight.
    assert (eng.penalty_placeholders > 0) == pipelined
    assert_deltas_match_outputs(eng)
    eng.assert_all_free()


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "async"])
def test_a_sequence_left_out_of_a_step_joins_again_with_its_history(pipelined):
    # A budget of 2 tokens: once the more important n=2 request forks, its two decodes
    # take the whole budget and leave the running one out (no preemption): the runner
    # drops its state, and the step that schedules it again must send its history.
    eng = StateEngine(num_blocks=64, pipelined=pipelined, max_num_batched_tokens=2, max_num_seqs=3,
                      policy="priority")
    low = eng.add("low", prompt(2), max_tokens=10, priority=1, **PEN).seqs[0]
    eng.run(arrivals={3: [(("high", prompt(2, 40), 3), dict(n=2, priority=0, **PEN))]})
    for rid in eng.requests:
        assert eng.outputs(rid) == eng.expected(rid), rid
    left_out = [i for i, out in enumerate(eng.history) if low.seq_id not in {e.seq_id for e in out.scheduled}]
    assert left_out and eng.sched.stats().num_preemptions == 0
    assert eng.history_rows[low.seq_id] == 2  # admission, and back after being left out
    assert all(eng.history_rows[s.seq_id] == 1 for s in eng.requests["high"].seqs)
    assert eng.synced == 0
    eng.assert_all_free()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_rejoin_with_their_history(mode):
    eng = StateEngine(num_blocks=9, num_host_blocks=16, pipelined=True, preemption_mode=mode,
                      max_model_len=32)  # 8 usable blocks of 4 for 3 sequences of up to 18 tokens
    for i in range(3):
        eng.add(f"r{i}", prompt(6, 20 * i + 1), max_tokens=12, **PEN)
    eng.run()
    for rid in eng.requests:
        assert eng.outputs(rid) == eng.expected(rid), rid
    assert eng.sched.stats().num_preemptions > 0
    assert sum(eng.history_rows.values()) > len(_penalised(eng))
    assert_deltas_match_outputs(eng)
    eng.assert_all_free()


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_workloads_with_penalties(mode, seed, pipelined):
    rng = random.Random(f"pen{mode}{seed}{pipelined}")
    eng = StateEngine(
        pipelined=pipelined,
        num_blocks=25,
        num_host_blocks=rng.choice([0, 8, 40]),
        max_num_batched_tokens=rng.choice([6, 24, 64]),
        max_num_seqs=rng.choice([4, 8]),
        max_model_len=64,
        preemption_mode=mode,
        policy=rng.choice(["fcfs", "priority"]),
    )
    arrivals: dict[int, list] = defaultdict(list)
    for i in range(20):
        pen = {} if rng.random() < 0.3 else dict(
            repetition_penalty=rng.choice([1.0, 1.2]), frequency_penalty=rng.choice([0.0, 0.4]),
            presence_penalty=rng.choice([0.0, -0.3, 0.5]))
        if pen and not SamplingParams(**pen).needs_token_history:
            pen["presence_penalty"] = 0.2
        kwargs = dict(n=rng.choice([1, 1, 2, 3]), priority=rng.randrange(3), arrival=float(i),
                      stops=rng.random() < 0.5, **pen)
        arrivals[rng.randrange(10)].append(((f"r{i}", prompt(rng.randrange(1, 30), rng.randrange(VOCAB)),
                                             rng.randrange(1, 20)), kwargs))
    to_abort = {f"r{i}": rng.randrange(25) for i in rng.sample(range(20), 3)}
    eng.run_arrivals(arrivals, to_abort)
    for rid in eng.requests:
        got, want = eng.outputs(rid), eng.expected(rid)
        if rid in eng.aborted:
            assert all(g == w[: len(g)] for g, w in zip(got, want))
        else:
            assert got == want, rid
    assert eng.synced == 0
    assert_deltas_match_outputs(eng)
    eng.assert_all_free()


def _plain(eng: FakeEngine, out: SchedulerOutput) -> tuple:
    """A schedule without its history fields, sequences named by (request, sample index)
    (sequence ids differ between engines)."""
    def name(sid: int) -> tuple[str, int]:
        seq = eng.seq(sid)
        return seq.request_id, seq.index

    rows = tuple((name(e.seq_id), *msgspec.structs.astuple(msgspec.structs.replace(
        e, seq_id=0, prompt_token_ids=(), output_token_ids=()))) for e in out.scheduled)
    return (rows, out.num_prefills, out.blocks_to_copy, out.blocks_to_swap_in, out.blocks_to_swap_out,
            tuple(name(s) for s in out.preempted), out.aborted)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_state_changes_nothing_but_the_history_fields(mode):
    # The same requests, step for step (the synchronous loop), with the state off and on:
    # identical schedules once the history fields are blanked, and with the state off
    # every sampled penalised row carries its whole history.
    runs = {}
    for state in (False, True):
        kind = StateEngine if state else FakeEngine  # FakeEngine: the host path, no state
        eng = kind(num_blocks=9, num_host_blocks=16, preemption_mode=mode, max_model_len=32,
                   max_num_batched_tokens=10)
        for i in range(4):
            eng.add(f"r{i}", prompt(3 + 2 * i, 20 * i + 1), max_tokens=10, n=1 + i % 2,
                    **(PEN if i % 3 else {}))
        assert eng.sched.needs_sync() is not state
        eng.run()
        runs[state] = eng
    off, on = runs[False], runs[True]
    assert [_plain(off, o) for o in off.history] == [_plain(on, o) for o in on.history]
    assert off.sched.stats().num_preemptions > 0
    for out in off.history:
        for e in out.scheduled:
            if e.sample and e.params.needs_token_history:
                assert len(e.output_token_ids) == e.output_index and e.prompt_token_ids
    for rid in on.requests:
        assert on.outputs(rid) == off.outputs(rid) == on.expected(rid)


def test_with_the_state_a_grammar_still_needs_sync():
    sched = Scheduler(SchedulerConfig(max_model_len=64), BlockManager(32, 4, True, 0), penalty_state=True)
    sched.add_request(Request("pen", tuple(prompt(6)), SamplingParams(max_tokens=4, **PEN)))
    assert not sched.needs_sync()
    grammar = SamplingParams(max_tokens=4, structured=GrammarSpec.of("regex", "[ab]+"), **PEN)
    sched.add_request(Request("both", tuple(prompt(5, 9)), grammar))
    assert sched.needs_sync()
    sched.schedule()  # both prompts; their tokens in flight
    with pytest.raises(RuntimeError, match="needs_sync"):
        sched.schedule()  # the grammar's matcher needs its token first
    sched.abort_request("both")
    assert not sched.needs_sync()


def test_the_executor_learns_the_choice_from_every_rank_s_start_up_report():
    # Reports cross process boundaries pickled (multiprocess pipes, Ray's object store).
    plan = plan_kv_cache(budget_bytes=1 << 20, bytes_per_block=4096, block_size=16, max_model_len=64)
    on = [pickle.loads(pickle.dumps(StartupReport(r, 1, None, plan, penalty_state=True))) for r in range(2)]
    assert agree_penalty_state(on) is True
    assert agree_penalty_state([StartupReport(0, 1, None, plan)]) is False  # the default: host path
    with pytest.raises(RuntimeError, match=r"rank 0 keeps the penalty state on the device \(True\), rank 1 \(False\)"):
        agree_penalty_state([on[0], StartupReport(1, 1, None, plan)])
