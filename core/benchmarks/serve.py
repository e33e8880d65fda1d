"""``core bench serve``: a load generator for the OpenAI server, and the same workload
through the offline engine for comparison.

Workload: ``--num-prompts`` prompts of ``--input-len`` random token ids (seeded; ids drawn
from ``--token-range`` so both sides see identical prompts), each asking for exactly
``--output-len`` tokens (``ignore_eos``). Arrivals follow a Poisson process of
``--request-rate`` requests/s (``inf``: all at once), optionally capped at
``--max-concurrency`` in flight. Several rates (``--request-rate 2 4 8``) run the same
prompts once per rate, in order, for a throughput-vs-rate curve (``--plot``).

Per request: TTFT (send to first streamed token), TPOT ((end - first token) / (tokens - 1)),
end-to-end latency. Online, times are measured by the client (they include HTTP and
streaming); offline (``--offline``), they come from the engine's RequestMetrics.
"""

from __future__ import annotations

import asyncio
import math
import platform as host
import random
import statistics
import time
from dataclasses import dataclass

from core.benchmarks.report import (
    add_report_args,
    check_plot_available,
    percentile,
    plot_latencies,
    plot_rate_sweep,
    write_json,
)
from core.engine_args import EngineArgs
from core.progress import bar, starting
from core.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def make_workload(ns, request_rate: float) -> tuple[list[list[int]], list[float]]:
    """Prompts (token ids) and arrival offsets in seconds from the start; the prompts
    depend only on the seed, not on the rate."""
    rng = random.Random(ns.seed)
    lo, hi = ns.token_range
    prompts = [[rng.randrange(lo, hi) for _ in range(ns.input_len)] for _ in range(ns.num_prompts)]
    t, arrivals = 0.0, []
    for _ in prompts:
        arrivals.append(t)
        if not math.isinf(request_rate):
            t += rng.expovariate(request_rate)
    return prompts, arrivals


def latency_series(results: list[RequestResult]) -> dict[str, list[float]]:
    """Per successful request, in ms: TTFT, TPOT (requests of 2+ tokens) and end-to-end."""
    ok = [r for r in results if r.ok]
    return {"ttft_ms": [r.ttft * 1e3 for r in ok], "tpot_ms": [r.tpot * 1e3 for r in ok if r.tpot is not None],
            "e2e_ms": [r.e2e * 1e3 for r in ok]}


def summarize(results: list[RequestResult], elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    out = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(ok) / elapsed, 3) if elapsed else 0.0,
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / elapsed, 2) if elapsed else 0.0,
        "total_tokens_per_s": round(sum(r.output_tokens + r.prompt_tokens for r in ok) / elapsed, 2)
        if elapsed else 0.0,
    }
    for name, vals in latency_series(results).items():
        if vals:
            out[name] = {"mean": round(statistics.fmean(vals), 2), "p50": round(percentile(vals, 50), 2),
                         "p90": round(percentile(vals, 90), 2), "p99": round(percentile(vals, 99), 2)}
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        out["errors"] = errors[:5]
    return out


# ---- online ---------------------------------------------------------------------------------
async def _one(client, model: str, prompt: list[int], ns, max_tokens: int | None = None) -> RequestResult:
    start = time.perf_counter()
    ttft, usage = None, None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens or ns.output_len, temperature=ns.temperature, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].text:
                ttft = time.perf_counter() - start
            if chunk.usage is not None:
                usage = chunk.usage
    except Exception as e:  # a failed request is counted, not fatal
        return RequestResult(False, error=f"{type(e).__name__}: {e}"[:300])
    e2e = time.perf_counter() - start
    if usage is None:
        return RequestResult(False, error="no usage chunk in the stream")
    return RequestResult(True, ttft if ttft is not None else e2e, e2e, usage.prompt_tokens, usage.completion_tokens)


