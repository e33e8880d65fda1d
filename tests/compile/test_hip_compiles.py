"""Hipify csrc/ as the ROCm build does and compile its device code for CDNA with hipcc.

No AMD GPU is needed, and none is used: this proves that the kernels hipify and compile for
gfx90a (64-wide wavefronts) with torch's HIP flags, that hipcc reports no register spills and
the decode kernel's occupancy the decode planner assumes (CTAS_PER_SM blocks per CU, by
registers and by LDS), that a 32-wide target is refused with the reason, and that no
CUDA-only spelling survives hipify outside cuda_compat.h. It cannot prove that anything
computes the right numbers on an AMD GPU.

The hipify checks need only torch; the compile checks need hipcc and are skipped, with the
reason, where it is absent (CI: ``apt-get install -y --no-install-recommends hipcc``).
The torch op registration (.cpp) needs a ROCm build of torch's headers and is not compiled.
"""

from __future__ import annotations

import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils.cpp_extension import COMMON_HIP_FLAGS, COMMON_HIPCC_FLAGS

from platforms.cuda.attention import CTAS_PER_SM
from platforms.rocm.build import CSRC_DIR, HIPCC_FLAGS, find_hipcc, hipify_sources

HIPCC = find_hipcc()
needs_hipcc = pytest.mark.skipif(
    HIPCC is None,
    reason="hipcc not found (CI installs it: apt-get install -y --no-install-recommends hipcc)",
)
OFFLOAD_ARCH = "gfx90a"  # MI200 (CDNA2): 64-wide wavefronts, 64 KiB of LDS per CU
LDS_PER_CU = 64 * 1024
# Debian's hipcc targets NVIDIA when it finds nvcc on PATH (as on CI, which also runs the
# CUDA compile check); the AMD toolchain is what is under test.
HIPCC_ENV = {**os.environ, "HIP_PLATFORM": "amd"}

CUDA_RUNTIME_NAME = re.compile(r"\bcuda[A-Z]\w*|\b__nv_\w+|\bcuda_(runtime|fp16|bf16)\w*")
CUDA_ONLY_ACTIVE = re.compile(
    r"\bcuda\w*|\b__nv_\w+|__shfl\w*_sync|__syncwarp|__(any|all|ballot)_sync|cp\.async|"
    r"griddepcontrol|ex2\.approx|\bnv_bfloat16"
)


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """(stage dir, hipified translation units, csrc listing before, csrc listing after)."""
    before = _listing(CSRC_DIR)
    stage = tmp_path_factory.mktemp("hip") / "csrc"
    units = hipify_sources(stage)
    return stage, units, before, _listing(CSRC_DIR)


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*") if p.is_file()
    }


def _code(text: str) -> str:
    """``text`` without comments and string literals."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def _device_units(units: list[Path]) -> list[Path]:
    return [u for u in units if u.suffix == ".hip"]


def _hipcc(src: Path, stage: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [HIPCC, "-std=c++17", *HIPCC_FLAGS, *COMMON_HIP_FLAGS, *COMMON_HIPCC_FLAGS,
           f"--offload-arch={OFFLOAD_ARCH}", "-I", str(stage), *extra, str(src)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=HIPCC_ENV,
                          cwd=stage)


# ---- hipify (torch only) -----------------------------------------------------------------
def test_hipify_writes_nothing_into_csrc(staged):
    stage, units, before, after = staged
    assert after == before, "hipify changed csrc/"
    cu_files = sorted(CSRC_DIR.rglob("*.cu"))
    assert cu_files and len(_device_units(units)) == len(cu_files)
    for unit in units:
        assert unit.is_relative_to(stage) and unit.is_file()


def test_no_cuda_runtime_name_survives_hipify(staged):
    stage, units, _, _ = staged
    hipified = units + [p for p in stage.rglob("*_hip.*") if p.suffix in (".h", ".cuh", ".cpp")]
    offenders = []
    for path in hipified:
        if path.name == "hip_compat.h":  # its CUDA branch keeps CUDA names, by design
            continue
        for n, line in enumerate(_code(path.read_text()).splitlines(), 1):
            if CUDA_RUNTIME_NAME.search(line):
                offenders.append(f"{path.relative_to(stage)}:{n}: {line.strip()}")
    assert not offenders, "CUDA names hipify did not map:\n" + "\n".join(offenders)


# ---- hipcc (skipped without it) ----------------------------------------------------------
RESOURCE = re.compile(r"remark:\s+(.+?):\s+(\S+)\s+\[-Rpass-analysis=kernel-resource-usage\]")


def _resource_usage(stderr: str) -> dict[str, dict[str, str]]:
    """hipcc's per-kernel resource report: kernel (mangled) -> {field: value}."""
    kernels: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for key, value in RESOURCE.findall(stderr):
        if key == "Function Name":
            current = kernels.setdefault(value, {})
        else:
            current[key] = value
    return kernels


