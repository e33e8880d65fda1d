"""The device penalty state (core/sampler/penalties.py) against the host-built penalties.

``Sampler(penalty_state=True)`` keeps each penalised sequence's output counts and prompt
flags in a device table, filled once when the sequence joins and counted from the sampled
ids on the device. It must process logits exactly like the host-built path (the same float
operations: equal bit for bit) while never reading a continuing sequence's history again.
The decode-loop tests drive both samplers over many steps of a changing batch: rows with
and without penalties, sequences joining, finishing, preempted and resumed, n > 1 siblings,
rows reordered (moved in the persistent batch), padded copies of a row (static-shape
buckets), and, as asynchronous scheduling would give it, continuing rows whose host history
lags the in-flight token (or is left out altogether). Both the torch pipeline and the fused
kernel's own source (run on the host, tests/unit/sampler_kernel_host.py) are checked.
"""

from __future__ import annotations

import dataclasses
import random

import msgspec
import numpy as np
import pytest
import torch

from core.sampler import Sampler
from core.sampler.penalties import COUNT_MASK, PROMPT_BIT, PenaltyState, apply_dense
from core.sampler.processors import apply_penalties
from core.sampler.rows import SamplingBatch, Staging
from core.sampling_params import SamplingParams
from core.scheduler import ScheduledSequence
from tests.unit.sampler_kernel_host import HostKernel
from tests.unit.test_sampler_exact import EOS, _batch, _params


def _with_ids(rows):
    return [msgspec.structs.replace(r, seq_id=i) for i, r in enumerate(rows)]


def test_dense_penalties_equal_the_host_built_ones_bit_for_bit() -> None:
    # Random histories and penalty mixes (repetition, presence, frequency, negative ones),
    # rows without penalties in the same batch, random temperatures (the amounts scale).
    for seed in range(200):
        logits, rows = _batch(seed)
        rows = _with_ids(rows)
        g = torch.Generator().manual_seed(seed)
        inv_t = torch.rand(len(rows), generator=g) * 2 + 0.25
        want = logits.clone()
        batch = SamplingBatch.build(rows, logits.shape[1], logits.device, Staging())
        apply_penalties(want, rows, inv_t, batch)
        state = PenaltyState(logits.shape[1], logits.device, Staging())
        slots = state.slots(rows)
        got = logits.clone()
        batch = SamplingBatch.build(rows, logits.shape[1], logits.device, Staging(), slots)
        apply_dense(got, rows, slots, state.table, inv_t, batch)
        assert torch.equal(got, want), f"seed {seed}"
        for i, r in enumerate(rows):
            if not r.params.needs_token_history:  # untouched, bit for bit
                assert torch.equal(got[i], logits[i])


def test_sampler_with_state_gives_the_same_distribution_tokens_and_logprobs() -> None:
    for seed in range(120):
        logits, rows = _batch(seed)
        rows = _with_ids(rows)
        a = Sampler(frozenset({EOS}), seed=seed)
        b = Sampler(frozenset({EOS}), seed=seed, penalty_state=True)
        assert torch.equal(b.distribution(logits, rows), a.distribution(logits, rows)), seed
        assert b(logits, rows) == a(logits, rows), seed


def test_kernel_source_with_state_matches_its_edit_list_bit_for_bit() -> None:
    # The same float operations in the kernel: the state's words replace the edit list's
    # repetition flags and counts, so tokens and logprobs are identical, not just close.
    used = 0
    for seed in range(40):
        logits, rows = _batch(seed)
        rows = _with_ids(rows)
        ka, kb = HostKernel(8, seed), HostKernel(8, seed)
        a = Sampler(frozenset({EOS}), seed=seed, kernel=ka)
        b = Sampler(frozenset({EOS}), seed=seed, kernel=kb, penalty_state=True)
        assert b(logits, rows) == a(logits, rows), seed
        assert ka.calls == kb.calls == 1
        used += b.penalties is not None and b.penalties.num_slots > 0
    assert used >= 20


