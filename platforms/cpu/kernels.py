"""Loading the ``core_cpu`` kernels (csrc/cpu/): a JIT build, cached, on first use.

The sources are compiled with :func:`torch.utils.cpp_extension.load` for the CPU this process
runs on (``-march=native``: AVX-512/AVX2 where present) into torch's extension cache, once;
later runs reuse the library until a source file or flag changes. The build name carries a
digest of the CPU's model and feature flags, so a cache shared between different machines
never hands one of them code for instructions it lacks. The ops appear as
``torch.ops.core_cpu.*``. Nothing here runs at import time.

An installed wheel carries the sources in ``platforms/cpu/csrc/`` (setup.py copies them).
When the kernels cannot be built (no C++ compiler, no sources),
:func:`kernels_or_none` logs why once and the CPU platform runs its plain-torch paths.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import shutil
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CHECKOUT_CSRC = Path(__file__).resolve().parents[2] / "csrc" / "cpu"
_PACKAGED_CSRC = Path(__file__).resolve().parent / "csrc"
"""Where an installed wheel carries the sources (setup.py's build_py copies csrc/cpu there)."""
CSRC_DIR = _PACKAGED_CSRC if _PACKAGED_CSRC.is_dir() else _CHECKOUT_CSRC
"""The sources: the copy inside an installed package, else the repository's csrc/cpu (a
checkout, editable installs)."""
CXX_FLAGS = ("-O3", "-march=native", "-fopenmp")
"""-fopenmp makes at::parallel_for use torch's OpenMP pool (the library links the same
libgomp soname torch ships, so there is one thread pool, not two)."""
OPS = (
    "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "write_kv",
    "paged_decode", "linear_f32out", "quant_linear", "cpu_isa", "set_cpu_isa", "cpu_isas",
)


def kernel_sources(csrc: Path = CSRC_DIR) -> list[Path]:
    return sorted(csrc.glob("*.cpp"))


def _cpu_digest() -> str:
    """Short digest of the CPU model and ISA flags (the -march=native build depends on them)."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        text += "".join(sorted(set(lines)))
    except OSError:
        text += platform.processor()
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _source_digest(csrc: Path = CSRC_DIR) -> str:
    """Short digest of the kernel sources: a build name per source version, so two installs
    (or a checkout and an install) sharing torch's extension cache never load each other's
    library (ninja alone decides by file times, which pip sets at install)."""
    h = hashlib.sha256()
    for path in sorted(csrc.glob("*")):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:10]


def _registered() -> bool:
    """Whether every op is already registered in this process (an earlier load)."""
    return all(hasattr(torch.ops.core_cpu, name) for name in OPS)


def kernels_status() -> tuple[bool, str]:
    """(can the kernels be loaded here, how or why not), without compiling anything."""
    if not kernel_sources():
        return False, f"the CPU kernel sources ({CSRC_DIR}) are not here to build"
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        return False, "no C++ compiler (c++, g++ or clang++) on PATH to build csrc/cpu"
    return True, f"JIT build of {CSRC_DIR} with {compiler} (cached after the first run)"


@functools.cache
def load_kernels() -> Any:
    """Register the ``core_cpu`` ops in this process (once) and return ``torch.ops.core_cpu``.

    :raises RuntimeError: the kernels cannot be built here (the message says why).
    """
    if _registered():
        return torch.ops.core_cpu
    ok, why = kernels_status()
    if not ok:
        raise RuntimeError(f"cannot load the CPU kernels: {why}")
    from torch.utils.cpp_extension import load

    logger.info("building the CPU kernels from %s if not cached (first run: under a minute)", CSRC_DIR)
    load(
        name=f"core_cpu_{_cpu_digest()}_{_source_digest()}",
        sources=[str(p) for p in kernel_sources()],
        extra_include_paths=[str(CSRC_DIR)],
        extra_cflags=list(CXX_FLAGS),
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=logger.isEnabledFor(logging.DEBUG),
    )
    return torch.ops.core_cpu


@functools.cache
def kernels_or_none() -> Any | None:
    """``torch.ops.core_cpu`` when the kernels load, else None (the reason logged once)."""
    try:
        return load_kernels()
    except Exception as e:  # a failed compile must not stop the engine: torch paths remain
        logger.warning("CPU kernels unavailable, using plain torch ops (slower): %s", e)
        return None
