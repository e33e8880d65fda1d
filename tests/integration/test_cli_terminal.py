"""``core chat`` and ``core generate`` in a real pseudo-terminal (pexpect), and the CLI's
error lines.

The chat model is a tiny random Llama whose EOS ids are all removed, so a reply can end
only at its token limit: with ``--max-tokens`` in the thousands a reply runs for many
seconds, and seeing its text and then stopping it with Ctrl-C proves that tokens reach the
terminal before the reply ends, with no clock in the test. Waits are generous bounds
(the first run may JIT-build the CPU kernels), never measured durations.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from tests.helpers import tiny_llama_dir

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 900  # engine start incl. a cold CPU-kernel build on a loaded 2-core box
REPLY_TIMEOUT = 120
MAX_LEN = 8192
PROMPT = "> "


def _never_ending(path: Path) -> Path:
    """Remove every EOS id (tokenizer, config, generation config): replies end only at
    max_tokens."""
    for name in ("config.json", "generation_config.json"):
        f = path / name
        if f.exists():
            cfg = json.loads(f.read_text())
            cfg["eos_token_id"] = None
            f.write_text(json.dumps(cfg))
    tok = path / "tokenizer_config.json"
    cfg = json.loads(tok.read_text())
    cfg["eos_token"] = None
    tok.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return _never_ending(tiny_llama_dir(tmp_path_factory.mktemp("cli"), max_position_embeddings=MAX_LEN))


def _ctrl_c_as_in_a_terminal() -> None:
    """In the child before exec: SIGINT at its default. A process started in the background
    by a non-interactive shell (``make test &``, a CI runner's job) inherits SIGINT ignored,
    Python then installs no KeyboardInterrupt handler, and every Ctrl-C these tests send
    would be dropped (they failed so on 2026-12-06, waiting for "Ctrl-C again"). A user's
    terminal delivers it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "CORE_PLATFORM": "cpu", "CORE_NUM_THREADS": "1",
            "CORE_LOG_LEVEL": "WARNING", "TERM": "dumb"}


def _spawn_chat(model: Path, *extra: str) -> pexpect.spawn:
    # one KV block more than one full-length sequence needs (plus the null block): a
    # second reply can start only if the stopped one gave its blocks back
    blocks = MAX_LEN // 16 + 2
    args = ["-m", "core.entrypoints.cli", "chat", "--model", str(model), "--dtype", "float32",
            "--block-size", "16", "--num-blocks-override", str(blocks), "--max-tokens", str(MAX_LEN - 64), *extra]
    child = pexpect.spawn(sys.executable, args, env=_env(), cwd=str(ROOT), encoding="utf-8",
                          codec_errors="replace", timeout=REPLY_TIMEOUT, dimensions=(40, 200),
                          preexec_fn=_ctrl_c_as_in_a_terminal)
    child.expect_exact(PROMPT, timeout=START_TIMEOUT)
    return child


def _stream_then_stop(child: pexpect.spawn, message: str) -> None:
    child.sendline(message)
    child.expect_exact(message)  # the terminal's echo of the typed line
    child.expect(r"\S")  # reply text on screen, while the reply (thousands of tokens) runs
    child.sendintr()
    child.expect_exact("[reply stopped]")
    child.expect_exact(PROMPT)


def test_chat_streams_ctrl_c_stops_reply_ctrl_d_exits(chat_model):
    child = _spawn_chat(chat_model)
    try:
        _stream_then_stop(child, "hello there")
        # the engine is usable again and the stopped reply's KV blocks are free
        _stream_then_stop(child, "and again")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert "Traceback" not in (child.before or "")
    assert child.exitstatus == 0, child.before


def test_chat_second_ctrl_c_at_prompt_exits_cleanly(chat_model):
    child = _spawn_chat(chat_model)
    try:
        child.sendintr()
        child.expect_exact("Ctrl-C again")
        child.sendintr()
        child.expect(pexpect.EOF)
        out = child.before
    finally:
        child.close()
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert child.exitstatus == 0, out


