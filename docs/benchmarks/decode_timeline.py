"""Where a decode step's device time goes, in the engine's own loop: the device timeline of
``LLM.generate`` (kernels, copies and the idle gaps between them, CUDA graph replays
included) and the host's time per step, for each batch size of a comma-separated list.

    PYTHONPATH=. python3 docs/benchmarks/decode_timeline.py /tmp/llama3-8b 1,64 [OUT.json]

(the model directory from ``python3 -m core.benchmarks.shapes llama3-8b /tmp/llama3-8b``).
BATCH requests of 128 random prompt tokens generate 192 tokens each at temperature 1 (EOS
ignored); the profile covers the whole run and the summary the steady decode steps between
the 64th and the 160th output token. Per step: device busy time (union of kernel and copy
intervals), idle time, each kernel's time and count, and the host's split (schedule, launch,
waiting for the previous step's tokens, update). A kernel launched under programmatic
dependent launch starts before its predecessor ends, so its time includes that wait: compare
the wall time per step, not the kernel sums, between versions. Prints one JSON line per batch
(all of them also written to OUT).

    PYTHONPATH=. python3 docs/benchmarks/decode_timeline.py /tmp/llama3-8b thr:1000:1024:128 [OUT.json]

profiles the offline throughput workload instead (``core bench throughput``'s: PROMPTS random
prompts of IN tokens, OUT tokens each at temperature 1, max_num_batched_tokens 8192,
max_num_seqs 256 or a fifth field): only the engine steps from STEP0 to STEP1 (env
``TIMELINE_STEPS``, default ``150,250``: the steady mix of prefill chunks and decodes of the
1,024/128 run) are recorded, with each step's composition (prompt tokens, decode rows).

Env ``TIMELINE_ENGINE``: more engine arguments as a JSON object, e.g. ``{"quantization": "fp8"}``
(a quantized checkpoint's own ``quantization_config`` needs nothing). Env
``TIMELINE_HOST_PROFILE=1`` (throughput mode): profile the host instead, with cProfile over
the same steps: the functions with the most time per step (cProfile slows the host, so
compare the shares between versions, not the wall time)."""
import collections
import cProfile
import json
import os
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from core import LLM, SamplingParams

model, workload = sys.argv[1], sys.argv[2]
out_path = sys.argv[3] if len(sys.argv) > 3 else None
OUT_LEN, FIRST, LAST = 192, 64, 160
THROUGHPUT = workload.startswith("thr:")
engine_args = {}
if THROUGHPUT:
    n_prompts, in_len, out_len, *rest = (int(x) for x in workload[4:].split(":"))
    engine_args = {"max_num_batched_tokens": 8192, "max_num_seqs": rest[0] if rest else 256}
engine_args.update(json.loads(os.environ.get("TIMELINE_ENGINE", "{}")))  # e.g. {"quantization": "fp8"}
llm = LLM(model=model, load_format="dummy", dtype="bfloat16", platform="cuda", max_model_len=2048,
          **engine_args)
core = llm.engine.core
vocab = llm.engine.vocab_size
params = SamplingParams(temperature=1.0, max_tokens=OUT_LEN, ignore_eos=True, seed=1)

def timed(name, fn):
    def wrapper(*a, **k):
        with record_function(name):
            return fn(*a, **k)
    return wrapper


class Handle:
    def __init__(self, h):
        self.h = h

    def result(self):
        with record_function("wait_tokens"):
            return self.h.result()


core._schedule = timed("schedule", core._schedule)
launch = timed("launch", core.executor.launch)
core.executor.launch = lambda s: Handle(launch(s))
core._update = timed("update", core._update)
core.step = timed("engine_step", core.step)



