"""Loading the ``core_cpu`` kernels (csrc/cpu/): a JIT build, cached, on first use.

The sources are compiled with torch's extension build for the CPU this process runs on
(``-march=native``: AVX-512/AVX2 where present), once per machine and source version, by
:mod:`platforms.jit_build`: the cache key digests the sources, the flags, torch's version and
the CPU's model and feature flags (so a cache shared between machines never hands one of them
code for instructions it lacks), never a checkout or venv path, so every checkout and venv on
the machine reuses one build; a build killed at any point leaves no lock that blocks the next
start. The ops appear as ``torch.ops.core_cpu.*``. Nothing here runs at import time.

An installed wheel carries the sources in ``platforms/cpu/csrc/`` (setup.py copies them).
When the kernels cannot be built (no C++ compiler, no sources, another process's build held
past the wait bound), :func:`kernels_or_none` logs why once and the CPU platform runs its
plain-torch paths.
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

from platforms import jit_build
from platforms.jit_build import JitSpec

logger = logging.getLogger(__name__)

_CHECKOUT_CSRC = Path(__file__).resolve().parents[2] / "csrc" / "cpu"
_PACKAGED_CSRC = Path(__file__).resolve().parent / "csrc"
"""Where an installed wheel carries the sources (setup.py's build_py copies csrc/cpu there)."""
CSRC_DIR = _PACKAGED_CSRC if _PACKAGED_CSRC.is_dir() else _CHECKOUT_CSRC
"""The sources: the copy inside an installed package, else the repository's csrc/cpu (a
checkout, editable installs)."""

# ---- what is built: sources and flags, in one place ----------------------------------------
SOURCE_SUFFIXES = (".cpp", ".h")
"""Every file of csrc/cpu with these suffixes is part of the build (and of its cache key)."""
CXX_FLAGS = ("-O3", "-march=native", "-fopenmp")
"""-fopenmp makes at::parallel_for use torch's OpenMP pool (the library links the same
libgomp soname torch ships, so there is one thread pool, not two)."""
LD_FLAGS = ("-fopenmp",)
OPS = (
    "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "write_kv",
    "paged_decode", "write_kv_fp8", "paged_decode_fp8", "linear_f32out", "quant_linear", "quant_dequantize", "cpu_isa", "set_cpu_isa",
    "cpu_isas",
)


def kernel_sources(csrc: Path = CSRC_DIR) -> list[Path]:
    """The translation units (each .cpp of csrc/cpu)."""
    return sorted(csrc.glob("*.cpp"))


def jit_spec(csrc: Path = CSRC_DIR) -> JitSpec:
    """The build of csrc/cpu for this machine's CPU."""
    return JitSpec(
        name="core_cpu",
        label="CPU kernels",
        src_dir=csrc,
        files=tuple(p.name for p in sorted(csrc.glob("*")) if p.suffix in SOURCE_SUFFIXES),
        units=tuple(p.name for p in kernel_sources(csrc)),
        cflags=CXX_FLAGS,
        ldflags=LD_FLAGS,
        machine_key=_cpu_digest(),
        namespace="core_cpu",
        ops=OPS,
    )


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
    lib = jit_build.cached(jit_spec())
    if lib is not None:
        return True, f"built for this CPU, cached at {lib}"
    return True, f"JIT build of {CSRC_DIR} with {compiler} on first use (then cached)"


@functools.cache
def load_kernels() -> Any:
    """Register the ``core_cpu`` ops in this process (once) and return ``torch.ops.core_cpu``.

    :raises RuntimeError: the kernels cannot be built here (the message says why).
    :raises TimeoutError: another live process's build of them held the lock too long.
    """
    if _registered():
        return torch.ops.core_cpu
    ok, why = kernels_status()
    if not ok:
        raise RuntimeError(f"cannot load the CPU kernels: {why}")
    torch.ops.load_library(str(jit_build.build(jit_spec())))
    return torch.ops.core_cpu


@functools.cache
def kernels_or_none() -> Any | None:
    """``torch.ops.core_cpu`` when the kernels load, else None (the reason logged once)."""
    try:
        return load_kernels()
    except Exception as e:  # a failed compile must not stop the engine: torch paths remain
        logger.warning("CPU kernels unavailable, using plain torch ops (slower): %s", e)
        return None
