"""``core bench throughput``: N requests of random tokens through the offline engine.

All requests are queued at once and the engine is stepped until every one has finished;
throughput is tokens over that wall time. A bar on stderr counts output tokens as they are
generated (the engine's running total, so the requests need no per-step outputs).
"""

from __future__ import annotations

import platform as host
import random
import time

from core.benchmarks.report import add_report_args, check_plot_available, plot_progress, write_json
from core.engine_args import EngineArgs
from core.progress import bar, starting
from core.sampling_params import SamplingParams


def add_throughput_args(p) -> None:
    p.add_argument("--num-prompts", type=int, default=32, help="requests, all queued at once")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (EOS ignored)")
    p.add_argument("--step-timing", action="store_true",
                   help="time schedule / execute / update of every step separately (this drives "
                        "the synchronous loop, whatever --async-scheduling says)")
    add_report_args(p)
    EngineArgs.add_cli_args(p)


def run_throughput(ns) -> int:
    from core.entrypoints.llm import LLM

    check_plot_available(ns.plot)
    args = EngineArgs.from_cli_args(ns)
    t0 = time.perf_counter()
    with starting():
        llm = LLM(**vars(args))
    startup = time.perf_counter() - t0
    vocab = llm.engine.vocab_size
    rng = random.Random(args.seed)
    # Random ids avoid tokenizer effects; keep away from the top of the vocab (special tokens).
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(ns.input_len)] for _ in range(ns.num_prompts)]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=ns.output_len, ignore_eos=True, seed=None)
    t0 = time.perf_counter()
    outs, split, progress = _generate(llm.engine, prompts, params, ns.step_timing)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    result = {
        "num_prompts": ns.num_prompts,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "elapsed_s": round(elapsed, 3),
        "startup_s": round(startup, 3),
        "requests_per_s": round(ns.num_prompts / elapsed, 3),
        "output_tokens_per_s": round(n_out / elapsed, 2),
        "total_tokens_per_s": round((n_in + n_out) / elapsed, 2),
        "platform": llm.engine.platform.name,
        "model": llm.engine.config.model.model,
        "dtype": llm.engine.config.model.dtype,
        "loop": "sync (step timing)" if ns.step_timing else
                ("async" if llm.engine.core.async_scheduling else "sync"),
        "machine": f"{host.machine()} {host.processor() or ''}".strip(),
    }
    llm.engine.shutdown()
    if split is not None:
        result["step_split_s"] = split
        print("step time split (s): " + ", ".join(f"{k} {v}" for k, v in split.items()))
    print(
        f"Throughput: {result['requests_per_s']:.2f} requests/s, "
        f"{result['output_tokens_per_s']:.1f} output tokens/s, "
        f"{result['total_tokens_per_s']:.1f} total tokens/s ({elapsed:.1f} s)"
    )
    write_json(ns.output_json, result)
    if ns.plot:
        e2e = [o.metrics.finished_time - o.metrics.arrival_time for o in outs]
        ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
        title = f"core bench throughput: {result['model']}, {ns.num_prompts} x {ns.input_len}/{ns.output_len}"
        plot_progress(ns.plot, progress, {"ttft_s": ttft, "e2e_s": e2e}, title)
        print(f"plot written to {ns.plot}")
    return 0


def _generate(engine, prompts, params, step_timing: bool) -> tuple[list, dict | None, list[tuple[float, int]]]:
    """Run ``prompts`` to completion; returns the final outputs, the step split (with
    ``step_timing``) and ``(seconds, output tokens so far)`` samples for the progress plot.

    Without ``step_timing`` this is ``LLM.generate``'s loop, ``LLMEngine.step()``, so the
    engine's asynchronous scheduling (the default where the executor supports it) is what
    gets measured. With it, each part of a *synchronous* step is timed separately: schedule
    (host), execute (inputs, forward, sampling: ends in a device sync, so it holds the
    device time), update (host: detokenize, stop checks, outputs); an asynchronous step has
    no such split, since its parts overlap."""
    ids = [engine.add_request(None, p, params, final_only=True) for p in prompts]
    counters = engine.output_processor.counters
    base = counters.generation_tokens
    done: dict[str, object] = {}
    split = {"schedule": 0.0, "execute": 0.0, "update": 0.0}
    steps = {"decode_only": 0, "with_prefill": 0}
    start, samples = time.perf_counter(), [(0.0, 0)]
    with bar(len(prompts) * params.max_tokens, "output tokens", unit="tok") as tokens:
        while engine.has_unfinished_requests():
            if step_timing:
                outs = _timed_sync_step(engine, split, steps)
            else:
                outs = engine.step()
            for out in outs:
                if out.finished:
                    done[out.request_id] = out
            generated = counters.generation_tokens - base
            tokens.update(generated - tokens.n)
            samples.append((time.perf_counter() - start, generated))
    timing = {**{k: round(v, 3) for k, v in split.items()}, **steps} if step_timing else None
    return [done[i] for i in ids], timing, samples


def _timed_sync_step(engine, split: dict[str, float], steps: dict[str, int]) -> list:
    """One synchronous schedule -> execute -> update, each part's time added to ``split``."""
    t0 = time.perf_counter()
    sched = engine.scheduler.schedule()
    t1 = time.perf_counter()
    result = engine.executor.execute(sched)
    t2 = time.perf_counter()
    outs, stops = engine.output_processor.process(engine.scheduler.update(sched, result))
    for hit in stops:
        engine.core.stop_sample(hit.request_id, hit.index)
    t3 = time.perf_counter()
    split["schedule"] += t1 - t0
    split["execute"] += t2 - t1
    split["update"] += t3 - t2
    steps["with_prefill" if sched.num_prefills else "decode_only"] += 1
    return outs
