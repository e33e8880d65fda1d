"""The instruction-set path of the CPU kernels (csrc/cpu/isa.cpp), named without building them.

The kernels pick their path once per process from the running CPU (AVX-512, AVX2 + FMA +
F16C, NEON with dot products, or portable C++). :func:`detected_isa` reads the same features
from /proc/cpuinfo, so ``core platforms`` and the default weight format can name the path
without compiling anything; :func:`isa_in_force` asks the loaded library itself, and
:func:`force_isa` makes it take a lower path (tests and benchmarks: the AVX2 path on an
AVX-512 machine).
"""

from __future__ import annotations

import functools
import platform

import torch

_X86_PATHS = (("avx512", ("avx512f", "avx512bw", "avx512vl")), ("avx2", ("avx2", "fma", "f16c")))


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (x86 ``flags`` / Arm ``Features`` of /proc/cpuinfo); empty where
    unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def detected_isa(flags: frozenset[str] | None = None, machine: str | None = None) -> str:
    """The path csrc/cpu takes on this CPU: ``avx512``, ``avx2``, ``neon_dot`` or ``generic``."""
    flags = cpu_flags() if flags is None else flags
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64", "i686", "i386"):
        for name, needs in _X86_PATHS:
            if all(f in flags for f in needs):
                return name
    elif machine in ("aarch64", "arm64") and "asimddp" in flags:
        return "neon_dot"
    return "generic"


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """AVX512-BF16 or AMX-BF16: bf16 dot products in hardware (torch's bf16 CPU paths are
    emulated, and slower than float32, without them)."""
    flags = cpu_flags() if flags is None else flags
    return "avx512_bf16" in flags or "amx_bf16" in flags


def isa_in_force() -> str:
    """The path the loaded kernels take now; :func:`detected_isa` when they are not loaded."""
    if hasattr(torch.ops.core_cpu, "cpu_isa"):
        return torch.ops.core_cpu.cpu_isa()
    return detected_isa()


def force_isa(name: str) -> str:
    """Make the kernels take path ``name`` (``auto`` for the best); builds them if needed.

    :raises ValueError: the CPU (or this build) cannot run ``name``; the message lists what it can.
    """
    from platforms.cpu.kernels import load_kernels

    return load_kernels().set_cpu_isa(name)
