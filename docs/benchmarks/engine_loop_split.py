"""Where an engine step's time goes, inside the engine: wraps EngineCore's parts (schedule,
launch or execute, the wait for the previous step's tokens, update) with timers and counts
the steps and their shapes, for the asynchronous or the synchronous loop, on N x 1,024/128
random prompts (bf16, dummy weights; docs/benchmarks/cuda_e2e.md, 2026-12-02 afternoon).

    PYTHONPATH=. python3 docs/benchmarks/engine_loop_split.py /tmp/llama3-8b async 1000 cuda
    PYTHONPATH=. python3 docs/benchmarks/engine_loop_split.py /tmp/llama3-8b sync 1000 cuda

(the model directory from ``python3 -m core.benchmarks.shapes llama3-8b /tmp/llama3-8b``).
Prints one JSON line."""
import collections, json, random, sys, time
import torch
from core import LLM, SamplingParams

model, mode = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
plat = sys.argv[4] if len(sys.argv) > 4 else "cuda"
llm = LLM(model=model, load_format="dummy", dtype="bfloat16", platform=plat, max_model_len=2048,
          max_num_batched_tokens=8192, async_scheduling=(mode == "async"))
core = llm.engine.core
T = collections.defaultdict(float)
C = collections.Counter()
shape = collections.Counter()

def timed(name, fn):
    def w(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            T[name] += time.perf_counter() - t0
            C[name] += 1
    return w

class Handle:
    def __init__(self, h): self.h = h
    def result(self):
        t0 = time.perf_counter()
        r = self.h.result()
        T["result_wait"] += time.perf_counter() - t0
        return r

orig_sched = core._schedule
def sched():
    t0 = time.perf_counter()
    s = orig_sched()
    T["schedule"] += time.perf_counter() - t0
    dec = len(s.scheduled) - s.num_prefills
    shape["steps"] += 1
    shape["with_prefill" if s.num_prefills else "decode_only"] += 1
    shape["tokens"] += s.num_batched_tokens
    shape["decode_rows"] += dec
    shape["prefill_rows"] += s.num_prefills
    if not s.scheduled: shape["empty"] += 1
    return s
core._schedule = sched
orig_launch = core.executor.launch
core.executor.launch = lambda s: Handle(timed("launch", orig_launch)(s))
core.executor.execute = timed("execute", core.executor.execute)
core._update = timed("update", core._update)
core.step = timed("step", core.step)

rng = random.Random(0)
prompts = [[rng.randrange(10, 30000) for _ in range(1024)] for _ in range(n)]
params = SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True, seed=1)
llm.generate([[rng.randrange(10, 30000) for _ in range(1024)] for _ in range(8)], params, use_tqdm=False)  # warm-up, other prompts
T.clear(); C.clear(); shape.clear()
if plat == "cuda": torch.cuda.synchronize()
t0 = time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
wall = time.perf_counter() - t0
out = dict(mode=mode, wall_s=round(wall, 3), req_per_s=round(n / wall, 2),
           times_s={k: round(v, 3) for k, v in T.items()}, calls=dict(C), shape=dict(shape))
print(json.dumps(out))
