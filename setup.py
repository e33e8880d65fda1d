"""Build hook: compile csrc/ into ``platforms.cuda._C`` when CUDA can be built here.

All package metadata lives in pyproject.toml; this file only adds the optional extension, and
copies the kernel sources into the wheel (csrc/cpu for the CPU platform's JIT build, the rest
of csrc/ for the CUDA platform's). The extension is built when torch is importable at build
time, torch is a CUDA build and a CUDA toolkit (nvcc) is found; otherwise the pure-Python
package is built (``pip install core[cuda]`` from PyPI is this case) and the CUDA platform
JIT-builds the shipped sources with nvcc on first use, or, without nvcc, reports why it
cannot and is not offered.

With a ROCm build of torch (``torch.version.hip`` set) and hipcc, the same sources are
hipified into build/hip/csrc (csrc/ itself is never written) and compiled with the HIP
toolchain into ``platforms.rocm._C`` instead (``pip install --no-build-isolation .[rocm]``).

torch must be visible to the build, so build the extension without build isolation:
``pip install --no-build-isolation .[cuda]``. A plain ``pip install .`` (isolated, no
torch) always succeeds and installs the pure-Python package.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
sys.path.insert(0, str(ROOT))  # platforms.gpu_sources (standard library only) lists the kernels

from platforms.gpu_sources import kernel_sources, source_files  # noqa: E402


def _skip(reason: str) -> tuple[list, dict]:
    print(f"setup.py: not building the CUDA kernels ({reason})", file=sys.stderr)
    return [], {}


def cuda_extension() -> tuple[list, dict]:
    """(ext_modules, cmdclass) for the CUDA kernels, or empty ones with the reason printed."""
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return _skip("torch is not importable at build time; use --no-build-isolation")
    if torch.version.cuda is None:
        return _skip(f"torch {torch.__version__} is not a CUDA build")
    if CUDA_HOME is None:
        return _skip("no CUDA toolkit (nvcc) found; set CUDA_HOME")
    sources = kernel_sources(CSRC)
    ext = CUDAExtension(
        name="platforms.cuda._C",
        sources=[str(p.relative_to(ROOT)) for p in sources],
        include_dirs=[str(CSRC)],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
    )
    return [ext], {"build_ext": BuildExtension}


# ---- ROCm: the same csrc/, hipified into build/hip/csrc (never in csrc/) -----------------
HIP_STAGE = ROOT / "build" / "hip" / "csrc"


def _torch_is_rocm() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(getattr(torch.version, "hip", None))


def _rocm_build_module():
    """platforms/rocm/build.py, loaded by path: platforms.rocm's package imports core and
    torch-dependent modules that need not be installed at build time."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "core_rocm_build", ROOT / "platforms" / "rocm" / "build.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rocm_extension() -> tuple[list, dict]:
    """(ext_modules, cmdclass) for the hipified kernels (``platforms.rocm._C``), or empty ones
    with the reason printed. Targets: PYTORCH_ROCM_ARCH (e.g. "gfx90a;gfx942"), else the
    build module's CDNA defaults; 32-wide-wavefront targets are refused."""
    import os

    from torch.utils.cpp_extension import ROCM_HOME, BuildExtension, CUDAExtension

    if ROCM_HOME is None:
        print("setup.py: not building the ROCm kernels (no ROCm/hipcc found; set ROCM_HOME)",
              file=sys.stderr)
        return [], {}
    build = _rocm_build_module()
    requested = os.environ.get("PYTORCH_ROCM_ARCH") or ";".join(build.DEFAULT_OFFLOAD_ARCHS)
    archs = build.check_offload_archs(requested.replace(" ", ";").split(";"))
    units = build.hipify_sources(HIP_STAGE)
    ext = CUDAExtension(  # a HIP extension when torch is a ROCm build: hipcc compiles it
        name="platforms.rocm._C",
        sources=[str(p.relative_to(ROOT)) for p in units],
        include_dirs=[str(HIP_STAGE)],
        extra_compile_args={
            "cxx": list(build.CXX_FLAGS),
            "nvcc": [*build.HIPCC_FLAGS, *(f"--offload-arch={a}" for a in archs)],
        },
    )
    return [ext], {"build_ext": BuildExtension}


# ---- the kernel sources, shipped in the wheel --------------------------------------------------
# The CPU platform JIT-builds csrc/cpu for the CPU it runs on (-march=native), and the CUDA
# platform JIT-builds csrc/ on first use when no extension was compiled here, so a wheel
# carries both sets of sources: build_py copies csrc/cpu to platforms/cpu/csrc/ and the rest
# of csrc/ (.cu .cuh .h .cpp) to platforms/csrc/, where kernels.py and gpu_sources.py look.


def _shipped_sources() -> list[tuple[Path, Path]]:
    """(source file, path inside the package tree) for every kernel source the wheel carries."""
    cpu = [p for p in sorted((CSRC / "cpu").glob("*")) if p.suffix in (".cpp", ".h")]
    if not cpu or not kernel_sources(CSRC):
        raise RuntimeError(
            f"setup.py: kernel sources missing under {CSRC} (CPU: {len(cpu)} files, GPU: "
            f"{len(kernel_sources(CSRC))} units); build from a checkout or an sdist that "
            "includes csrc/ (MANIFEST.in)"
        )
    pairs = [(p, Path("platforms", "cpu", "csrc", p.name)) for p in cpu]
    return pairs + [(p, Path("platforms", "csrc", p.relative_to(CSRC))) for p in source_files(CSRC)]


def kernel_sources_build_py():
    from setuptools.command.build_py import build_py

    class BuildPyWithKernelSources(build_py):
        def run(self) -> None:
            super().run()
            for src, rel in _shipped_sources():
                dest = Path(self.build_lib) / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                self.copy_file(str(src), str(dest))

    return BuildPyWithKernelSources


ext_modules, cmdclass = rocm_extension() if _torch_is_rocm() else cuda_extension()
setup(ext_modules=ext_modules, cmdclass={**cmdclass, "build_py": kernel_sources_build_py()})
