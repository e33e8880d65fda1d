"""Host-side input preparation of decode steps: the persistent batch against a rebuild.

``python -m core.benchmarks.prepare_inputs --batches 1 64 256 --context 1024``

Each timed step is the next decode step of ``batch`` sequences (one token appended, a block
appended every ``block_size`` steps), the way the engine advances. ``persistent`` is
:class:`core.input_batch.PersistentBatch` (what the runner uses); ``rebuild`` is how the
runner built the same inputs before it (Python lists of every block table flattened into
fresh arrays each step), kept here as the baseline. Both end with their tensors on
``--device`` (the platform's torch device; synchronised after each step).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time

import numpy as np
import torch

from core.input_batch import PersistentBatch
from core.sampling_params import SamplingParams
from core.scheduler import ScheduledSequence


def rebuild(seqs, num_prefills: int, block_size: int, device: torch.device):
    """The runner's former ``prepare_inputs``: every array rebuilt from the schedule."""
    n = len(seqs)
    qlens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=n)
    starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=n)
    qsl = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(qlens, out=qsl[1:])
    ids = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64, count=int(qsl[-1]))
    seq_of_token = np.repeat(np.arange(n), qlens)
    positions = starts[seq_of_token] + (np.arange(int(qsl[-1])) - qsl[seq_of_token])
    nblocks = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=n)
    tables = np.zeros((n, int(nblocks.max())), dtype=np.int64)
    tables[np.arange(tables.shape[1]) < nblocks[:, None]] = np.fromiter(
        itertools.chain.from_iterable(s.block_table for s in seqs),
        dtype=np.int64, count=int(nblocks.sum()),
    )
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    seq_lens = starts + qlens
    out = [ids, positions, slots, seq_lens.astype(np.int32), starts.astype(np.int32),
           qsl.astype(np.int32), tables.astype(np.int32)]
    _ = tuple(seq_lens.tolist()), tuple(starts.tolist())
    return [torch.from_numpy(a).to(device, non_blocking=True) for a in out]


def decode_steps(batch: int, context: int, block_size: int, steps: int):
    """``steps`` consecutive decode schedules of ``batch`` sequences from ``context``."""
    params = SamplingParams(temperature=0.0)
    per = -(-(context + steps) // block_size)
    tables = [tuple(range(1 + i * per, 1 + (i + 1) * per)) for i in range(batch)]
    for k in range(steps):
        pos = context - 1 + k
        used = pos // block_size + 1
        yield [
            ScheduledSequence(seq_id=i, request_id=str(i), token_ids=((7 * i + k) % 1000,),
                              start_pos=pos, block_table=tables[i][:used], sample=True,
                              params=params, output_index=k)
            for i in range(batch)
        ]


def measure(batch: int, ns, device: torch.device, sync) -> dict:
    warm = 3
    scheds = list(decode_steps(batch, ns.context, ns.block_size, warm + ns.steps))
    pb = PersistentBatch(batch, -(-(ns.context + warm + ns.steps) // ns.block_size),
                         ns.block_size, device, pin=ns.pin)
    row = {"batch": batch, "context": ns.context}
    for name, fn in (
        ("persistent", lambda s: pb.prepare(s, 0)),
        ("rebuild", lambda s: rebuild(s, 0, ns.block_size, device)),
    ):
        times = []
        for i, s in enumerate(scheds):
            t0 = time.perf_counter()
            fn(s)
            sync()
            if i >= warm:
                times.append(time.perf_counter() - t0)
        row[f"{name}_ms"] = round(statistics.median(times) * 1e3, 4)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", default="cpu")
    p.add_argument("--pin", action="store_true", help="page-locked staging (accelerators)")
    ns = p.parse_args(argv)
    device = torch.device(ns.device)
    # torch.<device type>.synchronize where the backend module has one (a no-op on the host)
    sync = getattr(getattr(torch, device.type, None), "synchronize", None) or (lambda: None)
    for b in ns.batches:
        print(json.dumps(dataclasses.asdict(_Row(**measure(b, ns, device, sync)))), flush=True)
    return 0


@dataclasses.dataclass
class _Row:
    batch: int
    context: int
    persistent_ms: float
    rebuild_ms: float


if __name__ == "__main__":
    raise SystemExit(main())
