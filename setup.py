"""Build hook: compile csrc/ into ``platforms.cuda._C`` when CUDA can be built here.

All package metadata lives in pyproject.toml; this file only adds the optional extension.
It is built when torch is importable at build time, torch is a CUDA build and a CUDA
toolkit (nvcc) is found; otherwise the pure-Python package is built and the CUDA platform
JIT-builds the kernels from a source checkout, or reports why it cannot.

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
    sources = sorted(CSRC.rglob("*.cu")) + sorted(CSRC.rglob("*.cpp"))
    ext = CUDAExtension(
        name="platforms.cuda._C",
        sources=[str(p.relative_to(ROOT)) for p in sources],
        include_dirs=[str(CSRC)],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
