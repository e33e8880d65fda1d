"""The persistent batch on the GPU (page-locked staging): every step's inputs equal the
from-scratch rebuild, and a step that grows nothing never waits for the device.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/cuda/test_cuda_input_batch.py``.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from core.input_batch import PLACEHOLDER_TOKEN, PersistentBatch
from tests.unit.test_input_batch import BS, _random_steps, observed, rebuilt

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.mark.parametrize("seed", range(3))
def test_device_rows_give_the_rebuilt_inputs(seed):
    batch = PersistentBatch(max_rows=2, max_blocks=2, block_size=BS,
                            device=torch.device("cuda"), pin=True)
    for seqs, num_prefills, preempted in _random_steps(seed, 60):
        step = batch.prepare(seqs, num_prefills, preempted)
        assert observed(step) == rebuilt(seqs, num_prefills)
        assert torch.equal(batch._tables_dev.cpu(), torch.from_numpy(batch._tables))


def test_a_step_does_not_wait_for_the_device():
    # Room enough that nothing grows (growing copies the table with a blocking copy).
    batch = PersistentBatch(max_rows=64, max_blocks=512, block_size=BS,
                            device=torch.device("cuda"), pin=True)
    steps = list(_random_steps(7, 40))
    for seqs, num_prefills, preempted in steps[:5]:  # warm-up: allocator and pinned pools
        batch.prepare(seqs, num_prefills, preempted)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for seqs, num_prefills, preempted in steps[5:]:
            step = batch.prepare(seqs, num_prefills, preempted)
        last = seqs
        batch.record_sampled(list(step.rows), torch.arange(len(last), device="cuda") + 100)
        # Next step: every row decodes its sampled token, which never left the device.
        nxt = []
        for i, s in enumerate(last):
            pos = s.start_pos + len(s.token_ids)
            extra = (10_000 + i,) if pos + 1 > len(s.block_table) * BS else ()
            nxt.append(msgspec.structs.replace(s, token_ids=(PLACEHOLDER_TOKEN,), start_pos=pos,
                                               block_table=s.block_table + extra))
        step = batch.prepare(nxt, 0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert step.input_ids.tolist() == [100 + i for i in range(len(last))]
    assert observed(step)["slots"] == rebuilt(nxt, 0)["slots"]
