"""``pip install core[cuda]`` from the wheel: the wheel carries every kernel source and the
entry points, installs into a fresh virtual environment, reports a JIT build of the shipped
sources where nvcc exists, and those shipped sources compile with nvcc (device code) and
against torch's and CUDA's headers (op registration).

The wheel is built here the way a release is (``pip wheel`` of a copy of the tree, no
extension compiled, as on a machine without a CUDA torch), so what is checked is what PyPI
users download. The fresh venv borrows this venv's dependencies (torch, transformers) through
a path entry and installs the wheel with ``--no-deps``: fast, and nothing downloaded.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from platforms.cpu.kernels import SOURCE_SUFFIXES as CPU_SUFFIXES
from platforms.cuda.build import find_nvcc
from platforms.gpu_sources import source_files

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
TREE = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "core", "platforms", "csrc")
NVCC = find_nvcc()
# As in test_csrc_compiles.py: the defines torch's extension build gives nvcc.
TORCH_NVCC_DEFINES = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                      "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in TREE:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        kwargs = {"ignore": shutil.ignore_patterns("__pycache__", "*.so")} if copy is shutil.copytree else {}
        copy(ROOT / name, src / name, **kwargs)
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                          str(src), "-w", str(tmp / "dist")], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    deprecations = re.findall(r"\w+Warning: .*deprecated.*", run.stdout + run.stderr)
    assert not deprecations, f"the build prints deprecation warnings: {deprecations}"
    (whl,) = (tmp / "dist").glob("core-*.whl")
    return whl


def test_the_wheel_carries_every_kernel_source_and_the_entry_points(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        gpu = {f"platforms/csrc/{p.relative_to(CSRC).as_posix()}": p for p in source_files(CSRC)}
        cpu = {f"platforms/cpu/csrc/{p.name}": p for p in sorted((CSRC / "cpu").iterdir())
               if p.suffix in CPU_SUFFIXES}
        assert any(n.endswith(".cu") for n in gpu) and any(n.endswith(".cpp") for n in cpu)
        missing = sorted((set(gpu) | set(cpu)) - names)
        assert not missing, f"kernel sources missing from the wheel: {missing}"
        changed = [n for n, p in {**gpu, **cpu}.items() if z.read(n) != p.read_bytes()]
        assert not changed, f"shipped sources differ from csrc/: {changed}"
        assert not [n for n in names if n.startswith("platforms/csrc/cpu/")], "CPU sources twice"
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        text = z.read(entry_points).decode()
        metadata = z.read(entry_points.replace("entry_points.txt", "METADATA")).decode()
    for line in ("cuda = platforms.cuda", "cpu = platforms.cpu", "rocm = platforms.rocm",
                 "core = core.entrypoints.cli:main"):
        assert line in text, f"{line!r} not in entry_points.txt:\n{text}"
    assert "Provides-Extra: cuda" in metadata and "License-Expression: Apache-2.0" in metadata


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[Path, Path]:
    """(python of a fresh venv with the wheel installed, the shipped platforms/csrc)."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # This venv's dependencies, after the wheel's own packages on sys.path (a plain path
    # entry: the editable install's finder in that site-packages is not activated).
    (site / "borrowed-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    run = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return py, site / "platforms" / "csrc"


def test_the_installed_wheel_finds_its_sources_and_offers_the_jit_build(installed, tmp_path):
    py, shipped = installed
    code = ("import platforms.gpu_sources as g, platforms.cuda.build as b, platforms.cpu.kernels as k; "
            "from importlib.metadata import entry_points; "
            "print(g.CSRC_DIR); print(k.CSRC_DIR); print(b.kernels_status()); "
            "print(sorted(e.name for e in entry_points(group='core.platforms')))")
    run = subprocess.run([str(py), "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    gpu_dir, cpu_dir, status, names = run.stdout.splitlines()[-4:]
    assert gpu_dir == str(shipped) and cpu_dir == str(shipped.parent / "cpu" / "csrc")
    assert "'cuda'" in names and "'cpu'" in names, names
    if NVCC is not None:  # the fallback stated to a wheel user: JIT-build the shipped sources
        assert status.startswith("(True, 'JIT build of " + str(shipped)), status
    else:
        assert "no nvcc" in status, status
    script = py.parent / "core"
    run = subprocess.run([str(script), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "serve" in run.stdout, run.stdout + run.stderr


def _cuda_include() -> str:
    """The CUDA toolkit's include directory (cuda_runtime.h), next to the nvcc in use."""
    from torch.utils.cpp_extension import CUDA_HOME

    candidates = [Path(NVCC).resolve().parents[1], Path(CUDA_HOME or "/usr/local/cuda"),
                  Path("/usr/local/cuda")]
    for toolkit in candidates:
        if (toolkit / "include" / "cuda_runtime.h").is_file():
            return str(toolkit / "include")
    pytest.fail(f"no cuda_runtime.h under {[str(c) for c in candidates]} although nvcc is {NVCC}")


def _host_flags(scratch: Path) -> list[str]:
    """What torch's extension build passes the host compiler for a CUDA op-registration file."""
    import torch
    from torch.utils.cpp_extension import include_paths

    incs = [*include_paths(), _cuda_include(), sysconfig.get_paths()["include"]]
    macros = "c10/cuda/impl/cuda_cmake_macros.h"
    if not any((Path(d) / macros).is_file() for d in incs):
        # A CPU build of torch ships c10/cuda's headers but not this one generated config
        # header; a CUDA build's holds just this define.
        (scratch / macros).parent.mkdir(parents=True)
        (scratch / macros).write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        incs.append(str(scratch))
    return ["-std=c++20", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=core_C",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{d}" for d in incs)]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA toolkit absent")
def test_the_shipped_sources_compile(installed, tmp_path):
    _, shipped = installed
    units = sorted(shipped.rglob("*.cu")) + sorted(shipped.rglob("*.cpp"))
    assert any(u.suffix == ".cpp" for u in units) and any(u.suffix == ".cu" for u in units)
    host = shutil.which("c++") or shutil.which("g++")
    flags = _host_flags(tmp_path)

    def compile_one(src: Path) -> subprocess.CompletedProcess:
        if src.suffix == ".cu":  # device code: sm_90 machine code, as on the H200
            cmd = [NVCC, "-std=c++17", "-O3", "-gencode=arch=compute_90,code=sm_90",
                   *TORCH_NVCC_DEFINES, "-I", str(shipped), "-c", str(src), "-o",
                   str(tmp_path / f"{src.stem}.o")]
        else:  # op registration against torch's and CUDA's headers
            cmd = [host, *flags, "-I", str(shipped), str(src)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=900)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(compile_one, units))
    failures = [f"{u.relative_to(shipped)}:\n{r.stderr[-3000:]}" for u, r in zip(units, results)
                if r.returncode != 0]
    assert not failures, "the shipped sources do not compile:\n" + "\n".join(failures)
