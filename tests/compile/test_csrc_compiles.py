"""Compile-check the CUDA device code in csrc/ with this machine's nvcc (no GPU needed).

The .cu files hold plain CUDA C++ (no torch headers), so a build break in a kernel is caught
here, on CPU-only CI, in seconds. Skipped only when nvcc is absent. The torch op
registration (.cpp) needs torch's CUDA headers and is compiled by the JIT/package build.
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from platforms.cuda.build import CSRC_DIR, find_nvcc

NVCC = find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA toolkit absent")

# The flags torch's extension build passes to nvcc that change what the code may use.
TORCH_NVCC_DEFINES = (
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
)
# sm_90 machine code (the H200), plus PTX for sm_75, which takes the non-cp.async path.
ARCH = ("-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_75,code=compute_75")
CU_FILES = sorted(CSRC_DIR.rglob("*.cu"))


def _compile(src: Path, out_dir: Path) -> subprocess.CompletedProcess:
    cmd = [NVCC, "-std=c++17", "-O3", *ARCH, *TORCH_NVCC_DEFINES, "-I", str(CSRC_DIR),
           "-Xptxas", "-warn-spills", "-c", str(src), "-o", str(out_dir / (src.stem + ".o"))]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_every_cu_file_compiles_for_hopper(tmp_path):
    assert CU_FILES, f"no .cu files under {CSRC_DIR}"
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda p: _compile(p, tmp_path), CU_FILES))
    failures = [
        f"{src.relative_to(CSRC_DIR)}:\n{r.stderr}" for src, r in zip(CU_FILES, results)
        if r.returncode != 0
    ]
    assert not failures, "nvcc failed:\n" + "\n".join(failures)
    spills = [
        f"{src.relative_to(CSRC_DIR)}: {line}" for src, r in zip(CU_FILES, results)
        for line in r.stderr.splitlines() if "spill" in line and " 0 bytes" not in line
    ]
    assert not spills, "register spills (local memory in a hot loop):\n" + "\n".join(spills)


def test_device_code_needs_no_torch_headers():
    device_files = CU_FILES + sorted(CSRC_DIR.rglob("*.cuh")) + sorted(CSRC_DIR.rglob("*.h"))
    offenders = [
        str(p.relative_to(CSRC_DIR)) for p in device_files
        if re.search(r'#include\s*[<"](torch|ATen|c10)/', p.read_text())
    ]
    assert not offenders, f"device code includes torch headers: {offenders}"


# CUDA-only spellings that must appear nowhere but csrc/cuda_compat.h, so that hipify plus
# that one header is all a ROCm build needs.
CUDA_ONLY = re.compile(
    r"__shfl|__syncwarp|\basm\b|cp\.async|__nv_bfloat16|cuda_bf16\.h|__half2?\b|warpSize|"
    r"\b32\s*\*\s*sizeof|ex2\.approx"
)


def test_cuda_specifics_live_only_in_cuda_compat():
    """Over the GPU sources: csrc/cpu is host C++ for the CPU platform, never hipified (its
    inline-asm register barriers are x86 code, not CUDA)."""
    offenders = []
    for p in sorted(CSRC_DIR.rglob("*")):
        if p.suffix not in (".cu", ".cuh", ".h", ".cpp") or p.name == "cuda_compat.h":
            continue
        if p.relative_to(CSRC_DIR).parts[0] == "cpu":
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("//", 1)[0]
            if CUDA_ONLY.search(code):
                offenders.append(f"{p.relative_to(CSRC_DIR)}:{n}: {line.strip()}")
    assert not offenders, "CUDA-only code outside cuda_compat.h:\n" + "\n".join(offenders)