def test_generate_streams_and_ctrl_c_stops(chat_model, tmp_path):
    # Only stdout is the terminal: stderr (the start-up spinner a slow start draws, the
    # "interrupted" line) goes to a file, so the first visible character on the terminal
    # is reply text by construction and the Ctrl-C lands while the reply streams.
    args = ["-m", "core.entrypoints.cli", "generate", "hi", "--model", str(chat_model), "--dtype", "float32",
            "--max-tokens", str(MAX_LEN - 64)]
    err = tmp_path / "stderr.txt"
    child = pexpect.spawn("/bin/sh", ["-c", 'exec "$0" "$@" 2>"$CORE_TEST_STDERR"', sys.executable, *args],
                          env={**_env(), "CORE_TEST_STDERR": str(err)}, cwd=str(ROOT), encoding="utf-8",
                          codec_errors="replace", timeout=START_TIMEOUT, preexec_fn=_ctrl_c_as_in_a_terminal)
    try:
        child.expect(r"\S")  # reply text
        child.sendintr()
        child.expect(pexpect.EOF, timeout=REPLY_TIMEOUT)
        out = child.before
    finally:
        child.close()
    stderr = err.read_text()
    assert "Traceback" not in out + stderr, out + stderr
    # stopped, not finished (the text came before the end) and not an interrupted start-up
    assert "interrupted" not in stderr, stderr
    assert child.exitstatus == 130, (child.exitstatus, child.signalstatus, out, stderr)


# ---- error lines ------------------------------------------------------------------------------


def _core(*args: str, timeout: float = START_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "core.entrypoints.cli", *args], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_missing_model_is_one_error_line(tmp_path):
    missing = tmp_path / "nonexistent" / "model"
    r = _core("generate", "hi", "--model", str(missing))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and str(missing) in lines[0] and "--model" in lines[0], r.stderr


def test_debug_shows_the_traceback(tmp_path):
    r = _core("generate", "hi", "--debug", "--model", str(tmp_path / "nope"))
    assert r.returncode != 0
    assert "Traceback" in r.stderr and "FileNotFoundError" in r.stderr, r.stderr


def test_busy_port_is_refused_before_the_model_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # a model path that does not exist: the port error must come first
        r = _core("serve", str(tmp_path / "not-loaded"), "--port", str(port), timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert f"port {port}" in r.stderr and "already in use" in r.stderr and "--port" in r.stderr, r.stderr
    assert "not-loaded" not in r.stderr, r.stderr


def test_kv_too_small_is_one_error_line(chat_model):
    r = _core("generate", "hi", "--model", str(chat_model), "--kv-cache-memory", "64KiB")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    err = next(ln for ln in r.stderr.splitlines() if ln.startswith("error:"))
    assert "--kv-cache-memory" in err and "--max-model-len" in err, err


def test_bench_throughput_shows_progress_between_plan_and_result(chat_model):
    # bars appear after core.progress.DELAY_S; 0 here so that even a fast machine draws them
    code = ("import sys, core.progress as p; p.DELAY_S = 0; from core.entrypoints.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    args = ["-c", code, "bench", "throughput", "--model", str(chat_model), "--dtype", "float32",
            "--kv-cache-memory", "16MiB", "--num-prompts", "4", "--input-len", "8", "--output-len", "16"]
    env = {**_env(), "CORE_LOG_LEVEL": "INFO"}
    child = pexpect.spawn(sys.executable, args, env=env, cwd=str(ROOT), encoding="utf-8",
                          codec_errors="replace", timeout=START_TIMEOUT)
    try:
        child.expect_exact("starting the engine")
        child.expect_exact("loading weights")
        child.expect_exact("KV cache:")  # the plan, logged above the bars
        child.expect(r"output tokens: +\d+%")  # the bench's own bar, before the result
        child.expect_exact("Throughput:")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before
