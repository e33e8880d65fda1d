"""The ``core_C`` kernels on CUDA: csrc/ compiled with nvcc (the :data:`NVCC` toolchain).

``pip install --no-build-isolation .[cuda]`` on a machine with a CUDA toolkit and a CUDA torch
compiles ``csrc/`` into ``platforms.cuda._C`` (see setup.py). Without it — a plain
``pip install core[cuda]`` of the wheel, which carries the sources in ``platforms/csrc/``, or
a source checkout — the first use builds the same sources once with nvcc through
:mod:`platforms.jit_build` (keyed by the sources, flags, torch/CUDA version and GPU targets;
safe to kill; ``~/.cache/torch_extensions/core_C/<key>/``). With neither a prebuilt extension
nor nvcc, :func:`kernels_status` says so and the CUDA platform is not offered. Either way the
ops appear as ``torch.ops.core_C.*``; nothing here runs at import time. How that works is
shared with ROCm: :class:`platforms.gpu_toolchain.GpuToolchain`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from platforms.gpu_sources import CSRC_DIR, kernel_sources, source_files
from platforms.gpu_toolchain import OPS, GpuToolchain
from platforms.jit_build import JitSpec

__all__ = ["CSRC_DIR", "NVCC", "OPS", "find_nvcc", "jit_spec", "kernel_sources", "kernels_status",
           "load_ops", "source_files"]

NVCC_FLAGS = ("-O3", "-lineinfo")
"""Target architectures come from torch (TORCH_CUDA_ARCH_LIST, else the visible GPUs),
so a JIT build on an H200 compiles exactly sm_90 and nothing else."""
CXX_FLAGS = ("-O3",)


def _gpu_targets() -> str:
    """The nvcc target flags torch's build will use (TORCH_CUDA_ARCH_LIST, else the visible
    GPUs)."""
    import torch
    from torch.utils import cpp_extension

    try:
        flags = cpp_extension._get_cuda_arch_flags()  # the very list the build passes to nvcc
    except Exception:  # no GPU visible and no arch list: the build itself will say so
        flags = []
    return f"cuda {torch.version.cuda}; " + " ".join(sorted(flags))


NVCC = GpuToolchain(
    label="CUDA kernels",
    compiler="nvcc",
    default_compiler=Path("/usr/local/cuda/bin/nvcc"),
    prebuilt_module="platforms.cuda._C",
    jit_name="core_C",
    extra="cuda",
    toolkit="the CUDA toolkit (nvcc) and a CUDA build of torch",
    device_flags=NVCC_FLAGS,
    cxx_flags=CXX_FLAGS,
    targets=_gpu_targets,
)
PREBUILT_MODULE = NVCC.prebuilt_module
JIT_NAME = NVCC.jit_name


def find_nvcc() -> str | None:
    """Path of nvcc on PATH or in the default toolkit location, without running it."""
    return NVCC.find_compiler()


def kernels_status() -> tuple[bool, str]:
    """(can the kernels be loaded here, how or why not). No compilation, no CUDA init."""
    return NVCC.kernels_status()


def load_ops() -> Any:
    """``torch.ops.core_C`` with the CUDA kernels registered (built or loaded once)."""
    return NVCC.load_ops()


def jit_spec() -> JitSpec:
    """The JIT build of csrc/ (the sources shipped in the wheel, or a checkout's)."""
    return NVCC.jit_spec()
