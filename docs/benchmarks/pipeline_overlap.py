"""Pipeline parallelism on CPU: does keeping P micro-batches in flight overlap the stages?

Runs one ``-pp 2`` engine (two worker processes, gloo) on a random Llama and generates the
same greedy batch of 16 requests three ways, alternating, printing output tokens per
second of each:

* ``2 in flight, halves``: the default under ``-pp 2``: the scheduler gives each
  micro-batch half of the sequences and the engine core keeps two in flight;
* ``1 in flight, halves``: the same micro-batches, each waiting for the previous one
  (the cost of smaller batches, without the overlap);
* ``1 in flight, whole``: one batch of all 16, no overlap (what -pp 2 did before).

Usage (from the repository root):

    PYTHONPATH=. .venv/bin/python docs/benchmarks/pipeline_overlap.py [--rounds 3] [--hidden 512] [--prompt-len 32]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from core import LLM, SamplingParams
from tests.helpers import tiny_llama_dir


def run(llm: LLM, depth: int, split: int, prompts: list[list[int]], sp: SamplingParams) -> float:
    llm.engine.core.pipeline_depth = depth  # steps in flight
    llm.engine.scheduler.max_in_flight = split  # above 1: each step takes 1/split of the sequences
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    took = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / took


MODES = {"2 in flight, halves": (2, 2), "1 in flight, halves": (1, 2), "1 in flight, whole": (1, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_llama_dir(Path(tmp), seed=0, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                              num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=8)
        llm = LLM(model=str(path), platform="cpu", dtype="float32", pipeline_parallel_size=2,
                  kv_cache_memory="64MiB", max_model_len=256)
        prompts = [[(7 * i + j) % 500 + 3 for j in range(args.prompt_len)] for i in range(16)]
        sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        try:
            run(llm, 2, 2, prompts, sp)  # warm-up
            for r in range(args.rounds):
                rates = {mode: run(llm, *how, prompts, sp) for mode, how in MODES.items()}
                print(f"round {r}: " + "; ".join(f"{m} {v:.1f} tok/s" for m, v in rates.items()), flush=True)
        finally:
            llm.engine.shutdown()


if __name__ == "__main__":
    main()
