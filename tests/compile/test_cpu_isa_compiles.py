"""The CPU kernels' ISA paths this machine cannot run: compiled for them, run under emulation.

* AArch64: every csrc/cpu source compiles with Debian's cross compiler against torch's
  headers (``-march=armv8-a``: the NEON dot-product code carries its own target attribute);
  tests/cpu_isa/driver.cpp (the quantized GEMM of csrc/cpu/quant_gemm.cpp on every path the
  CPU reports, against a double reference) is cross-built and run under ``qemu-aarch64``
  with a CPU that has the dot-product extension (``-cpu max``: the ``neon_dot`` path) and one
  without (``-cpu cortex-a53``: only ``generic``).
* x86-64 without AVX-512: the driver built for Haswell (``-march=haswell``, what
  ``-march=native`` gives on an AVX2 CPU) runs under ``qemu-x86_64 -cpu Haswell``, where the
  run-time detection must find ``avx2`` and no ``avx512``.
* The driver built for this machine runs natively.

The cross and emulated checks need ``g++-aarch64-linux-gnu`` and ``qemu-user`` and are
skipped, with the reason, where they are absent (CI as root: ``apt-get install -y
--no-install-recommends g++-aarch64-linux-gnu qemu-user``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc" / "cpu"
DRIVER = [ROOT / "tests" / "cpu_isa" / "driver.cpp", CSRC / "quant_gemm.cpp", CSRC / "isa.cpp"]
CROSS = shutil.which("aarch64-linux-gnu-g++")
QEMU_ARM = shutil.which("qemu-aarch64")
QEMU_X86 = shutil.which("qemu-x86_64")
HOST = shutil.which("g++") or shutil.which("c++")
INSTALL = "apt-get install -y --no-install-recommends g++-aarch64-linux-gnu qemu-user"
needs_cross = pytest.mark.skipif(CROSS is None, reason=f"aarch64-linux-gnu-g++ not found (CI: {INSTALL})")
needs_qemu_arm = pytest.mark.skipif(CROSS is None or QEMU_ARM is None, reason=f"cross g++ or qemu-aarch64 missing ({INSTALL})")
needs_qemu_x86 = pytest.mark.skipif(HOST is None or QEMU_X86 is None, reason=f"g++ or qemu-x86_64 missing ({INSTALL})")


def build(compiler: str, out: Path, *flags: str) -> Path:
    cmd = [compiler, "-std=c++17", "-O2", "-Wall", "-Werror", f"-I{CSRC}", *flags, *map(str, DRIVER), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr}"
    return out


def run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def paths(output: str) -> set[str]:
    """The ISA names of the driver's PASS lines (every line must be a PASS)."""
    lines = output.strip().splitlines()
    assert lines and all(ln.startswith("PASS ") for ln in lines), output
    return {ln.split()[1] for ln in lines}


@needs_cross
@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.cpp")))
def test_every_cpu_source_compiles_for_aarch64(source: str) -> None:
    includes = [f"-I{p}" for p in include_paths()] + [f"-I{CSRC}"]
    cmd = [CROSS, "-std=c++17", "-O2", "-march=armv8-a", "-fopenmp", "-fsyntax-only", *includes, str(CSRC / source)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


@needs_qemu_arm
def test_neon_dot_path_matches_the_reference_under_qemu(tmp_path: Path) -> None:
    exe = build(CROSS, tmp_path / "driver-arm", "-march=armv8-a", "-static")
    assert paths(run([QEMU_ARM, "-cpu", "max", str(exe)])) == {"neon_dot", "generic"}
    assert paths(run([QEMU_ARM, "-cpu", "cortex-a53", str(exe)])) == {"generic"}  # no sdot: not taken


@needs_qemu_x86
def test_avx2_only_cpu_takes_the_avx2_path_under_qemu(tmp_path: Path) -> None:
    exe = build(HOST, tmp_path / "driver-haswell", "-march=haswell")
    assert paths(run([QEMU_X86, "-cpu", "Haswell", str(exe)])) == {"avx2", "generic"}


@pytest.mark.skipif(HOST is None, reason="no host C++ compiler")
def test_every_path_of_this_cpu_matches_the_reference(tmp_path: Path) -> None:
    exe = build(HOST, tmp_path / "driver-native", "-march=native")
    assert "generic" in paths(run([str(exe)]))
