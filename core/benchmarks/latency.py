"""``core bench latency``: time per output token of small batches, and time to first service.

Each iteration sends ``--batch-size`` requests of ``--input-len`` random tokens that all
generate ``--output-len`` tokens (EOS ignored), and waits for them. Per request, the decode
time per output token (TPOT) is (finish - first token) / (output tokens - 1), from the
engine's own request metrics; the figure reported is the median over all requests of the
timed iterations. One untimed iteration runs first (first-use work: graph capture,
library handles). ``first_request_s`` is the time from the engine's construction to the end
of that first iteration; ``served_at_unix`` lets a caller measure from process launch.
"""

from __future__ import annotations

import random
import statistics
import time

from core.benchmarks.report import add_report_args, check_plot_available, plot_latencies, write_json
from core.engine_args import EngineArgs
from core.progress import bar, starting
from core.sampling_params import SamplingParams


def add_latency_args(p) -> None:
    p.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=256, help="tokens generated per request (EOS ignored)")
    p.add_argument("--batch-size", type=int, default=1, help="requests per iteration, sent together")
    p.add_argument("--num-iters", type=int, default=5, help="timed iterations (after one untimed)")
    p.add_argument("--greedy", action="store_true",
                   help="temperature 0 (default: temperature 1, as vLLM's latency benchmark)")
    add_report_args(p)
    EngineArgs.add_cli_args(p)


def _iteration(llm, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    rows = []
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        rows.append({
            "ttft_s": m.first_token_time - m.arrival_time,
            "tpot_s": (m.finished_time - m.first_token_time) / max(1, n - 1),
            "e2e_s": m.finished_time - m.arrival_time,
            "output_tokens": n,
        })
    return rows


def run_latency(ns) -> int:
    from core.entrypoints.llm import LLM

    check_plot_available(ns.plot)
    args = EngineArgs.from_cli_args(ns)
    t0 = time.perf_counter()
    with starting():
        llm = LLM(**vars(args))
    startup = time.perf_counter() - t0
    rng = random.Random(args.seed)
    vocab = llm.engine.vocab_size

    def prompts() -> list[list[int]]:
        return [[rng.randrange(100, vocab - 100) for _ in range(ns.input_len)]
                for _ in range(ns.batch_size)]

    params = SamplingParams(temperature=0.0 if ns.greedy else 1.0, top_p=1.0,
                            max_tokens=ns.output_len, ignore_eos=True)
    with bar(ns.num_iters + 1, "iterations (first untimed)", unit="it") as iters:
        _iteration(llm, prompts(), params)
        iters.update(1)
        first_request = time.perf_counter() - t0
        served_at = time.time()
        rows = []
        for _ in range(ns.num_iters):
            rows += _iteration(llm, prompts(), params)
            iters.update(1)
    result = {
        "batch_size": ns.batch_size,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "iterations": ns.num_iters,
        "tpot_ms_median": round(statistics.median(r["tpot_s"] for r in rows) * 1e3, 3),
        "tpot_ms_min": round(min(r["tpot_s"] for r in rows) * 1e3, 3),
        "ttft_ms_median": round(statistics.median(r["ttft_s"] for r in rows) * 1e3, 2),
        "e2e_s_median": round(statistics.median(r["e2e_s"] for r in rows), 3),
        "startup_s": round(startup, 3),
        "first_request_s": round(first_request, 3),
        "served_at_unix": served_at,
        "platform": llm.engine.platform.name,
        "dtype": llm.engine.config.model.dtype,
        "enforce_eager": llm.engine.config.enforce_eager,
    }
    print(
        f"Latency: {result['tpot_ms_median']:.2f} ms per output token (median, batch "
        f"{ns.batch_size}), TTFT {result['ttft_ms_median']:.1f} ms, engine start "
        f"{startup:.1f} s, first request served after {first_request:.1f} s"
    )
    write_json(ns.output_json, result)
    llm.engine.shutdown()
    if ns.plot:
        series = {name: [r[f"{name[:-3]}_s"] * 1e3 for r in rows] for name in ("ttft_ms", "tpot_ms", "e2e_ms")}
        plot_latencies(ns.plot, series, f"core bench latency: batch {ns.batch_size}, "
                       f"{ns.input_len}/{ns.output_len} tokens, {ns.num_iters} iterations")
        print(f"plot written to {ns.plot}")
    return 0