def summarize(events, first: int, last: int) -> dict:
    """Per step over the engine steps first..last of the profile (host and device events
    share one clock)."""
    parts = ("schedule", "launch", "wait_tokens", "update", "engine_step")
    marks = sorted((e.time_range.start, e.time_range.end, e.name) for e in events if e.name in parts
                   and e.device_type == torch.autograd.DeviceType.CPU)
    steps = [m for m in marks if m[2] == "engine_step"]
    w0, w1 = steps[first][0], steps[last][0]
    n_steps = last - first
    host = collections.defaultdict(float)
    for a, b, name in marks:
        if w0 <= a < w1:
            host[name] += (b - a) / 1e3 / n_steps
    # Device rows: kernels and copies (the profiler also mirrors each record_function range
    # onto the device timeline as an annotation: those are left out).
    dev = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in parts)
    window = [e for e in dev if w0 <= e[0] < w1]
    busy, cur_s, cur_e = 0.0, None, None
    gaps = collections.Counter()
    for s, e, _ in window:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                g = s - cur_e
                busy += cur_e - cur_s
                gaps["<2us" if g < 2 else "2-5us" if g < 5 else "5-20us" if g < 20 else "20-100us" if g < 100 else ">=100us"] += g
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    span = (window[-1][1] - window[0][0]) if window else 0.0
    per_kernel = collections.defaultdict(lambda: [0.0, 0])
    for s, e, name in window:
        k = per_kernel[name[:110]]
        k[0] += e - s
        k[1] += 1
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:45]
    return {
        "device": torch.cuda.get_device_name(),
        "steps": n_steps,
        "wall_ms_per_step": round((w1 - w0) / 1e3 / n_steps, 4),
        "device_span_ms_per_step": round(span / 1e3 / n_steps, 4),
        "device_busy_ms_per_step": round(busy / 1e3 / n_steps, 4),
        "device_gaps_ms_per_step": {k: round(v / 1e3 / n_steps, 4) for k, v in sorted(gaps.items())},
        "events_per_step": round(len(window) / n_steps, 1),
        "host_ms_per_step": {k: round(v, 4) for k, v in host.items()},
        "kernels_us_per_step": [
            {"name": name, "us": round(t / n_steps, 2), "count": round(c / n_steps, 2)} for name, (t, c) in top
        ],
    }


def measure(batch: int) -> dict:
    prompts = [[(i * 7919 + j * 104729) % (vocab - 200) + 100 for j in range(128)] for i in range(batch)]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    # The window: the steady decode steps FIRST..LAST.
    return {"batch": batch, "engine": os.environ.get("TIMELINE_ENGINE", "{}"), **summarize(prof.events(), FIRST, LAST)}


def measure_throughput() -> dict:
    """The throughput workload, profiled over engine steps STEP0..STEP1 only."""
    step0, step1 = (int(x) for x in os.environ.get("TIMELINE_STEPS", "150,250").split(","))
    prompts = [[(i * 7919 + j * 104729) % (vocab - 200) + 100 for j in range(in_len)]
               for i in range(n_prompts)]
    sp = SamplingParams(temperature=1.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:64], sp, use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    host = os.environ.get("TIMELINE_HOST_PROFILE") == "1"
    prof = cProfile.Profile() if host else profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    count, mix, walls = [0], [], []
    step, schedule = core.step, core._schedule

    def counted_step():
        if not host:
            if count[0] == step0:
                prof.start()
            out = step()
            if count[0] == step1:
                prof.stop()
        elif step0 <= count[0] < step1:
            t0 = time.perf_counter()
            prof.enable()
            out = step()
            prof.disable()
            walls.append(time.perf_counter() - t0)
        else:
            out = step()
        count[0] += 1
        return out

    def recorded_schedule():
        out = schedule()
        if step0 <= count[0] < step1:
            prompt_tokens = sum(len(e.token_ids) for e in out.scheduled[:out.num_prefills])
            mix.append((prompt_tokens, len(out.scheduled) - out.num_prefills))
        return out

    core.step, core._schedule = counted_step, recorded_schedule
    try:
        llm.generate(prompts, sp, use_tqdm=False)
    finally:
        core.step, core._schedule = step, schedule
    n = max(len(mix), 1)
    return {
        "workload": workload, **engine_args, "engine_steps": count[0],
        "prompt_tokens_per_step": round(sum(p for p, _ in mix) / n, 1),
        "decode_rows_per_step": round(sum(d for _, d in mix) / n, 1),
        "steps_with_prompt_tokens": sum(1 for p, _ in mix if p),
        **(host_summary(prof, walls) if host else summarize(prof.events(), 0, step1 - step0)),
    }


def host_summary(prof: cProfile.Profile, walls: list[float]) -> dict:
    """The functions with the most cumulative and own time per profiled step."""
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    n = max(len(walls), 1)

    def rows(index: int) -> list[dict]:
        top = sorted(stats.items(), key=lambda kv: -kv[1][index])[:40]
        return [{"name": f"{os.path.relpath(f) if f.startswith('/') else f}:{line}({fn})",
                 "calls": round(v[1] / n, 2), "tottime_ms": round(v[2] * 1e3 / n, 3),
                 "cumtime_ms": round(v[3] * 1e3 / n, 3)} for (f, line, fn), v in top]

    return {"device": torch.cuda.get_device_name(), "steps": len(walls),
            "profiled_wall_ms_per_step": round(sum(walls) * 1e3 / n, 3),
            "by_cumtime": rows(3), "by_tottime": rows(2)}


results = [measure_throughput()] if THROUGHPUT else [measure(int(b)) for b in workload.split(",")]
for r in results:
    print(json.dumps(r))
if out_path:
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