# ---- the decode loop -------------------------------------------------------------------------
@dataclasses.dataclass
class _Seq:
    seq_id: int
    request_id: str
    params: SamplingParams
    prompt: tuple[int, ...]
    output: list[int]
    slot_held: bool = False  # scheduled in the previous step and not preempted since


def _row(s: _Seq, output: tuple[int, ...]) -> ScheduledSequence:
    return ScheduledSequence(
        seq_id=s.seq_id, request_id=s.request_id, token_ids=(1,), start_pos=0, block_table=(0,),
        sample=True, params=s.params, output_index=len(s.output),
        prompt_token_ids=s.prompt, output_token_ids=output,
    )


def _decode_loop(seed: int, steps: int, vocab: int, make_kernel=None) -> Sampler:
    """Drives a host-path sampler and a state-path sampler over the same steps; returns the
    state-path one. Continuing rows give the state path a history that lags by the token in
    flight (asynchronous scheduling); rows that (re)join give both the whole history."""
    rng = random.Random(seed)
    kw = {} if make_kernel is None else {"kernel": make_kernel()}
    kb = {} if make_kernel is None else {"kernel": make_kernel()}
    host = Sampler(frozenset({EOS}), seed=seed, **kw)
    dev = Sampler(frozenset({EOS}), seed=seed, penalty_state=True, **kb)
    live: list[_Seq] = []
    next_id = 0

    def admit():
        nonlocal next_id
        p = _params(rng, vocab)
        if rng.random() < 0.6:  # most rows penalised, some not
            p = dataclasses.replace(p, repetition_penalty=rng.choice([1.3, 0.8, 1.0]),
                                    presence_penalty=rng.choice([0.0, 0.5, -0.7]),
                                    frequency_penalty=rng.choice([0.0, 0.4]))
        prompt = tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 12)))
        out = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]  # resumed after a pause
        siblings = 2 if rng.random() < 0.25 else 1  # n > 1: same prompt, own seq ids
        for _ in range(siblings):
            live.append(_Seq(next_id, f"req{next_id}", p, prompt, list(out)))
            next_id += 1

    for _ in range(4):
        admit()
    for step in range(steps):
        while len(live) < 3 or rng.random() < 0.2:
            admit()
        rng.shuffle(live)  # rows move in the persistent batch
        preempted = [s for s in live if rng.random() < 0.08]
        paused = [s for s in live if s not in preempted and rng.random() < 0.08]
        running = [s for s in live if s not in preempted and s not in paused]
        if not running:
            running, preempted, paused = live[:1], [], live[1:]
        dev.begin_step([s.seq_id for s in running], [s.seq_id for s in preempted])
        for s in preempted + paused:
            s.slot_held = False
        full = [_row(s, tuple(s.output)) for s in running]
        # A continuing row's history is not read again: it lags the in-flight token (what
        # asynchronous scheduling gives), or is left out altogether.
        bare = rng.random() < 0.3
        lagging = [
            (msgspec.structs.replace(_row(s, ()), prompt_token_ids=()) if bare else _row(s, tuple(s.output[:-1])))
            if s.slot_held and s.output else _row(s, tuple(s.output))
            for s in running
        ]
        if rng.random() < 0.25:  # padded to a bucket with copies of the last row
            extra = rng.randint(1, 3)
            full += [full[-1]] * extra
            lagging += [lagging[-1]] * extra
        g = torch.Generator().manual_seed(seed * 1000 + step)
        logits = torch.randn(len(full), vocab, generator=g) * rng.choice([1.0, 4.0])
        want = host(logits, full)
        got = dev(logits, lagging)
        assert got == want, f"seed {seed} step {step}"
        for s, t in zip(running, want.token_ids):
            s.output.append(t)
            s.slot_held = True
        for s in list(running):
            if rng.random() < 0.1:  # finished: never scheduled again
                live.remove(s)
    # The table holds exactly the history of every sequence that still has a slot.
    state = dev.penalties
    for s in live:
        slot = state._slot_of.get(s.seq_id)
        if slot is None:
            continue
        want_row = np.zeros(state.width, dtype=np.int64)
        want_row[list(s.prompt)] = PROMPT_BIT
        np.add.at(want_row, s.output, 1)
        assert np.array_equal(state.table[slot].numpy().astype(np.int64), want_row), s.seq_id
    return dev


