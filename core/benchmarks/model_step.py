"""Where a step's time goes: one engine's model runner driven with synthetic schedules.

``python -m core.benchmarks.model_step --model DIR --load-format dummy --platform cuda ...``

For each op table (``--ops fused``: the platform's own, ``reference``: core.ops' torch
defaults through an op-override plugin, the extension point a vendor would use) it times:

* decode steps of ``--decode-batches`` sequences at ``--context`` cached tokens, replayed
  from graphs and eagerly (``runner.execute``: inputs, forward, LM head, sampler);
* the host-side pieces alone: ``prepare_inputs`` and the sampler on fixed logits;
* a prefill step of ``--prefill-seqs`` prompts of ``--prefill-len`` tokens;
* a mixed step: one prompt chunk of ``--mixed-chunk`` tokens plus ``--mixed-decodes`` decodes
  at ``--context``, replayed piecewise from graphs (where the platform does) and eagerly;

* with ``--loop-batches B ...``, the engine loop itself: ``B`` requests of
  ``--loop-prompt-len`` tokens each decoding ``--loop-tokens`` tokens through
  ``LLMEngine.step()``, once with the synchronous loop and once with asynchronous scheduling
  (step N+1 scheduled and launched while step N runs): milliseconds per step and output
  tokens per second, the gain the overlap buys;

and, with ``--profile-dir``, writes torch.profiler tables (by device time) of one decode and
one prefill step. Timing is wall clock around ``--iters`` steps with the platform
synchronised before and after (what the engine loop sees). The KV cache is filled with
random values first: timing on zeros can flatter.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time

import msgspec
import torch

import core
from core.engine import LLMEngine
from core.engine_args import EngineArgs
from core.ops import DEFAULT_OPS
from core.platform import Platform
from core.plugins import load_plugins
from core.sampling_params import SamplingParams
from core.scheduler import ScheduledSequence, SchedulerOutput


class ReferenceOps:
    """Plugin that puts core.ops' torch defaults back in place of a platform's kernels."""

    CORE_PLUGIN_API = ">=1.0,<2"

    @core.hookimpl
    def core_op_overrides(self, platform_name):
        return dict(DEFAULT_OPS)


def decode_schedule(batch: int, context: int, block_size: int, params, vocab: int):
    """``batch`` decode sequences with ``context`` tokens each (the last one new), on
    disjoint blocks after block 0 (the null block)."""
    per_seq = -(-context // block_size)
    seqs = tuple(
        ScheduledSequence(
            seq_id=i, request_id=f"d{i}", token_ids=((1000 + i) % vocab,), start_pos=context - 1,
            block_table=tuple(range(1 + i * per_seq, 1 + (i + 1) * per_seq)),
            sample=True, params=params, output_index=5,
        )
        for i in range(batch)
    )
    return SchedulerOutput(scheduled=seqs, num_prefills=0, num_batched_tokens=batch)


def prefill_schedule(seqs: int, length: int, block_size: int, params, vocab: int):
    per_seq = -(-length // block_size)
    rows = tuple(
        ScheduledSequence(
            seq_id=i, request_id=f"p{i}", token_ids=tuple((7 * i + j) % vocab for j in range(length)),
            start_pos=0, block_table=tuple(range(1 + i * per_seq, 1 + (i + 1) * per_seq)),
            sample=True, params=params, output_index=0,
        )
        for i in range(seqs)
    )
    return SchedulerOutput(scheduled=rows, num_prefills=seqs, num_batched_tokens=seqs * length)


def mixed_schedule(chunk: int, decodes: int, context: int, block_size: int, params, vocab: int):
    """A prompt chunk of ``chunk`` tokens (nothing cached) first, then ``decodes`` decodes
    with ``context`` tokens each, on disjoint blocks after block 0."""
    first = prefill_schedule(1, chunk, block_size, params, vocab).scheduled[0]
    used = len(first.block_table)
    dec = decode_schedule(decodes, context, block_size, params, vocab).scheduled
    dec = tuple(
        msgspec.structs.replace(s, seq_id=1 + s.seq_id, block_table=tuple(b + used for b in s.block_table))
        for s in dec
    )
    return SchedulerOutput(scheduled=(first, *dec), num_prefills=1,
                           num_batched_tokens=chunk + decodes)


def mixed_row(engine, ns, params) -> dict:
    """Timings (ms) of one mixed step, from graphs (if any) and eagerly."""
    runner, sync = engine.executor.runner, engine.platform.synchronize
    sched = mixed_schedule(ns.mixed_chunk, ns.mixed_decodes, ns.context, runner.block_size,
                           params, engine.vocab_size)
    row = {"chunk": ns.mixed_chunk, "decodes": ns.mixed_decodes, "context": ns.context}
    graphs = runner.graphs
    if graphs is not None:
        row["graph_step_ms"] = round(timed(lambda: runner.execute(sched), ns.iters, sync) * 1e3, 3)
    runner.graphs = None
    row["eager_step_ms"] = round(timed(lambda: runner.execute(sched), ns.iters, sync) * 1e3, 3)
    runner.graphs = graphs
    return row


def timed(fn, iters: int, sync) -> float:
    """Median seconds of ``fn`` over ``iters`` runs (2 warm-ups), synchronised around each."""
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile_table(fn, path: str, rows: int = 25) -> str:
    from torch.profiler import profile, supported_activities

    fn()
    with profile(activities=list(supported_activities())) as prof:
        fn()
    sort = "self_device_time_total"
    try:
        table = prof.key_averages().table(sort_by=sort, row_limit=rows)
    except Exception:  # a build without device events
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    with open(path, "w") as f:
        f.write(table)
    return table


def decode_row(engine, batch: int, ns, params, greedy) -> dict:
    """Timings (ms) of decode steps of ``batch`` sequences and of their host-side parts."""
    runner, sync = engine.executor.runner, engine.platform.synchronize
    graphs = runner.graphs
    sched = decode_schedule(batch, ns.context, runner.block_size, params, engine.vocab_size)
    gsched = dataclasses.replace(sched, scheduled=tuple(
        msgspec.structs.replace(s, params=greedy) for s in sched.scheduled))
    ids, pos, md = runner.prepare_inputs(sched)
    logits = torch.randn(batch, engine.vocab_size, device=ids.device)
    row = {"batch": batch, "context": ns.context}
    if graphs is not None:
        row["graph_step_ms"] = timed(lambda: runner.execute(sched), ns.iters, sync)
        row["forward_graph_ms"] = timed(lambda: graphs.run(ids, pos, md), ns.iters, sync)
    runner.graphs = None
    row["eager_step_ms"] = timed(lambda: runner.execute(sched), ns.iters, sync)
    runner.graphs = graphs
    row["forward_eager_ms"] = timed(lambda: runner.model(ids, pos, runner.kv_caches, md), ns.iters, sync)
    row["prepare_inputs_ms"] = timed(lambda: runner.prepare_inputs(sched), ns.iters, sync)
    row["sampler_ms"] = timed(lambda: runner.sampler(logits, sched.scheduled), ns.iters, sync)
    row["sampler_greedy_ms"] = timed(lambda: runner.sampler(logits, gsched.scheduled), ns.iters, sync)
    return {k: round(v * 1e3, 3) if k.endswith("_ms") else v for k, v in row.items()}


def loop_row(engine, batch: int, ns, params) -> dict:
    """The engine loop with ``batch`` requests, synchronous and asynchronous runs taking
    turns (so a drifting machine load biases neither): the median of ``--loop-repeats``
    runs of each after one warm-up, as ms per step and output tok/s."""
    vocab, n = engine.vocab_size, ns.loop_prompt_len
    prompts = [[(31 * i + 7 * j) % vocab for j in range(n)] for i in range(batch)]
    sp = dataclasses.replace(params, max_tokens=ns.loop_tokens, ignore_eos=True)
    modes = (False, True) if engine.executor.supports_async_scheduling else (False,)
    runs: dict[bool, list[tuple[float, int]]] = {m: [] for m in modes}
    before = engine.core.async_scheduling
    for _ in range(ns.loop_repeats + 1):
        for mode in modes:
            engine.core.async_scheduling = mode  # nothing is in flight between runs
            runs[mode].append(_run_loop(engine, prompts, sp))
    row: dict = {"batch": batch, "prompt_len": n, "tokens": ns.loop_tokens}
    for mode, results in runs.items():
        secs, steps = statistics.median(r[0] for r in results[1:]), results[-1][1]
        name = "async" if mode else "sync"
        row[f"{name}_ms_per_step"] = round(secs / steps * 1e3, 3)
        row[f"{name}_tok_s"] = round(batch * ns.loop_tokens / secs, 1)
    if "async_tok_s" in row:
        row["async_speedup"] = round(row["async_tok_s"] / row["sync_tok_s"], 3)
    engine.core.async_scheduling = before
    return row


def _run_loop(engine, prompts, sp) -> tuple[float, int]:
    """(seconds, steps) of running ``prompts`` to completion through ``engine.step()``."""
    for p in prompts:
        engine.add_request(None, p, sp, final_only=True)
    engine.platform.synchronize()
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    engine.platform.synchronize()
    return time.perf_counter() - t0, steps


def write_profiles(engine, ns, variant: str, params) -> None:
    """torch.profiler tables: an eager decode step, a prefill step, a graph decode step."""
    runner = engine.executor.runner
    graphs, vocab, bs = runner.graphs, engine.vocab_size, runner.block_size
    os.makedirs(ns.profile_dir, exist_ok=True)
    small, big = ns.decode_batches[0], ns.decode_batches[-1]
    sched = decode_schedule(small, ns.context, bs, params, vocab)
    runner.graphs = None
    profile_table(lambda: runner.execute(sched), os.path.join(ns.profile_dir, f"{variant}_decode{small}_eager.txt"))
    runner.graphs = graphs
    psched = prefill_schedule(ns.prefill_seqs, ns.prefill_len, bs, params, vocab)
    profile_table(lambda: runner.execute(psched), os.path.join(ns.profile_dir, f"{variant}_prefill.txt"))
    if graphs is not None:
        dsched = decode_schedule(big, ns.context, bs, params, vocab)
        profile_table(lambda: runner.execute(dsched), os.path.join(ns.profile_dir, f"{variant}_decode{big}_graph.txt"))


@torch.inference_mode()
def measure(ns, variant: str) -> tuple[dict, Platform]:
    plugins = load_plugins()
    if variant == "reference":
        plugins.register(ReferenceOps(), "reference-ops")
    engine = LLMEngine.from_args(EngineArgs.from_cli_args(ns), plugins)
    runner = engine.executor.runner
    for cache in runner.kv_caches:
        cache.normal_()
    greedy = SamplingParams(temperature=0.0, max_tokens=1000)
    sampled = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=1000)
    out: dict = {"variant": variant, "decode": [], "prefill": {}}
    if runner.graphs is not None:  # the engine captured every bucket at start; what that cost
        out["capture_all_s"] = round(runner.graph_capture_s, 3)
        out["buckets"] = len(runner.graphs.buckets)
        print(variant, "captured", out["buckets"], "graphs in", out["capture_all_s"], "s", flush=True)
    for batch in ns.decode_batches:
        row = decode_row(engine, batch, ns, sampled, greedy)
        out["decode"].append(row)
        print(variant, json.dumps(row), flush=True)
    psched = prefill_schedule(ns.prefill_seqs, ns.prefill_len, runner.block_size, sampled, engine.vocab_size)
    step = timed(lambda: runner.execute(psched), max(3, ns.iters // 4), engine.platform.synchronize)
    out["prefill"] = {"seqs": ns.prefill_seqs, "len": ns.prefill_len, "step_ms": round(step * 1e3, 3)}
    print(variant, "prefill", json.dumps(out["prefill"]), flush=True)
    out["mixed"] = mixed_row(engine, ns, sampled)
    print(variant, "mixed", json.dumps(out["mixed"]), flush=True)
    out["loop"] = []
    for batch in ns.loop_batches:
        row = loop_row(engine, batch, ns, sampled)
        out["loop"].append(row)
        print(variant, "loop", json.dumps(row), flush=True)
    if ns.profile_dir:
        write_profiles(engine, ns, variant, sampled)
    engine.shutdown()
    return out, engine.platform


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefill-seqs", type=int, default=2)
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--mixed-chunk", type=int, default=128)
    p.add_argument("--mixed-decodes", type=int, default=32)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--loop-batches", type=int, nargs="*", default=[],
                   help="requests per engine-loop run, sync vs async (default: none, skipped)")
    p.add_argument("--loop-prompt-len", type=int, default=128)
    p.add_argument("--loop-tokens", type=int, default=64, help="tokens each loop request decodes")
    p.add_argument("--loop-repeats", type=int, default=3)
    p.add_argument("--ops", choices=["fused", "reference", "both"], default="both")
    p.add_argument("--profile-dir", default=None)
    p.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(argv)
    variants = ["fused", "reference"] if ns.ops == "both" else [ns.ops]
    results = []
    for v in variants:
        result, platform = measure(ns, v)
        results.append(result)
        gc.collect()  # the engine (its KV cache) must be gone before the next one sizes its own
        platform.empty_cache()
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
