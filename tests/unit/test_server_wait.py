"""tests/helpers.wait_for_server: start-up waits follow the server's log, not a fixed clock."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import wait_for_server


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(code: str, log: Path, cwd: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-u", "-c", code], stdout=f, stderr=subprocess.STDOUT, cwd=cwd)


def test_a_server_whose_log_advances_is_waited_for_past_the_stall_limit(tmp_path):
    (tmp_path / "health").write_text("ok")
    port = _port()
    # 30 progress lines half a second apart (15 s) and only then the server: longer than the
    # 6 s stall limit, but never 6 s without a new line.
    code = ("import time, http.server, functools\n"
            "for i in range(30):\n    print(f'building the kernels: step {i}'); time.sleep(0.5)\n"
            "h = functools.partial(http.server.SimpleHTTPRequestHandler, directory='.')\n"
            f"http.server.ThreadingHTTPServer(('127.0.0.1', {port}), h).serve_forever()\n")
    proc = _spawn(code, tmp_path / "log", tmp_path)
    try:
        took = wait_for_server(proc, f"http://127.0.0.1:{port}", tmp_path / "log", stall_s=6, bound_s=600)
        assert took > 6  # it waited beyond the stall limit because the log kept growing
    finally:
        proc.kill()
        proc.wait()


def test_a_silent_stuck_server_fails_with_its_log(tmp_path):
    proc = _spawn("import time; print('waiting for a lock'); time.sleep(600)", tmp_path / "log", tmp_path)
    with pytest.raises(pytest.fail.Exception, match=r"(?s)log stalled for 2 s.*waiting for a lock"):
        wait_for_server(proc, f"http://127.0.0.1:{_port()}", tmp_path / "log", stall_s=2, bound_s=600)
    assert proc.poll() is not None, "the stuck server was left running"


def test_a_server_that_exits_fails_at_once_with_its_exit_code(tmp_path):
    proc = _spawn("import sys; print('error: port in use'); sys.exit(3)", tmp_path / "log", tmp_path)
    with pytest.raises(pytest.fail.Exception, match=r"(?s)exited with 3.*port in use"):
        wait_for_server(proc, f"http://127.0.0.1:{_port()}", tmp_path / "log", stall_s=600, bound_s=600)
