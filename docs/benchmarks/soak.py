"""Soak: mixed traffic with client aborts against ``core serve`` on CPU, then check that
nothing leaked (a benchmark run by hand, not a CI test; results in docs/benchmarks/soak.md).

    .venv/bin/python docs/benchmarks/soak.py --duration 600 --out /tmp/soak.json

It starts the server itself (so it can read the process's RSS), warms up, records the RSS
baseline, then runs ``--workers`` clients for ``--duration`` seconds. Each request is drawn
from a mix: completions or chat, streamed or not, short or long outputs, n=1 or 2, a few
malformed ones (which must get 400); ``--abort-fraction`` of them are abandoned by the client
mid-way (a stream closed after a few chunks, a plain request's connection dropped). At the
end it waits (bounded) for the engine to go idle and checks, from /metrics, that no request
is running or waiting and the KV cache is empty, and that the RSS grew less than 5 %.
Exit code 0 when every check holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx2

ROOT = Path(__file__).resolve().parents[2]
WORDS = "the a river stone light north quiet garden paper window seven orange music cloud".split()


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    aborted: int = 0
    refused_as_expected: int = 0
    unexpected: dict[str, int] = field(default_factory=dict)
    server_errors: int = 0

    def odd(self, what: str) -> None:
        self.unexpected[what] = self.unexpected.get(what, 0) + 1


def _tree(pid: int) -> list[int]:
    """``pid`` and every process under it (the engine core runs in a child of `core serve`)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:  # the task ended meanwhile
                pass
    return out


def _rss_each(pid: int) -> dict[str, int]:
    """VmRSS in bytes of the server and of each process under it, by command name and pid."""
    out = {}
    for p in _tree(pid):
        try:
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:  # a child that ended meanwhile
            continue
        fields = dict(ln.split(":", 1) for ln in lines if ":" in ln)
        if "VmRSS" in fields:
            out[f"{fields['Name'].strip()}[{p}]"] = int(fields["VmRSS"].split()[0]) * 1024
    return out


def _rss_bytes(pid: int) -> int:
    """Resident set of the server and its children together (the sum of their VmRSS: pages
    shared between them, such as torch's libraries, count once per process)."""
    total = sum(_rss_each(pid).values())
    if total == 0:
        raise RuntimeError(f"no VmRSS for pid {pid}")
    return total


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 120)))


