"""The CPU kernels' JIT build (platforms/jit_build.py): killed at any point it leaves nothing
that blocks the next start, and once built it is found again from any checkout path, venv or
ninja without compiling.

Real builds of csrc/cpu in a temporary TORCH_EXTENSIONS_DIR (1-3 minutes each on a busy
2-core machine); every wait follows progress (a compiler process appearing, a process
exiting) under a generous bound, never a tight clock.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from platforms import jit_build
from platforms.cpu import kernels
from tests.helpers import tiny_llama_dir

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LOAD = (
    "import logging; logging.basicConfig(level=logging.INFO); "
    "import platforms.cpu.kernels as k; ops = k.load_kernels(); "
    "print('CSRC', k.CSRC_DIR); print('OPS', ops.rms_norm)"
)
COMPILER_NAMES = ("cc1plus", "cc1", "clang", "clang++")


# ---- processes -------------------------------------------------------------------------------
def _process_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, comm, state) for every process (Linux /proc)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(entry.name)] = (int(fields[1]), comm, fields[0])
    return table


def _descendants(pid: int) -> dict[int, str]:
    """pid -> comm of every live process below ``pid`` (any depth)."""
    table = _process_table()
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, comm, state) in table.items():
            if ppid == parent and child not in found and state != "Z":
                found[child] = comm
                frontier.append(child)
    return found


def _alive(pids) -> list[int]:
    table = _process_table()
    return [p for p in pids if p in table and table[p][2] != "Z"]


def _wait_for_compiler(proc: subprocess.Popen, log: Path, bound: float = 900.0) -> dict[int, str]:
    """Wait until a compiler runs under ``proc`` (mid-compile); return its process tree."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode} before compiling:\n{log.read_text()}"
        tree = _descendants(proc.pid)
        if any(name in COMPILER_NAMES for name in tree.values()):
            return tree
        time.sleep(0.2)
    pytest.fail(f"no compiler started within {bound:.0f} s:\n{log.read_text()}")


def _wait_gone(pids, bound: float = 60.0) -> list[int]:
    deadline = time.monotonic() + bound
    while (left := _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _env(ext_root: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_root), "PYTHONPATH": str(ROOT),
            "CORE_PLATFORM": "cpu", "CORE_NUM_THREADS": "1", **extra}


def _spawn(cmd: list[str], env: dict, log: Path, cwd: Path = ROOT) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the build folder ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ext_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("torch_extensions")


def _build_folder(ext_root: Path) -> Path:
    folders = list((ext_root / "core_cpu").iterdir())
    assert len(folders) == 1, folders
    return folders[0]


def test_a_build_killed_by_sigterm_or_sigkill_never_blocks_the_next_start(ext_root, tmp_path):
    # 1. `core serve` SIGTERMed while its compiler runs: it exits, kills its compilers and
    #    removes its lock and its half-built folder.
    model = tiny_llama_dir(tmp_path)
    serve = [sys.executable, "-m", "core.entrypoints.cli", "serve", str(model), "--port",
             str(_free_port()), "--dtype", "float32", "--kv-cache-memory", "16MiB"]
    log_a = tmp_path / "serve.log"
    a = _spawn(serve, _env(ext_root), log_a)
    tree = _wait_for_compiler(a, log_a)
    a.send_signal(signal.SIGTERM)
    assert a.wait(120) == 128 + signal.SIGTERM, log_a.read_text()
    assert not _wait_gone(tree), f"compilers outlived the SIGTERMed server: {tree}"
    folder = _build_folder(ext_root)
    assert not (folder / "lock").exists(), "the SIGTERMed build left its lock"
    assert not list(folder.glob("build-*")), "the SIGTERMed build left its half-built folder"

    # 2. A loader SIGKILLed mid-compile (no handler runs): its builder notices and kills its
    #    compilers; the lock file stays, but its flock went with the process.
    log_b = tmp_path / "sigkill.log"
    b = _spawn([sys.executable, "-c", LOAD], _env(ext_root), log_b)
    tree = _wait_for_compiler(b, log_b)
    b.kill()
    b.wait()
    assert not _wait_gone(tree), f"compilers outlived the SIGKILLed loader: {tree}"
    assert json.loads((folder / "lock").read_text())["pid"] == b.pid

    # 3. The next start builds and loads without hanging, and says what it took over.
    log_c = tmp_path / "next.log"
    c = _spawn([sys.executable, "-c", LOAD], _env(ext_root), log_c)
    assert c.wait(1800) == 0, log_c.read_text()
    out = log_c.read_text()
    assert "OPS core_cpu.rms_norm" in out
    assert f"pid {b.pid}" in out and "did not finish" in out, out
    assert (folder / "core_cpu.so").is_file()
    assert not (folder / "lock").exists() and not list(folder.glob("build-*"))


