"""One JIT build of a torch extension per machine and source version, safe to kill at any point.

Used by the CPU kernels (platforms/cpu/kernels.py) and the CUDA kernels (platforms/cuda/build.py)
when no prebuilt extension is installed. :func:`build` returns the path of a shared library;
the caller loads it with ``torch.ops.load_library``.

Layout under torch's extension root (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``)::

    <name>/<key>/<name>.so          the finished library: present means complete
    <name>/<key>/lock               held (flock) by the one process building it
    <name>/<key>/build-<pid>-<hex>/ one build attempt: a copy of the sources, objects, log

Why it is built this way:

* **Keyed by content, not by path.** ``key`` digests the sources, the flags, torch's version and
  C++ ABI, the Python tag and a caller-given machine key (the CPU's features, the GPU targets).
  A cached library is found by that key alone, without running ninja, so two checkouts, a test
  venv and either ninja binary all reuse one build. Each attempt compiles a private copy of
  the sources in a fresh directory, so nothing a checkout path or a ninja log says can force
  or skip a rebuild.
* **Atomic.** The library is renamed into place only after the builder process has loaded it
  and found its ops; a half-written build is never at the final path.
* **No stale lock.** The lock is an ``flock``: the kernel drops it when its holder dies by any
  signal, SIGKILL included. A waiter reads who holds it (pid, host, since when) and gives up
  after a bound with a message naming the holder and the fix.
* **Nothing outlives a kill.** The compile runs in a child process that leads its own process
  group (ninja and the compilers under it); the parent kills that group on any exception
  (SIGTERM turned into SystemExit, Ctrl-C), and the child kills its group itself if its parent
  vanishes (SIGKILL), so no orphan compiler keeps writing.

This module imports nothing from the project: the builder child runs it by path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

RECIPE = "1"
"""Bump when the way a library is built changes, so old cached builds are not reused."""
LOCK_WAIT_S = 900.0
"""How long to wait for another live process's build before giving up (the caller then runs
without the kernels, or fails with the message): a build takes 1-3 minutes on 2 cores."""
BUILD_LIMIT_S = 3600.0
"""A compile running longer than this is stuck (a hung compiler, a dead network disk)."""
PROGRESS_EVERY_S = 15.0
"""How often a running build or a wait logs where it stands (tests follow these lines)."""


@dataclass(frozen=True)
class JitSpec:
    """What to build. Paths in ``files``/``units`` are relative to ``src_dir``."""

    name: str
    """Library name (``<name>.so``) and cache folder."""
    label: str
    """For messages, e.g. "CPU kernels"."""
    src_dir: Path
    files: tuple[str, ...]
    """Every file the build reads (translation units and headers): copied and digested."""
    units: tuple[str, ...]
    """Translation units to compile (a subset of ``files``)."""
    cflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    machine_key: str = ""
    """What else the binary depends on (CPU features for -march=native, GPU targets)."""
    namespace: str = ""
    """torch.ops namespace the library registers; with ``ops``, checked before it is cached."""
    ops: tuple[str, ...] = field(default=())
    prepare: Callable[[Path], tuple[str, ...]] | None = field(default=None, compare=False)
    """Run in the parent on the attempt's copy of the sources before the compile (ROCm:
    hipify it in place); returns the translation units to compile instead of ``units``."""


def key(spec: JitSpec) -> str:
    """Digest of everything the library's bytes depend on (never a path)."""
    import torch

    h = hashlib.sha256()
    parts = [RECIPE, torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI),
             sys.implementation.cache_tag, spec.machine_key, *spec.units,
             "\0".join(spec.cflags), "\0".join(spec.cuda_cflags), "\0".join(spec.ldflags)]
    for part in parts:
        h.update(part.encode() + b"\0")
    for rel in sorted(spec.files):
        h.update(rel.encode() + b"\0" + (spec.src_dir / rel).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def extensions_root() -> Path:
    """torch's extension cache: TORCH_EXTENSIONS_DIR (torch's own variable, honoured the way
    torch's JIT build honours it) or ``~/.cache/torch_extensions``."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def cache_dir(spec: JitSpec) -> Path:
    return extensions_root() / spec.name / key(spec)


def cached(spec: JitSpec) -> Path | None:
    """The finished library for ``spec`` if one is cached (no lock, no compiler, no ninja)."""
    lib = cache_dir(spec) / f"{spec.name}.so"
    return lib if lib.is_file() else None


def build(spec: JitSpec, wait_s: float = LOCK_WAIT_S) -> Path:
    """Path of the library for ``spec``, building it first unless it is cached.

    :raises TimeoutError: another live process held the build lock longer than ``wait_s``.
    :raises RuntimeError: the compile failed (the message carries the end of its log).
    """
    lib = cached(spec)
    if lib is not None:
        return lib
    folder = cache_dir(spec)
    folder.mkdir(parents=True, exist_ok=True)
    with build_lock(folder / "lock", spec.label, wait_s):
        lib = folder / f"{spec.name}.so"
        if lib.is_file():  # built by the process we waited for
            return lib
        for old in folder.glob("build-*"):  # a killed attempt's leftovers (we hold the lock)
            shutil.rmtree(old, ignore_errors=True)
        attempt = folder / f"build-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            _copy_sources(spec, attempt / "src")
            units = spec.prepare(attempt / "src") if spec.prepare else spec.units
            _run_builder(spec, units, attempt)
            os.replace(attempt / f"{spec.name}.so", lib)
        finally:
            shutil.rmtree(attempt, ignore_errors=True)
    return lib


# ---- the lock ---------------------------------------------------------------------------------


def _holder_text(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def describe_holder(info: dict) -> str:
    if not info:
        return "another process (no holder recorded yet)"
    since = time.strftime("%H:%M:%S UTC", time.gmtime(info.get("since", 0)))
    age = time.time() - info.get("since", time.time())
    return (f"pid {info.get('pid')} on {info.get('host')} since {since} ({age:.0f} s ago; "
            f"command: {info.get('cmd', '?')})")


def _try_lock(path: Path) -> int | None:
    """An fd holding the flock on ``path`` (the file we locked is still the one at ``path``),
    or None when another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as e:
            os.close(fd)
            raise RuntimeError(
                f"cannot lock {path} ({e}); the file system does not support flock: point "
                "TORCH_EXTENSIONS_DIR at a directory on a local disk"
            ) from e
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:  # the holder released (unlinked) it between open and flock
            same = False
        if same:
            return fd
        os.close(fd)


@contextlib.contextmanager
def build_lock(path: Path, label: str, wait_s: float) -> Iterator[None]:
    """Hold the build lock at ``path`` for the block; wait at most ``wait_s`` for a live holder.

    The lock file exists only while held: a lock file whose flock is free was left by a
    process that died mid-build, and is taken over (and reported) here.
    """
    start, last_report = time.monotonic(), float("-inf")
    while (fd := _try_lock(path)) is None:
        holder = describe_holder(_holder_text(path))
        waited = time.monotonic() - start
        if waited > wait_s:
            raise TimeoutError(
                f"gave up after {waited:.0f} s waiting for the {label} build held by {holder} "
                f"(lock {path}). If that process is stuck, stop it (its lock goes with it); or "
                "build elsewhere with TORCH_EXTENSIONS_DIR=<another directory>"
            )
        if time.monotonic() - last_report >= PROGRESS_EVERY_S:
            logger.info("waiting for the %s build held by %s (%.0f s of at most %.0f s)",
                        label, holder, waited, wait_s)
            last_report = time.monotonic()
        time.sleep(0.5)
    try:
        left = _holder_text(path)
        if left:
            logger.warning("the %s build by %s did not finish (the process is gone); "
                           "building again", label, describe_holder(left))
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
              "cmd": " ".join(sys.argv)[:200]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # before unlocking: a waiter then never locks a removed file
        os.close(fd)


# ---- one build attempt --------------------------------------------------------------------------


def _copy_sources(spec: JitSpec, dest: Path) -> None:
    for rel in spec.files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(spec.src_dir / rel, target)


def _builder_env() -> dict[str, str]:
    """The environment of the builder: the PyPI ninja (the cpu/cuda extras) first on PATH when
    installed, so the build does not depend on which ninja a shell happens to find."""
    env = dict(os.environ)
    try:
        import ninja  # PyPI's ninja exposes the directory of its binary
    except ImportError:
        return env
    env["PATH"] = os.pathsep.join([ninja.BIN_DIR, env.get("PATH", "")])
    return env


def _progress(units: tuple[str, ...], attempt: Path, started: float) -> str:
    done = len(list(attempt.glob("*.o")))
    return f"{done}/{len(units)} compiled, {time.monotonic() - started:.0f} s"


def _run_builder(spec: JitSpec, units: tuple[str, ...], attempt: Path) -> None:
    """Compile in a child process group; kill the whole group if anything interrupts us."""
    log_path = attempt / "build.log"
    payload = json.dumps({"units": units, **{k: getattr(spec, k) for k in (
        "name", "cflags", "cuda_cflags", "ldflags", "namespace", "ops")}})
    logger.info("building the %s for this machine: %d sources, once per machine and source "
                "version (1-3 min on 2 cores), in %s", spec.label, len(units), attempt)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            # -P: the script's folder (platforms/) must not shadow top-level modules
            [sys.executable, "-P", str(Path(__file__).resolve()), payload], cwd=attempt, stdout=log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_builder_env(),
            start_new_session=True,
        )
    try:
        rc = _watch(proc, spec.label, units, attempt, started)
    except BaseException:  # SystemExit from SIGTERM, Ctrl-C, the limit: no orphan compiler
        _kill_group(proc)
        raise
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"the {spec.label} build failed (exit {rc}):\n{tail}")
    logger.info("built the %s in %.0f s", spec.label, time.monotonic() - started)


