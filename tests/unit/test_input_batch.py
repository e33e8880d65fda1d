"""The persistent batch (core/input_batch.py) against a from-scratch rebuild of every step.

Random step sequences add and drop sequences, append blocks, rewrite a last block (as
copy-on-write does), preempt and re-admit; each step's metadata must equal what a plain
rebuild from the schedule's Python lists gives (the way the runner built it before).
Then the placeholder token: a decode row scheduled with -1 must give the same logits and
tokens as the same row scheduled with the real id.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import msgspec
import numpy as np
import pytest
import torch

from core import LLM
from core.input_batch import PLACEHOLDER_TOKEN, PersistentBatch
from core.sampling_params import SamplingParams
from core.scheduler import ScheduledSequence, SchedulerOutput

BS = 4
PARAMS = SamplingParams(temperature=0.0)


def rebuilt(seqs: list[ScheduledSequence], num_prefills: int) -> dict:
    """Step inputs from scratch: the reference the persistent batch must reproduce."""
    ids, pos, slots = [], [], []
    width = max(len(s.block_table) for s in seqs)
    tables = [list(s.block_table) + [0] * (width - len(s.block_table)) for s in seqs]
    for s in seqs:
        for j, t in enumerate(s.token_ids):
            p = s.start_pos + j
            ids.append(t)
            pos.append(p)
            slots.append(s.block_table[p // BS] * BS + p % BS)
    qsl = [0, *itertools.accumulate(len(s.token_ids) for s in seqs)]
    return dict(
        ids=ids, pos=pos, slots=slots, tables=tables, qsl=qsl,
        seq_lens=[s.start_pos + len(s.token_ids) for s in seqs],
        ctx=[s.start_pos for s in seqs],
        num_prefill_tokens=qsl[num_prefills], num_decode_tokens=len(seqs) - num_prefills,
    )


def observed(step) -> dict:
    md = step.metadata
    return dict(
        ids=step.input_ids.tolist(), pos=step.positions.tolist(),
        slots=md.slot_mapping.tolist(), tables=md.block_tables.tolist(),
        qsl=md.query_start_loc.tolist(), seq_lens=md.seq_lens.tolist(),
        ctx=md.context_lens.tolist(), num_prefill_tokens=md.num_prefill_tokens,
        num_decode_tokens=md.num_decode_tokens,
    )


@dataclasses.dataclass
class _Seq:
    seq_id: int
    blocks: list[int]
    length: int  # tokens in the cache


def _random_steps(seed: int, steps: int):
    """Yield (scheduled, num_prefills, preempted) for a random workload over fresh block ids."""
    rng = random.Random(seed)
    next_block, next_id = itertools.count(1), itertools.count()
    live: list[_Seq] = []
    for _ in range(steps):
        preempted = []
        if live and rng.random() < 0.15:  # preempt one: it comes back with new blocks
            victim = rng.choice(live)
            preempted.append(victim.seq_id)
            victim.blocks, victim.length = [], 0
        if live and rng.random() < 0.2:
            live.remove(rng.choice(live))
        while len(live) < rng.randint(1, 9):
            live.append(_Seq(next(next_id), [], 0))
        prefills, decodes = [], []
        for s in live:
            if s.seq_id in preempted and rng.random() < 0.5:
                continue  # not scheduled this step
            if rng.random() < 0.1:
                continue  # a running sequence left out of a step (token budget)
            n = rng.randint(2, 11) if s.length == 0 or rng.random() < 0.2 else 1
            need = -(-(s.length + n) // BS)
            s.blocks += [next(next_block) for _ in range(need - len(s.blocks))]
            if s.blocks and rng.random() < 0.05:
                s.blocks[-1] = next(next_block)  # copy-on-write moved the last block
            toks = tuple(rng.randrange(1000) for _ in range(n))
            row = ScheduledSequence(
                seq_id=s.seq_id, request_id=str(s.seq_id), token_ids=toks, start_pos=s.length,
                block_table=tuple(s.blocks), sample=True, params=PARAMS, output_index=0,
            )
            (prefills if n > 1 else decodes).append(row)
            s.length += n
        if prefills or decodes:
            yield prefills + decodes, len(prefills), preempted


class _SeparateCopy(PersistentBatch):
    """Keeps its device table apart from the host mirror, as on an accelerator (on the CPU
    the two are one tensor), so the by-difference updates of the device copy are tested."""

    def _grow(self, rows, blocks):
        super()._grow(rows, blocks)
        self._tables_dev = self._tables_dev.clone()
        self._shared = False


@pytest.mark.parametrize("cls", [PersistentBatch, _SeparateCopy])
@pytest.mark.parametrize("seed", range(5))
def test_persistent_rows_give_the_rebuilt_inputs_every_step(seed, cls):
    # Start small so that both limits are outgrown on the way.
    batch = cls(max_rows=2, max_blocks=2, block_size=BS, device=torch.device("cpu"), pin=False)
    steps = 0
    for seqs, num_prefills, preempted in _random_steps(seed, 80):
        step = batch.prepare(seqs, num_prefills, preempted)
        assert observed(step) == rebuilt(seqs, num_prefills)
        assert len(set(step.rows)) == len(seqs)
        assert torch.equal(batch._tables_dev, torch.from_numpy(batch._tables))
        steps += 1
    assert steps > 50


@pytest.mark.parametrize("cls", [PersistentBatch, _SeparateCopy])
def test_freed_rows_are_zeroed_before_reuse(cls):
    batch = cls(max_rows=4, max_blocks=8, block_size=BS, device=torch.device("cpu"), pin=False)
    long = ScheduledSequence(seq_id=1, request_id="a", token_ids=(1,) * 20, start_pos=0,
                             block_table=(5, 6, 7, 8, 9), sample=True, params=PARAMS, output_index=0)
    batch.prepare([long], 1)
    short = msgspec.structs.replace(long, seq_id=2, token_ids=(1,), block_table=(3,))
    other = msgspec.structs.replace(long, seq_id=3, token_ids=(1,) * 9, block_table=(4, 10, 11))
    step = batch.prepare([other, short], 1)
    assert step.metadata.block_tables.tolist() == [[4, 10, 11], [3, 0, 0]]
    assert np.count_nonzero(batch._tables) == 4  # seq 1's row was cleared on the host too
    assert torch.count_nonzero(batch._tables_dev) == 4


def test_a_placeholder_needs_a_row_that_sampled_last_step():
    batch = PersistentBatch(max_rows=4, max_blocks=8, block_size=BS, device=torch.device("cpu"),
                            pin=False)
    row = ScheduledSequence(seq_id=7, request_id="r7", token_ids=(PLACEHOLDER_TOKEN,), start_pos=3,
                            block_table=(2,), sample=True, params=PARAMS, output_index=0)
    with pytest.raises(ValueError, match=r"request 'r7'.*placeholder token -1"):
        batch.prepare([row], 0)


def test_a_placeholder_is_refused_in_a_chunk_or_a_preempted_row_and_names_that_row():
    batch = PersistentBatch(max_rows=4, max_blocks=8, block_size=BS, device=torch.device("cpu"),
                            pin=False)
    rows = [ScheduledSequence(seq_id=i, request_id=f"r{i}", token_ids=(5,), start_pos=3, block_table=(2 + i,),
                              sample=True, params=PARAMS, output_index=0) for i in range(3)]
    step = batch.prepare(rows, 0)
    batch.record_sampled(step.rows, torch.tensor([11, 12, 13]))
    held = [msgspec.structs.replace(r, token_ids=(PLACEHOLDER_TOKEN,), start_pos=4) for r in rows]
    chunk = msgspec.structs.replace(held[1], token_ids=(9, PLACEHOLDER_TOKEN), start_pos=4)
    with pytest.raises(ValueError, match=r"request 'r1'"):
        batch.prepare([chunk, held[0], held[2]], 1)
    with pytest.raises(ValueError, match=r"request 'r2'"):
        batch.prepare(held, 0, preempted=[2])
    # refusals leave no trace: the same rows still take their placeholders
    assert batch.prepare(held, 0).input_ids.tolist() == [11, 12, 13]


def test_placeholder_decode_gives_the_real_token_logits_and_tokens(tiny_llama):
    llm = LLM(model=str(tiny_llama(seed=5)), dtype="float32", block_size=16,
              kv_cache_memory="16MiB", max_model_len=128)
    runner = llm.engine.executor.runner
    prompts = [[5, 9, 13, 2, 8, 40, 41], [100, 3, 7], [60, 61, 62, 63, 64, 65, 66, 67, 68]]
    seqs = [
        ScheduledSequence(seq_id=i, request_id=f"r{i}", token_ids=tuple(p), start_pos=0,
                          block_table=(i + 1,), sample=True, params=PARAMS, output_index=0)
        for i, p in enumerate(prompts)
    ]
    prefill = SchedulerOutput(tuple(seqs), 3, sum(map(len, prompts)))
    first = [runner.execute(prefill).sampled[i].token_id for i in range(3)]

    def decode(ids: list[int]) -> SchedulerOutput:
        rows = tuple(
            msgspec.structs.replace(s, token_ids=(t,), start_pos=len(s.token_ids), output_index=1)
            for s, t in zip(seqs, ids)
        )
        return SchedulerOutput(rows, 0, 3)

    def logits_of(sched: SchedulerOutput):
        with torch.inference_mode():
            input_ids, positions, md = runner.prepare_inputs(sched)
            hidden = runner.model(input_ids, positions, runner.kv_caches, md)
            return input_ids.tolist(), runner.model.compute_logits(hidden)

    # Mixed on purpose: the middle row carries its real id, the others the placeholder.
    sched_p = decode([PLACEHOLDER_TOKEN, first[1], PLACEHOLDER_TOKEN])
    sched_r = decode(first)
    ids_p, logits_p = logits_of(sched_p)
    ids_r, logits_r = logits_of(sched_r)
    assert ids_p == ids_r == first
    assert torch.equal(logits_p, logits_r)
    # A step prepared without sampling leaves no current token: the placeholder is refused
    # until a step samples again (the prefill rerun writes the same cache entries).
    with pytest.raises(ValueError, match="placeholder"):
        runner.execute(sched_p)
    assert [runner.execute(prefill).sampled[i].token_id for i in range(3)] == first
    tokens_p = {k: v.token_id for k, v in runner.execute(sched_p).sampled.items()}
    tokens_r = {k: v.token_id for k, v in runner.execute(sched_r).sampled.items()}
    assert tokens_p == tokens_r == dict(enumerate(logits_r.argmax(-1).tolist()))
    llm.engine.shutdown()
