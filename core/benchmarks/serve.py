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

Online against ``core serve``, the report also has ``server_ms``: the server's own mean
split of a request over the timed run (front end -> engine core, queue, prefill, TTFT,
decode, end to end), from its ``/metrics`` histograms read before and after the run (so
another client's traffic meanwhile would be counted too; ``requests`` says how many).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import platform as host
import random
import re
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
from core.entrypoints.heap import frozen_heap
from core.progress import bar, starting
from core.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    sent_s: float = 0.0
    """When the request went out, in seconds from the run's start (offline: its arrival)."""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


SERVER_SPLIT = {
    "front_end": "core:request_front_end_time_seconds",
    "queue": "core:request_queue_time_seconds",
    "prefill": "core:request_prefill_time_seconds",
    "ttft": "core:time_to_first_token_seconds",
    "decode": "core:request_decode_time_seconds",
    "e2e": "core:e2e_request_latency_seconds",
}
"""``server_ms`` key -> the ``core serve`` histogram (seconds, one observation per finished
request) whose mean over the run it reports."""

_SAMPLE = re.compile(r"^(core:[a-z0-9_]+)_(sum|count)(?:\{[^}]*\})? ([0-9.eE+-]+|NaN)$")


def histogram_totals(exposition: str) -> dict[str, list[float]]:
    """``{name: [sum, count]}`` of every ``core:`` histogram in a Prometheus text exposition,
    added over its label sets."""
    totals: dict[str, list[float]] = {}
    for line in exposition.splitlines():
        m = _SAMPLE.match(line)
        if m:
            totals.setdefault(m.group(1), [0.0, 0.0])[m.group(2) == "count"] += float(m.group(3))
    return totals


def server_split(before: str, after: str) -> dict | None:
    """Mean milliseconds per request of each :data:`SERVER_SPLIT` histogram between two
    scrapes, and ``requests`` (how many finished in between); None when the server does not
    export them (not ``core serve``) or none finished."""
    b, a = histogram_totals(before), histogram_totals(after)
    if any(name not in a for name in SERVER_SPLIT.values()):
        return None
    count = a[SERVER_SPLIT["ttft"]][1] - b.get(SERVER_SPLIT["ttft"], [0.0, 0.0])[1]
    if count <= 0:
        return None
    split: dict = {"requests": int(count)}
    for key, name in SERVER_SPLIT.items():
        s0, n0 = b.get(name, [0.0, 0.0])
        s1, n1 = a[name]
        split[key] = round(1000 * (s1 - s0) / (n1 - n0), 2) if n1 > n0 else None
    return split


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


def per_request(results: list[RequestResult]) -> list[dict]:
    """One record per request, in prompt order: when it was sent (s from the run's start),
    TTFT, TPOT and end-to-end in ms, tokens out, the error of a failed one."""
    out = []
    for r in results:
        rec = {"sent_s": round(r.sent_s, 4), "ok": r.ok}
        if r.ok:
            tpot = r.tpot
            rec.update(ttft_ms=round(r.ttft * 1e3, 2), tpot_ms=None if tpot is None else round(tpot * 1e3, 3),
                       e2e_ms=round(r.e2e * 1e3, 2), output_tokens=r.output_tokens)
        else:
            rec["error"] = r.error
        out.append(rec)
    return out


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
# The client is plain HTTP and json.loads, not the openai package: its request building walks
# every prompt id (~9 ms for 512 ids) and its pydantic chunk parsing runs on the same event loop
# as every other stream's clock, which inflated TTFT and TPOT under load.
async def _one(client, model: str, prompt: list[int], ns, max_tokens: int | None = None, t0: float = 0.0) -> RequestResult:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens or ns.output_len,
                       "temperature": ns.temperature, "stream": True, "stream_options": {"include_usage": True},
                       "ignore_eos": True}).encode()
    start = time.perf_counter()
    ttft, usage = None, None
    try:
        async with asyncio.timeout(ns.timeout), client.stream("POST", "/v1/completions", content=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return RequestResult(False, sent_s=start - t0, error=f"HTTP {resp.status_code}: {text}"[:300])
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(False, sent_s=start - t0, error=f"error in the stream: {chunk['error']}"[:300])
                choices = chunk.get("choices")
                if ttft is None and choices and choices[0].get("text"):
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except TimeoutError:
        return RequestResult(False, sent_s=start - t0, error=f"no complete answer within --timeout {ns.timeout} s")
    except Exception as e:  # a failed request is counted, not fatal
        return RequestResult(False, sent_s=start - t0, error=f"{type(e).__name__}: {e}"[:300])
    e2e = time.perf_counter() - start
    if usage is None:
        return RequestResult(False, sent_s=start - t0, error="no usage chunk in the stream")
    return RequestResult(True, ttft if ttft is not None else e2e, e2e, usage["prompt_tokens"],
                         usage["completion_tokens"], sent_s=start - t0)


async def _served_model(client, ns) -> str:
    import httpx2

    try:
        resp = await client.get("/v1/models")
    except httpx2.TransportError:
        raise ValueError(f"no server answers at {ns.base_url}; start one with `core serve` or point "
                         f"--base-url at it (or run the same load in-process with --offline)") from None
    if resp.status_code != 200:
        raise ValueError(f"GET {ns.base_url}/v1/models answered HTTP {resp.status_code}: {resp.text[:200]}")
    return ns.served_model or resp.json()["data"][0]["id"]


async def _scrape_metrics(client) -> str | None:
    """The server's ``/metrics`` text, or None where it has none (another server, an error)."""
    import httpx2

    try:
        resp = await client.get("/metrics")
    except httpx2.TransportError:
        return None
    return resp.text if resp.status_code == 200 else None


async def _run_online(ns, prompts: list[list[int]],
                      arrivals: list[float]) -> tuple[list[RequestResult], float, str, dict | None]:
    import httpx2

    # one INFO line per request from the HTTP client would bury the report (CORE_LOG_LEVEL=DEBUG shows them)
    client_log = logging.getLogger("httpx2")
    if not client_log.isEnabledFor(logging.DEBUG):
        client_log.setLevel(logging.WARNING)
    headers = {"Content-Type": "application/json"}
    if ns.api_key:
        headers["Authorization"] = f"Bearer {ns.api_key}"
    # one connection per request in flight: a pool smaller than the load would queue requests
    # inside the client, where the server cannot see them
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=ns.max_concurrency or len(prompts))
    async with httpx2.AsyncClient(base_url=ns.base_url.rstrip("/"), headers=headers, limits=limits,
                                  timeout=ns.timeout, trust_env=False) as client:
        model = await _served_model(client, ns)
        # first-use work (allocator growth, kernel warm-up) should not land in the first request's TTFT
        warm = await _one(client, model, prompts[0], ns, max_tokens=2)
        if not warm.ok:
            raise ValueError(f"the warm-up request to {ns.base_url} failed: {warm.error}")
        limit = asyncio.Semaphore(ns.max_concurrency or len(prompts))
        # a finished request's histograms are recorded before its stream ends, so between
        # these two scrapes lie exactly the timed requests (when no one else is served)
        before = await _scrape_metrics(client)
        t0 = time.perf_counter()

        async def launch(prompt: list[int], at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            async with limit:
                result = await _one(client, model, prompt, ns, t0=t0)
            done.update(1)
            return result

        with bar(len(prompts), "requests", unit="req") as done:
            results = await asyncio.gather(*(launch(p, a) for p, a in zip(prompts, arrivals)))
        elapsed = time.perf_counter() - t0
        after = await _scrape_metrics(client) if before is not None else None
        split = server_split(before, after) if after is not None else None
        return list(results), elapsed, model, split


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
                    len(out.prompt_token_ids), len(comp.token_ids), sent_s=m.arrival_time - t0)
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
            split = None
            with frozen_heap():  # no full collection of this process inside the timed run
                if engine is not None:
                    results, elapsed, model = _run_offline(engine, ns, prompts, arrivals)
                else:
                    results, elapsed, model, split = asyncio.run(_run_online(ns, prompts, arrivals))
            reports.append(_report(ns, rate, model, summarize(results, elapsed)))
            if split is not None:
                reports[-1]["server_ms"] = split
            if ns.save_detailed:
                reports[-1]["requests"] = per_request(results)
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
    if "server_ms" in r:
        s = r["server_ms"]
        print("  server   " + ", ".join(f"{k} {s[k]}" for k in SERVER_SPLIT if s.get(k) is not None)
              + f" (mean ms over {s['requests']} requests, from /metrics)")
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
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a request may take from send to its last chunk (online)")
    p.add_argument("--save-detailed", action="store_true",
                   help="add every request's send time, TTFT, TPOT and latency to the JSON (\"requests\")")
    add_report_args(p)
    EngineArgs.add_cli_args(p)