def _watch(proc: subprocess.Popen, label: str, units: tuple[str, ...], attempt: Path,
           started: float) -> int:
    """Wait for the builder, showing progress: a tqdm bar of compiled files on a terminal, a
    log line every PROGRESS_EVERY_S otherwise (server logs, CI, the tests that follow them)."""
    from tqdm import tqdm

    bar = tqdm(total=len(units), desc=f"building the {label}", unit="file",
               disable=not sys.stderr.isatty())
    last_log = time.monotonic()
    try:
        while True:
            try:
                return proc.wait(timeout=1.0 if not bar.disable else PROGRESS_EVERY_S)
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() - started > BUILD_LIMIT_S:
                raise RuntimeError(f"the {label} build ran over {BUILD_LIMIT_S:.0f} s; stopped "
                                   f"it (log: {attempt / 'build.log'})")
            bar.update(len(list(attempt.glob("*.o"))) - bar.n)
            if bar.disable and time.monotonic() - last_log >= PROGRESS_EVERY_S - 0.5:
                logger.info("building the %s: %s", label, _progress(units, attempt, started))
                last_log = time.monotonic()
    finally:
        bar.close()


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ---- the builder child (run by path: python jit_build.py '<json>') -----------------------------


def _die_with_parent(parent: int, poll_s: float = 0.5) -> None:
    """Kill this process group when the parent is gone (it was SIGKILLed: no one else will)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def _child_main(payload: str) -> int:
    spec = json.loads(payload)
    _die_with_parent(os.getppid())
    import torch
    from torch.utils.cpp_extension import load

    src = Path.cwd() / "src"
    load(
        name=spec["name"], sources=[str(src / u) for u in spec["units"]],
        extra_include_paths=[str(src)], extra_cflags=spec["cflags"],
        extra_cuda_cflags=spec["cuda_cflags"], extra_ldflags=spec["ldflags"],
        build_directory=str(Path.cwd()), is_python_module=False, verbose=True,
    )
    if spec["namespace"]:
        ns = getattr(torch.ops, spec["namespace"])
        missing = [op for op in spec["ops"] if not hasattr(ns, op)]
        if missing:
            print(f"the library loads but lacks ops {missing}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