@needs_hipcc
def test_device_code_compiles_for_cdna_without_spills(staged, tmp_path):
    stage, units, _, _ = staged
    device = _device_units(units)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(
            lambda u: _hipcc(u, stage, "-Rpass-analysis=kernel-resource-usage", "-c", "-o",
                             str(tmp_path / (u.stem + ".o"))),
            device,
        ))
    failures = [f"{u.name}:\n{r.stderr}" for u, r in zip(device, results) if r.returncode]
    assert not failures, f"hipcc ({OFFLOAD_ARCH}) failed:\n" + "\n".join(failures)
    usage = {}
    for r in results:
        usage.update(_resource_usage(r.stderr))
    assert any("paged_decode_kernel" in k for k in usage), "no resource report from hipcc"
    spills = [
        f"{k}: {v}" for k, v in usage.items()
        if v.get("ScratchSize [bytes/lane]") != "0" or v.get("VGPRs Spill") != "0"
        or v.get("SGPRs Spill") != "0"
    ]
    assert not spills, "register spills (scratch memory in a kernel):\n" + "\n".join(spills)
    # Decode CTAs are 4 wavefronts, one per SIMD of a CDNA CU: waves/SIMD = CTAs/CU.
    low = [
        f"{k}: {v['Occupancy [waves/SIMD]']} waves/SIMD" for k, v in usage.items()
        if "paged_decode_kernel" in k and int(v["Occupancy [waves/SIMD]"]) < CTAS_PER_SM
    ]
    assert not low, f"decode kernels below {CTAS_PER_SM} CTAs per CU:\n" + "\n".join(low)


@needs_hipcc
def test_decode_shapes_fit_the_lds_of_a_cu(staged, tmp_path):
    stage, _, _, _ = staged
    checks = "\n".join(
        f"static_assert(DecodeShape<{dt}, {head}, {group}>::kThreads == 4 * kWarpSize);\n"
        f"static_assert(DecodeShape<{dt}, {head}, {group}>::kSmemBytes * {CTAS_PER_SM} <= "
        f"{LDS_PER_CU}, \"{dt} head {head} group {group}: {CTAS_PER_SM} CTAs exceed the LDS\");"
        for dt, head, group in [
            *((dt, head, group) for dt in ("Fp16", "Bf16", "Fp32") for head in (64, 128) for group in (4, 8)),
            ("Fp16", 256, 4), ("Bf16", 256, 4),  # head 256: 16-bit, groups <= 4 on ROCm
        ]
    )
    src = tmp_path / "lds_check.hip"
    src.write_text(
        '#include "attention/paged_decode_hip.cuh"\nnamespace core_kernels {\n'
        f"static_assert(kWarpSize == 64);\n{checks}\n}}\n"
    )
    result = _hipcc(src, stage, "-fsyntax-only")
    assert result.returncode == 0, result.stderr


@needs_hipcc
def test_a_32_wide_target_is_refused_with_the_reason(staged, tmp_path):
    stage, units, _, _ = staged
    unit = next(u for u in units if u.name == "paged_decode_fp32.hip")
    cmd = _hipcc(unit, stage, "--offload-arch=gfx1030", "--cuda-device-only", "-fsyntax-only")
    assert cmd.returncode != 0
    assert "64-wide wavefronts" in cmd.stderr, cmd.stderr


@needs_hipcc
def test_active_hip_code_has_no_cuda_only_spelling(staged, tmp_path):
    """After hipify and the preprocessor (USE_ROCM set), the lines that came from csrc/ hold
    no CUDA name, PTX or *_sync intrinsic, in the device pass and in the host pass."""
    stage, units, _, _ = staged
    jobs = [(u, side) for u in _device_units(units) for side in ("--cuda-device-only",
                                                                 "--cuda-host-only")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda j: _hipcc(j[0], stage, j[1], "-E"), jobs))
    offenders = []
    for (unit, side), r in zip(jobs, results):
        assert r.returncode == 0, f"{unit.name} {side}:\n{r.stderr}"
        for origin, line in _lines_from(r.stdout, stage):
            asm = re.search(r"\basm\b", line) and not origin.endswith("hip_compat.h")
            if CUDA_ONLY_ACTIVE.search(line) or asm:
                offenders.append(f"{unit.name} {side} {origin}: {line.strip()}")
    assert not offenders, "CUDA-only code in the HIP build:\n" + "\n".join(sorted(set(offenders)))


def _lines_from(preprocessed: str, stage: Path):
    """(file, line) for every preprocessed line that came from a file under ``stage``."""
    origin = ""
    for line in preprocessed.splitlines():
        marker = re.match(r'# \d+ "([^"]+)"', line)
        if marker:
            origin = os.path.normpath(os.path.join(stage, marker.group(1)))
        elif origin.startswith(str(stage)) and line.strip():
            yield origin, line
