"""Host cost of the engine-core IPC per step: encode a step's deltas in the engine core,
send them over a ZeroMQ ``ipc://`` pipe, decode them in the front end.

    python -m core.benchmarks.engine_ipc [--batch 256] [--steps 2000]

No model: each step is ``--batch`` RequestDeltas of one sampled token (what a decode step of
that many sequences returns), wrapped in the StepOutputs message the engine core sends.
Prints the median and p90 of encode, send+receive and decode, each per step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import msgspec
import zmq

from core.engine_core.process import Message, StepOutputs
from core.engine_core.types import RequestDelta, SampleDelta
from core.scheduler import SchedulerStats


def _step(batch: int, k: int) -> StepOutputs:
    deltas = [RequestDelta(f"cmpl-{i}-0", (SampleDelta(0, (k * 31 + i) % 50000, -0.25),)) for i in range(batch)]
    return StepOutputs(deltas, SchedulerStats(batch, 0, 0, 0.5, 0, 0, 0))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args(argv)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Message)
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as d:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind(f"ipc://{d}/bench")
        push.connect(f"ipc://{d}/bench")
        times: dict[str, list[float]] = {"encode": [], "transfer": [], "decode": []}
        size = 0
        for k in range(args.steps):
            msg = _step(args.batch, k)
            t0 = time.perf_counter()
            data = enc.encode(msg)
            t1 = time.perf_counter()
            push.send(data)
            raw = pull.recv()
            t2 = time.perf_counter()
            out = dec.decode(raw)
            t3 = time.perf_counter()
            assert out == msg
            size = len(data)
            for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[name].append(dt)
        push.close(linger=0)
        pull.close(linger=0)
    ctx.term()
    parts = []
    for name, ts in times.items():
        ts = sorted(ts[len(ts) // 10:])  # drop warm-up
        parts.append(f"{name} median {statistics.median(ts) * 1e6:.0f} us, p90 {ts[int(len(ts) * 0.9)] * 1e6:.0f} us")
    print(f"batch {args.batch}, {size} bytes per step: " + "; ".join(parts))


if __name__ == "__main__":
    main()