async def _run_online(ns, prompts: list[list[int]], arrivals: list[float]) -> tuple[list[RequestResult], float, str]:
    import logging

    import openai

    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one INFO line per request otherwise
    async with openai.AsyncOpenAI(base_url=ns.base_url.rstrip("/") + "/v1", api_key=ns.api_key or "none",
                                  max_retries=0, timeout=ns.timeout) as client:
        try:
            model = ns.served_model or (await client.models.list()).data[0].id
        except openai.APIConnectionError:
            raise ValueError(f"no server answers at {ns.base_url}; start one with `core serve` or point "
                             f"--base-url at it (or run the same load in-process with --offline)") from None
        # first-use work (allocator growth, kernel warm-up) should not land in the first request's TTFT
        warm = await _one(client, model, prompts[0], ns, max_tokens=2)
        if not warm.ok:
            raise ValueError(f"the warm-up request to {ns.base_url} failed: {warm.error}")
        limit = asyncio.Semaphore(ns.max_concurrency or len(prompts))
        t0 = time.perf_counter()

        async def launch(prompt: list[int], at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            async with limit:
                result = await _one(client, model, prompt, ns)
            done.update(1)
            return result

        with bar(len(prompts), "requests", unit="req") as done:
            results = await asyncio.gather(*(launch(p, a) for p, a in zip(prompts, arrivals)))
        return list(results), time.perf_counter() - t0, model


# ---- offline --------------------------------------------------------------------------------
def _offline_engine(ns):
    from core.engine import LLMEngine

    with starting():
        engine = LLMEngine.from_args(EngineArgs.from_cli_args(ns))
    hi = ns.token_range[1]
    if hi > engine.vocab_size:
        engine.shutdown()
        raise ValueError(f"--token-range upper bound {hi} exceeds the model's vocabulary ({engine.vocab_size}); "
                         f"lower it, e.g. --token-range 100 {engine.vocab_size}")
    return engine


def _warm_up_offline(engine, prompt: list[int], ns) -> None:
    """One short request, untimed, so first-use work stays out of the measured run."""
    engine.add_request("bench-warmup", prompt, SamplingParams(temperature=ns.temperature, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


def _run_offline(engine, ns, prompts: list[list[int]], arrivals: list[float]) -> tuple[list[RequestResult], float, str]:
    """The same arrivals through LLMEngine.step() in this process (no HTTP, no async engine)."""
    params = SamplingParams(temperature=ns.temperature, max_tokens=ns.output_len, ignore_eos=True)
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    results: dict[str, RequestResult] = {}
    in_flight = 0
    done = bar(len(prompts), "requests", unit="req")
    t0 = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic()
        while pending and t0 + arrivals[pending[0]] <= now and (not ns.max_concurrency or in_flight < ns.max_concurrency):
            i = pending.pop(0)
            engine.add_request(f"bench-{i}", prompts[i], params, arrival_time=t0 + arrivals[i])
            in_flight += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, t0 + arrivals[pending[0]] - time.monotonic()))
            continue
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                done.update(1)
                m, comp = out.metrics, out.outputs[0]
                results[out.request_id] = RequestResult(
                    True, m.first_token_time - m.arrival_time, m.finished_time - m.arrival_time,
                    len(out.prompt_token_ids), len(comp.token_ids))
    elapsed = time.monotonic() - t0
    done.close()
    return [results[f"bench-{i}"] for i in range(len(prompts))], elapsed, engine.config.model.model


def run_serve_bench(ns) -> int:
    check_plot_available(ns.plot)
    engine = _offline_engine(ns) if ns.offline else None
    reports, all_results = [], []
    try:
        if engine is not None:
            _warm_up_offline(engine, make_workload(ns, math.inf)[0][0], ns)
        for rate in ns.request_rate:
            prompts, arrivals = make_workload(ns, rate)
            if engine is not None:
                results, elapsed, model = _run_offline(engine, ns, prompts, arrivals)
            else:
                results, elapsed, model = asyncio.run(_run_online(ns, prompts, arrivals))
            reports.append(_report(ns, rate, model, summarize(results, elapsed)))
            all_results.append(results)
            _print(reports[-1])
    finally:
        if engine is not None:
            engine.shutdown()
    write_json(ns.output_json, reports[0] if len(reports) == 1 else {"sweep": reports})
    if ns.plot:
        title = f"core bench serve ({reports[0]['mode']}): {reports[0]['model']}, {ns.num_prompts} x {ns.input_len}/{ns.output_len}"
        if len(reports) == 1:
            plot_latencies(ns.plot, latency_series(all_results[0]), title + f", rate {reports[0]['request_rate']}")
        else:
            plot_rate_sweep(ns.plot, reports, title)
        print(f"plot written to {ns.plot}")
    return 0 if all(r["failed"] == 0 for r in reports) else 1


def _report(ns, rate: float, model: str, summary: dict) -> dict:
    config = {k: v for k, v in vars(ns).items() if k in (
        "num_prompts", "input_len", "output_len", "max_concurrency", "seed", "temperature")}
    config["request_rate"] = "inf" if math.isinf(rate) else rate  # JSON has no Infinity
    return {"mode": "offline" if ns.offline else "online", "model": model, **config, **summary,
            "machine": f"{host.machine()} {host.processor() or ''}".strip()}


def _print(r: dict) -> None:
    print(f"{r['mode']} at {r['request_rate']} req/s: {r['completed']} ok, {r['failed']} failed in {r['elapsed_s']:.2f} s; "
          f"{r['requests_per_s']:.2f} req/s, {r['output_tokens_per_s']:.1f} output tok/s, "
          f"{r['total_tokens_per_s']:.1f} total tok/s")
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        if name in r:
            s = r[name]
            print(f"  {name:<8} mean {s['mean']:>9.1f}  p50 {s['p50']:>9.1f}  p90 {s['p90']:>9.1f}  p99 {s['p99']:>9.1f}")
    for e in r.get("errors", []):
        print(f"  error: {e}")


def add_serve_bench_args(p) -> None:
    """Flags of ``core bench serve`` (engine flags are used with --offline)."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to load (online mode)")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.add_argument("--served-model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--offline", action="store_true", help="run the workload through the offline engine instead")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per run")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (EOS ignored)")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf], metavar="RATE",
                   help="requests/s (Poisson arrivals); inf = all at once; several = one run per rate "
                        "(default: inf)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--token-range", type=int, nargs=2, default=(100, 5000), metavar=("LO", "HI"),
                   help="prompt token ids are drawn from [LO, HI)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (online)")
    add_report_args(p)
    EngineArgs.add_cli_args(p)
