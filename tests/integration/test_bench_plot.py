"""``core bench … --plot FILE.png --output-json FILE`` on a tiny random model: the PNG is
opened and checked (a real image of plausible size with something drawn on it) and the
JSON agrees with the workload asked for.

The online case starts ``core serve`` as a subprocess; its start-up wait follows the
server's log (it is extended while the log grows, as during a kernel build) rather than
a fixed wall clock.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest
from PIL import Image

from core.entrypoints.cli import main
from tests.helpers import tiny_llama_dir

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ["--dtype", "float32", "--platform", "cpu", "--kv-cache-memory", "16MiB"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama_dir(tmp_path_factory.mktemp("bench"))


def _check_png(path: Path) -> None:
    assert path.stat().st_size > 0
    with Image.open(path) as im:
        assert im.format == "PNG"
        width, height = im.size
        assert width >= 400 and height >= 200, im.size
        # something is drawn: a blank canvas has a single colour
        assert len(im.convert("L").getcolors()) > 1


def test_serve_offline_plot_and_json(model, tmp_path):
    png, out = tmp_path / "serve.png", tmp_path / "serve.json"
    rc = main(["bench", "serve", "--offline", "--model", str(model), *ENGINE, "--num-prompts", "6",
               "--input-len", "8", "--output-len", "6", "--token-range", "10", "500",
               "--plot", str(png), "--output-json", str(out)])
    assert rc == 0
    _check_png(png)
    report = json.loads(out.read_text())
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["tpot_ms"]["p50"] > 0 and report["request_rate"] == "inf"


def test_serve_offline_rate_sweep_plot(model, tmp_path):
    png, out = tmp_path / "sweep.png", tmp_path / "sweep.json"
    rc = main(["bench", "serve", "--offline", "--model", str(model), *ENGINE, "--num-prompts", "4",
               "--input-len", "8", "--output-len", "4", "--token-range", "10", "500",
               "--request-rate", "50", "inf", "--plot", str(png), "--output-json", str(out)])
    assert rc == 0
    _check_png(png)
    sweep = json.loads(out.read_text())["sweep"]
    assert [r["request_rate"] for r in sweep] == [50.0, "inf"]
    assert all(r["completed"] == 4 for r in sweep)


def test_throughput_and_latency_plots(model, tmp_path, capsys):
    png, out = tmp_path / "thr.png", tmp_path / "thr.json"
    assert main(["bench", "throughput", "--model", str(model), *ENGINE, "--num-prompts", "4",
                 "--input-len", "8", "--output-len", "5", "--plot", str(png), "--output-json", str(out)]) == 0
    _check_png(png)
    assert json.loads(out.read_text())["num_prompts"] == 4
    png, out = tmp_path / "lat.png", tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", str(model), *ENGINE, "--num-iters", "2", "--batch-size", "2",
                 "--input-len", "8", "--output-len", "5", "--plot", str(png), "--output-json", str(out)]) == 0
    _check_png(png)
    assert json.loads(out.read_text())["iterations"] == 2
    assert "Throughput:" in capsys.readouterr().out


@pytest.mark.parametrize("loop", ["async", "sync"])
def test_throughput_drives_the_engines_own_loop(model, tmp_path, monkeypatch, loop):
    """Without --step-timing the benchmark measures what LLM.generate runs: EngineCore.step(),
    asynchronous when asked (it once drove a synchronous loop of its own whatever the flag
    said, so the asynchronous figures were the synchronous loop's)."""
    from core.engine_core.core import EngineCore

    steps = []
    real = EngineCore.step
    monkeypatch.setattr(EngineCore, "step", lambda self: steps.append(self.async_scheduling) or real(self))
    out = tmp_path / "thr.json"
    flag = "--async-scheduling" if loop == "async" else "--no-async-scheduling"
    assert main(["bench", "throughput", "--model", str(model), *ENGINE, flag, "--num-prompts", "3",
                 "--input-len", "8", "--output-len", "4", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["loop"] == loop
    assert steps and set(steps) == {loop == "async"}
    assert report["output_tokens_per_s"] > 0
    steps.clear()
    assert main(["bench", "throughput", "--model", str(model), *ENGINE, flag, "--num-prompts", "3",
                 "--input-len", "8", "--output-len", "4", "--step-timing", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["loop"] == "sync (step timing)" and not steps  # its own timed synchronous loop
    assert report["step_split_s"]["decode_only"] + report["step_split_s"]["with_prefill"] > 0


def test_plot_refused_before_the_run(model, tmp_path, capsys):
    rc = main(["bench", "throughput", "--model", str(tmp_path / "never-loaded"), "--plot", str(tmp_path / "x.jpg")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "x.jpg" in err and ".png" in err and "never-loaded" not in err, err


# ---- online: a real server --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, url: str, log: Path, quiet_limit: float = 300.0) -> None:
    """Ready when /health answers; give up only after ``quiet_limit`` seconds with no new
    log output (a kernel build or model load keeps writing), or when the process exits."""
    last_size, last_change = -1, time.monotonic()
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx2.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        size = log.stat().st_size
        if size != last_size:
            last_size, last_change = size, time.monotonic()
        elif time.monotonic() - last_change > quiet_limit:
            proc.kill()
            pytest.fail(f"server silent for {quiet_limit}s and not ready:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def test_serve_online_plot(model, tmp_path):
    port, log = _free_port(), tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CORE_NUM_THREADS": "1", "CORE_LOG_LEVEL": "DEBUG"}
    cmd = [sys.executable, "-m", "core.entrypoints.cli", "serve", str(model), "--port", str(port), *ENGINE]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        _wait_ready(proc, f"http://127.0.0.1:{port}", log)
        png, out = tmp_path / "online.png", tmp_path / "online.json"
        rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "5",
                   "--input-len", "8", "--output-len", "6", "--token-range", "10", "500",
                   "--plot", str(png), "--output-json", str(out)])
        assert rc == 0
        _check_png(png)
        report = json.loads(out.read_text())
        assert report["mode"] == "online" and report["completed"] == 5
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_prefix_plot_and_json(model, tmp_path):
    from core.benchmarks import prefix

    png, out = tmp_path / "prefix.png", tmp_path / "prefix.json"
    rc = prefix.main(["--model", str(model), *ENGINE, "--num-requests", "4", "--prefix-len", "32",
                      "--suffix-len", "4", "--output-len", "3", "--token-range", "10", "500",
                      "--plot", str(png), "--output-json", str(out)])
    assert rc == 0
    _check_png(png)
    report = json.loads(out.read_text())
    assert report["outputs_identical"] and [r["prefix_caching"] for r in report["results"]] == [True, False]