@pytest.mark.parametrize("seed", range(6))
def test_decode_loop_matches_the_host_built_path(seed: int) -> None:
    dev = _decode_loop(seed, steps=40, vocab=rng_vocab(seed))
    assert dev.penalties is not None and dev.penalties.table.shape[0] >= 8


def rng_vocab(seed: int) -> int:
    return [50, 300, 1500][seed % 3]


@pytest.mark.parametrize("seed", range(2))
def test_decode_loop_through_the_kernel_source(seed: int) -> None:
    _decode_loop(100 + seed, steps=12, vocab=300, make_kernel=lambda: HostKernel(4, seed))


def test_the_state_is_counted_once_per_sampled_token_and_zeroed_on_reuse() -> None:
    vocab = 40
    state = PenaltyState(vocab, torch.device("cpu"), Staging())
    p = SamplingParams(temperature=0, frequency_penalty=0.5)
    s = _Seq(7, "r", p, (3, 3, 5), [5, 9])
    slots = state.slots([_row(s, (5, 9))] * 3)  # a row and two padded copies
    assert slots[0] == slots[1] == slots[2] >= 0
    state.record(slots, [_row(s, ())] * 3, torch.tensor([9, 1, 2]))
    row = state.table[slots[0]]
    assert int(row[3]) == PROMPT_BIT and int(row[5]) == PROMPT_BIT | 1 and int(row[9]) == 2
    assert int(row[1]) == 0 and int(row[2]) == 0  # the copies' draws are not counted
    assert int(row[9]) & COUNT_MASK == 2
    state.begin_step([], preempted=[])  # sequence 7 is gone
    assert state.num_slots == 0
    other = _Seq(8, "q", p, (1,), [])
    assert state.slots([_row(other, ())]) == [slots[0]]  # the slot is reused, zeroed
    assert state.table[slots[0]].tolist() == [0, PROMPT_BIT] + [0] * (state.width - 2)


def test_a_sequence_joins_only_with_its_whole_history() -> None:
    state = PenaltyState(100, torch.device("cpu"), Staging())
    p = SamplingParams(repetition_penalty=1.2)
    s = _Seq(1, "req-a", p, (4, 5), [6, 7, 8])
    lagging = msgspec.structs.replace(_row(s, (6, 7)), output_index=3)
    with pytest.raises(ValueError, match=r"request 'req-a', sequence 1.*2 prompt ids and 2 output ids for output_index 3"):
        state.slots([lagging])
    bad = _Seq(2, "req-b", p, (4, 100), [])
    with pytest.raises(ValueError, match=r"prompt contains token id\(s\) \[100\] outside the vocabulary of 100"):
        state.slots([_row(bad, ())])


def test_out_of_memory_names_the_sizes(monkeypatch) -> None:
    state = PenaltyState(128256, torch.device("cpu"), Staging())
    real = torch.zeros

    def no_memory(*shape, **kw):
        if kw.get("dtype") is torch.int32 and shape and shape[0] == (8, 128256):
            raise torch.OutOfMemoryError("simulated")
        return real(*shape, **kw)

    monkeypatch.setattr(torch, "zeros", no_memory)
    s = _Seq(1, "r", SamplingParams(presence_penalty=0.1), (1,), [])
    with pytest.raises(RuntimeError, match=r"8 sequences x 128256 tokens needs 4 MiB.*lower --max-num-seqs"):
        state.slots([_row(s, ())])


def test_without_the_option_or_with_a_kernel_that_cannot_read_it_the_host_path_runs() -> None:
    logits, rows = _batch(3)
    sampler = Sampler(frozenset({EOS}), seed=0)
    sampler(logits, _with_ids(rows))
    assert sampler.penalties is None
    from core.sampler.static import StaticShapeSampling
    static = Sampler(frozenset({EOS}), seed=0, kernel=StaticShapeSampling(), penalty_state=True)
    assert not static.penalty_state
