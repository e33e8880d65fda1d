"""Host time of ``Scheduler.schedule()`` and ``Scheduler.update()`` alone, with many
sequences decoding.

    python -m core.benchmarks.scheduler [--seqs 256] [--prompt-len 1000] [--output-len 400]

No model runs: after each step every sampled sequence gets a random token through
``Scheduler.update`` (as after a real step), and finishes at ``--output-len`` tokens. The
calls come in the engine's asynchronous order (step N+1 is scheduled before the update with
step N, so decode rows carry a placeholder token), or with ``--sync`` in the synchronous one.
Each update's deltas then go through the front end's ``OutputProcessor.process`` (final-only
outputs, no tokenizer: what the offline ``LLM`` does each step). Prefix caching is on (the
engine default). Prints the median and p90 time of one ``schedule()``, one ``update()`` and one
``process()`` call over the steps after the first 20 (the prefills).
"""

from __future__ import annotations

import argparse
import random
import time

from core.block_manager import BlockManager
from core.config import SchedulerConfig
from core.engine_core.types import EngineRequest
from core.model_runner import ModelRunnerOutput, SampledToken
from core.output_processor import OutputProcessor
from core.request import Request
from core.sampling_params import SamplingParams
from core.scheduler import Scheduler


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=400)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--sync", action="store_true", help="update with each step before the next is scheduled")
    args = ap.parse_args(argv)

    max_len = args.prompt_len + args.output_len
    config = SchedulerConfig(
        max_num_seqs=args.seqs, max_model_len=max_len, max_num_batched_tokens=max(8192, max_len)
    )
    blocks = args.seqs * -(-max_len // args.block_size) + 16
    scheduler = Scheduler(config, BlockManager(blocks, args.block_size, True, 0))
    rng = random.Random(0)
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    outputs = OutputProcessor(tokenizer=None)
    for i in range(args.seqs):
        prompt = tuple(rng.randrange(32000) for _ in range(args.prompt_len))
        scheduler.add_request(Request(f"r{i}", prompt, params))
        outputs.add_request(EngineRequest(f"r{i}", prompt, params), None, final_only=True)
    times, update_times, process_times = [], [], []

    def update(out) -> None:
        sampled = {e.seq_id: SampledToken(rng.randrange(32000), 0.0, None) for e in out.scheduled if e.sample}
        result = ModelRunnerOutput(sampled, {})
        t0 = time.perf_counter()
        deltas = scheduler.update(out, result)
        t1 = time.perf_counter()
        outputs.process(deltas)
        update_times.append(t1 - t0)
        process_times.append(time.perf_counter() - t1)

    in_flight = None
    for _ in range(args.steps):
        if args.sync and in_flight is not None:
            update(in_flight)
            in_flight = None
        t0 = time.perf_counter()
        out = scheduler.schedule()
        times.append(time.perf_counter() - t0)
        if in_flight is not None:
            update(in_flight)
        in_flight = out
    parts = []
    for name, samples in (("schedule()", times), ("update()", update_times), ("process()", process_times)):
        steady = sorted(samples[20:])
        parts.append(f"{name} median {steady[len(steady) // 2] * 1e3:.2f} ms, "
                     f"p90 {steady[int(len(steady) * 0.9)] * 1e3:.2f} ms")
    print(f"{args.seqs} sequences, prompts of {args.prompt_len}, {'sync' if args.sync else 'async'}: "
          f"{'; '.join(parts)} over {len(times) - 20} steps")


if __name__ == "__main__":
    main()
