"""Prefix caching on vs off: N requests sharing a long prefix (issue 4's benchmark).

    python -m core.benchmarks.prefix [--num-requests 64 --prefix-len 1000 --suffix-len 16
                                      --output-len 16] [--output-json F] [--plot F.png]
                                      [engine flags...]

Every request is the same random ``prefix-len`` tokens followed by its own random suffix;
all arrive at once. Prints, for caching on and off: wall time, requests/s, output tokens/s,
time to first token (mean, p50, p90) and the prefix-cache hit rate; ``--plot`` draws the
TTFT distributions of both runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from core.benchmarks.report import add_report_args, check_plot_available, plot_latencies, write_json
from core.engine_args import EngineArgs
from core.progress import starting
from core.sampling_params import SamplingParams


def _run(args: EngineArgs, prompts: list[list[int]], output_len: int) -> dict:
    from core.entrypoints.llm import LLM

    with starting(f"starting the engine (prefix caching {'on' if args.enable_prefix_caching else 'off'})"):
        llm = LLM(**vars(args))
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    elapsed = time.perf_counter() - t0
    llm.engine.shutdown()
    ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    stats = llm.engine.scheduler.stats()
    return {
        "prefix_caching": args.enable_prefix_caching,
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(len(outs) / elapsed, 3),
        "output_tokens_per_s": round(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, 1),
        "ttft_mean_s": round(statistics.fmean(ttft), 3),
        "ttft_p50_s": round(ttft[len(ttft) // 2], 3),
        "ttft_p90_s": round(ttft[int(len(ttft) * 0.9)], 3),
        "prefix_hit_rate": round(stats.prefix_cache_hit_rate, 4),
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "ttft_s": ttft,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64, help="requests, all sharing one prefix")
    p.add_argument("--prefix-len", type=int, default=1000, help="shared prefix length in tokens")
    p.add_argument("--suffix-len", type=int, default=16, help="each request's own suffix length")
    p.add_argument("--output-len", type=int, default=16, help="tokens generated per request")
    p.add_argument("--token-range", type=int, nargs=2, default=(100, 40000), metavar=("LO", "HI"),
                   help="prompt token ids are drawn from [LO, HI) (keep HI within the vocabulary)")
    add_report_args(p)
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(argv)
    check_plot_available(ns.plot)
    args = EngineArgs.from_cli_args(ns)
    rng = random.Random(ns.seed)
    lo, hi = ns.token_range
    prefix = [rng.randrange(lo, hi) for _ in range(ns.prefix_len)]
    prompts = [prefix + [rng.randrange(lo, hi) for _ in range(ns.suffix_len)] for _ in range(ns.num_requests)]
    results = []
    for caching in (True, False):
        args.enable_prefix_caching = caching
        results.append(_run(args, prompts, ns.output_len))
    same = results[0].pop("outputs") == results[1].pop("outputs")
    ttft = {f"ttft_ms caching {'on' if r['prefix_caching'] else 'off'}": [t * 1e3 for t in r.pop("ttft_s")]
            for r in results}
    print(f"{'prefix caching':<15} {'wall s':>8} {'req/s':>7} {'out tok/s':>10} {'TTFT mean':>10} {'p50':>7} {'p90':>7} {'hit rate':>9}")
    for r in results:
        print(f"{'on' if r['prefix_caching'] else 'off':<15} {r['elapsed_s']:>8} {r['requests_per_s']:>7} "
              f"{r['output_tokens_per_s']:>10} {r['ttft_mean_s']:>10} {r['ttft_p50_s']:>7} {r['ttft_p90_s']:>7} "
              f"{r['prefix_hit_rate']:>9}")
    print(f"greedy outputs identical with and without caching: {same}")
    write_json(ns.output_json, {"results": results, "outputs_identical": same, "args": vars(ns)})
    if ns.plot:
        plot_latencies(ns.plot, ttft, f"prefix caching: {ns.num_requests} requests sharing {ns.prefix_len} tokens")
        print(f"plot written to {ns.plot}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
