"""The offline engine's host work per step at many decode rows, on the CPU: a tiny random Llama
(one layer, hidden size 32, so the forward is cheap and the step is mostly the engine's own
Python), N prompts of 16 tokens, M output tokens each (EOS ignored), all queued at once, greedy
by default. Prints the wall time per engine step and the median of each timed part over the
steady steps: ``schedule`` (Scheduler.schedule), ``launch`` (the in-process executor: input
preparation, forward, sampling), of which ``launch.prepare`` and ``launch.sample``, ``update``
(Scheduler.update) and ``outputs`` (OutputProcessor.process). docs/benchmarks/scheduler.md.

    PYTHONPATH=. python3 docs/benchmarks/host_loop_cpu.py [N=500] [M=200] [TEMPERATURE=0]
"""

import collections
import functools
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from core.entrypoints.llm import LLM
from core.sampling_params import SamplingParams
from tests.helpers import tiny_llama_dir

seqs = int(sys.argv[1]) if len(sys.argv) > 1 else 500
out_len = int(sys.argv[2]) if len(sys.argv) > 2 else 200
temperature = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
path = tiny_llama_dir(Path(tempfile.mkdtemp()), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=512)
llm = LLM(model=str(path), max_num_seqs=512, max_num_batched_tokens=8192, max_model_len=512, dtype="float32")
engine = llm.engine
times = collections.defaultdict(list)


def timed(obj, name: str, label: str) -> None:
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[label].append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)


runner = engine.core.executor.runner
for obj, name, label in ((engine.core.scheduler, "schedule", "schedule"), (engine.core.executor, "launch", "launch"),
                         (runner, "_prepare", "launch.prepare"), (runner, "_sample", "launch.sample"),
                         (engine.core.scheduler, "update", "update"), (engine.output_processor, "process", "outputs")):
    timed(obj, name, label)
rng = random.Random(0)
prompts = [[rng.randrange(10, 500) for _ in range(16)] for _ in range(seqs)]
params = SamplingParams(temperature=temperature, max_tokens=out_len, ignore_eos=True)
t0 = time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
elapsed = time.perf_counter() - t0
print(f"{seqs} x 16/{out_len}, temperature {temperature}: {elapsed:.2f} s, {elapsed / out_len * 1e3:.2f} ms a step; "
      + ", ".join(f"{k} {statistics.median(v[20:-20] or v) * 1e3:.3f}" for k, v in times.items()) + " (ms, medians)")