def _copy_checkout(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "build")
    for part in ("core", "platforms", "csrc"):
        shutil.copytree(ROOT / part, dest / part, ignore=ignore)
    return dest


def _recording_shims(bin_dir: Path, marker: Path) -> None:
    """ninja and c++ shims that note every call, then run the system's tool."""
    bin_dir.mkdir()
    for tool in ("ninja", "c++", "g++"):
        real = shutil.which(tool, path="/usr/bin:/usr/local/bin")
        shim = bin_dir / tool
        shim.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{marker}"\nexec {real or "false"} "$@"\n')
        shim.chmod(0o755)


def test_a_cached_build_is_reused_from_another_checkout_with_another_ninja(ext_root, tmp_path):
    first = subprocess.run([sys.executable, "-c", LOAD], env=_env(ext_root), cwd=ROOT,
                           capture_output=True, text=True, timeout=1800)
    assert first.returncode == 0, first.stdout + first.stderr
    lib = _build_folder(ext_root) / "core_cpu.so"
    before = lib.stat()

    other = _copy_checkout(tmp_path / "other-checkout")
    marker = tmp_path / "tool-calls.txt"
    _recording_shims(tmp_path / "bin", marker)
    path = os.pathsep.join([str(tmp_path / "bin"), "/usr/bin", "/bin"])  # not the venv's ninja
    second = subprocess.run([sys.executable, "-c", LOAD], cwd=tmp_path,
                            env=_env(ext_root, PYTHONPATH=str(other), PATH=path),
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"CSRC {other / 'csrc' / 'cpu'}" in second.stdout, "loaded the original checkout"
    assert "building" not in second.stderr, second.stderr
    assert not marker.exists(), f"a cached build ran tools: {marker.read_text()}"
    after = lib.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


# ---- the lock, without compiling ---------------------------------------------------------------
def test_the_key_names_no_path(tmp_path):
    copy = tmp_path / "elsewhere" / "cpu"
    shutil.copytree(kernels.CSRC_DIR, copy)
    assert jit_build.key(kernels.jit_spec(copy)) == jit_build.key(kernels.jit_spec())
    (copy / "elementwise.cpp").write_text((copy / "elementwise.cpp").read_text() + "\n// edit\n")
    assert jit_build.key(kernels.jit_spec(copy)) != jit_build.key(kernels.jit_spec())


def test_a_live_holder_is_waited_on_with_a_bound_and_named(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    spec = kernels.jit_spec()
    folder = jit_build.cache_dir(spec)
    folder.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from platforms import jit_build; "
        f"cm = jit_build.build_lock(Path({str(folder / 'lock')!r}), 'CPU kernels', 5); "
        "cm.__enter__(); print('held', flush=True); time.sleep(600)")],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        caplog.set_level("INFO", logger="platforms.jit_build")
        with pytest.raises(TimeoutError) as err:
            jit_build.build(spec, wait_s=2)
        message = str(err.value)
        assert f"pid {holder.pid}" in message and "since" in message, message
        assert "TORCH_EXTENSIONS_DIR" in message and "stop it" in message, message
        assert f"waiting for the CPU kernels build held by pid {holder.pid}" in caplog.text
    finally:
        holder.kill()
        holder.wait()
    # Killed, it holds nothing: the lock is taken at once (the build is not run here).
    with jit_build.build_lock(folder / "lock", "CPU kernels", wait_s=0):
        assert json.loads((folder / "lock").read_text())["pid"] == os.getpid()
    assert not (folder / "lock").exists()


def test_a_lock_file_left_by_a_dead_process_is_taken_over_and_reported(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / "lock"
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                "since": time.time() - 99, "cmd": "core serve"}))
    caplog.set_level("INFO", logger="platforms.jit_build")
    with jit_build.build_lock(lock, "CPU kernels", wait_s=0):
        pass
    assert f"pid {dead.pid}" in caplog.text and "did not finish" in caplog.text
    assert not lock.exists()