def _request(rng: random.Random) -> tuple[str, dict, bool]:
    """(path, body, malformed) of one request of the mix."""
    if rng.random() < 0.05:  # bad input: must be a 400, never a 5xx
        bad = rng.choice([{"prompt": [True]}, {"prompt": "x", "max_tokens": "9"}, {"prompt": "x", "n": 0},
                          {"prompt": "x", "max_tokens": 10**9}, {"messages": []}])
        return ("/v1/chat/completions" if "messages" in bad else "/v1/completions"), bad, True
    common = {"max_tokens": rng.choice([4, 16, 64, 160]), "temperature": rng.choice([0, 0.8]),
              "n": 1 if rng.random() < 0.85 else 2, "stream": rng.random() < 0.6, "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        return "/v1/completions", {**common, "prompt": _prompt(rng)}, False
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": _prompt(rng)}]}, False


async def _nothing():
    return
    yield


async def _one(client: httpx2.AsyncClient, rng: random.Random, abort_fraction: float, tally: Tally) -> None:
    path, body, malformed = _request(rng)
    abort = not malformed and rng.random() < abort_fraction
    tally.sent += 1
    try:
        if body.get("stream"):
            async with client.stream("POST", path, json=body) as r:
                if r.status_code >= 500:
                    tally.server_errors += 1
                done = r.status_code == 200
                if not done:
                    await r.aread()
                chunks = 0
                async for line in r.aiter_lines() if done else _nothing():
                    chunks += line.startswith("data: ")
                    if line.startswith('data: {"error"'):
                        tally.odd(f"error event in a stream: {json.loads(line[6:])['error']['message'][:120]}")
                    if abort and chunks >= rng.randint(1, 6):
                        tally.aborted += 1
                        return  # leaving the block closes the connection mid-stream
        else:
            work = asyncio.ensure_future(client.post(path, json=body))
            if abort:
                await asyncio.sleep(rng.uniform(0.01, 1.0))
                if not work.done():
                    work.cancel()  # the connection is dropped: the server must abort the request
                    await asyncio.gather(work, return_exceptions=True)
                    tally.aborted += 1
                    return
            r = await work
            if r.status_code >= 500:
                tally.server_errors += 1
            done = r.status_code == 200
        if malformed:
            if r.status_code == 400:
                tally.refused_as_expected += 1
            else:
                tally.odd(f"malformed request got {r.status_code}")
        elif done:
            tally.completed += 1
        else:
            tally.odd(f"status {r.status_code}: {r.text[:160]}")
    except httpx2.HTTPError as e:
        tally.odd(type(e).__name__)


async def _traffic(url: str, workers: int, duration: float, abort_fraction: float, seed: int,
                   pid: int, rss: list[tuple[float, float]]) -> Tally:
    """Run the mix for ``duration`` seconds; append (seconds, RSS MiB) to ``rss`` every 30 s."""
    tally = Tally()
    start = time.monotonic()
    deadline = start + duration

    async def sample() -> None:
        while time.monotonic() < deadline:
            rss.append((round(time.monotonic() - start), round(_rss_bytes(pid) / 2**20, 1)))
            await asyncio.sleep(min(30.0, max(0.0, deadline - time.monotonic())))

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx2.AsyncClient(base_url=url, timeout=300) as client:
            while time.monotonic() < deadline:
                await _one(client, rng, abort_fraction, tally)

    await asyncio.gather(sample(), *(worker(i) for i in range(workers)))
    return tally


def _wait_idle(url: str, timeout: float) -> dict[str, float]:
    """/metrics once nothing runs or waits (or at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx2.get(url + "/metrics", timeout=30).text
        state = {k: _metric(text, f"core:{k}") for k in ("num_requests_running", "num_requests_waiting",
                                                         "kv_cache_usage_perc")}
        if (state["num_requests_running"] == 0 and state["num_requests_waiting"] == 0) or time.monotonic() > deadline:
            return state
        time.sleep(1)


def _start(ns) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "core.entrypoints.cli", "serve", "--port", str(port), "--platform", "cpu",
           "--max-model-len", str(ns.max_model_len), "--kv-cache-memory", ns.kv_cache_memory,
           "--disable-log-requests", *(["--model", ns.model] if ns.model else [])]
    log = open(ns.log, "wb")  # noqa: SIM115 - kept open for the server's lifetime
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {ns.log}")
        try:
            if httpx2.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx2.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server was not ready within 600 s; see {ns.log}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (after the warm-up)")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds of the same traffic before the RSS baseline")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--abort-fraction", type=float, default=0.3)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default="/tmp/soak-server.log")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    ns = p.parse_args()
    proc, url = _start(ns)
    try:
        warm_rss: list[tuple[float, float]] = []
        rss: list[tuple[float, float]] = []
        warm = asyncio.run(_traffic(url, ns.workers, ns.warmup, ns.abort_fraction, ns.seed + 1, proc.pid, warm_rss))
        _wait_idle(url, 300)
        rss0, each0 = _rss_bytes(proc.pid), _rss_each(proc.pid)
        t0 = time.monotonic()
        tally = asyncio.run(_traffic(url, ns.workers, ns.duration, ns.abort_fraction, ns.seed, proc.pid, rss))
        elapsed = time.monotonic() - t0
        idle = _wait_idle(url, 300)
        rss1, each1 = _rss_bytes(proc.pid), _rss_each(proc.pid)
        healthy = httpx2.get(url + "/health", timeout=30).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    growth = (rss1 - rss0) / rss0
    checks = {
        "no 5xx": tally.server_errors == 0 and warm.server_errors == 0,
        "nothing unexpected": not tally.unexpected,
        "idle after: nothing running or waiting": idle["num_requests_running"] == 0
                                                  and idle["num_requests_waiting"] == 0,
        "KV cache empty after": idle["kv_cache_usage_perc"] == 0,
        "RSS growth < 5%": growth < 0.05,
        "healthy after": healthy,
        "SIGTERM exit 0": code == 0,
    }
    result = {"duration_s": round(elapsed, 1), "workers": ns.workers, "abort_fraction": ns.abort_fraction,
              "aborted_fraction_of_sent": round(tally.aborted / max(tally.sent, 1), 3),
              "tally": asdict(tally), "warmup_tally": asdict(warm), "idle_metrics": idle,
              "rss_baseline_mib": round(rss0 / 2**20, 1), "rss_after_mib": round(rss1 / 2**20, 1),
              "rss_growth_pct": round(100 * growth, 2),
              "rss_mib_per_process": {k: [round(each0[k] / 2**20, 1), round(each1.get(k, 0) / 2**20, 1)]
                                      for k in each0}, "rss_mib_during_warmup": warm_rss,
              "rss_mib_during_run": rss, "checks": checks, "load_after": os.getloadavg()}
    print(json.dumps(result, indent=2))
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
