"""``core serve`` as a subprocess on a tiny random model, for tests that need the real HTTP
stack (uvicorn, its h11 protocol, the middlewares, signals)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"


@dataclass
class LiveServer:
    proc: subprocess.Popen
    url: str
    port: int
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model_dir: Path, log: Path, *extra: str, max_model_len: int = 256) -> LiveServer:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CORE_NUM_THREADS": "1", "CORE_PLATFORM": "cpu"}
    cmd = [sys.executable, "-m", "core.entrypoints.cli", "serve", str(model_dir), "--port", str(port),
           "--served-model-name", MODEL, "--max-model-len", str(max_model_len), "--dtype", "float32",
           "--kv-cache-memory", "32MiB", *extra]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return LiveServer(proc, f"http://127.0.0.1:{port}", port, log)


def wait_ready(server: LiveServer, timeout: float = 180.0) -> None:
    """Wait for /health (the first start may JIT-build the CPU kernels)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"server exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx2.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        time.sleep(0.2)
    server.proc.kill()
    pytest.fail(f"server not ready after {timeout}s:\n{server.log_tail()}")


def stop(server: LiveServer, timeout: float = 60.0) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
    return server.proc.returncode
