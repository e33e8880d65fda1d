"""Loading the ``core_C`` CUDA kernels: the prebuilt extension if installed, else a JIT build.

``pip install --no-build-isolation .[cuda]`` on a machine with a CUDA toolkit and a CUDA torch
compiles ``csrc/`` into ``platforms.cuda._C`` (see setup.py). Without it — a plain
``pip install core[cuda]`` of the wheel, which carries the sources in ``platforms/csrc/``, or
a source checkout — the first use builds the same sources once with nvcc through
:mod:`platforms.jit_build` (keyed by the sources, flags, torch/CUDA version and GPU targets;
safe to kill; ``~/.cache/torch_extensions/core_C/<key>/``). With neither a prebuilt extension
nor nvcc, :func:`kernels_status` says so and the CUDA platform is not offered. Either way the
ops appear as ``torch.ops.core_C.*``; nothing here runs at import time.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from platforms import jit_build
from platforms.gpu_sources import CSRC_DIR, kernel_sources, source_files
from platforms.jit_build import JitSpec

logger = logging.getLogger(__name__)

PREBUILT_MODULE = "platforms.cuda._C"
JIT_NAME = "core_C"
NVCC_FLAGS = ("-O3", "-lineinfo")
"""Target architectures come from torch (TORCH_CUDA_ARCH_LIST, else the visible GPUs),
so a JIT build on an H200 compiles exactly sm_90 and nothing else."""
CXX_FLAGS = ("-O3",)
OPS = ("reshape_and_cache", "paged_decode", "copy_blocks", "swap_blocks", "sample_rows")
"""Checked in the builder before a JIT build is cached."""


def find_nvcc() -> str | None:
    """Path of nvcc on PATH or in the default toolkit location, without running it."""
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def has_prebuilt() -> bool:
    """Whether ``pip install`` compiled the extension (looked up, not imported)."""
    try:
        return importlib.util.find_spec(PREBUILT_MODULE) is not None
    except (ImportError, ValueError):
        return False


def kernels_status() -> tuple[bool, str]:
    """(can the kernels be loaded here, how or why not). No compilation, no CUDA init."""
    if has_prebuilt():
        return True, f"prebuilt extension {PREBUILT_MODULE}"
    if not CSRC_DIR.is_dir():
        return False, (
            f"the kernels were not compiled at install time and their sources ({CSRC_DIR}) are "
            "not here to JIT-build; reinstall with `pip install --no-build-isolation .[cuda]` "
            "on a machine with a CUDA toolkit and a CUDA build of torch"
        )
    nvcc = find_nvcc()
    if nvcc is None:
        return False, (
            "no prebuilt core_C extension and no nvcc to JIT-build csrc/; install the CUDA "
            "toolkit (nvcc) or `pip install --no-build-isolation .[cuda]` where it is present"
        )
    return True, f"JIT build of {CSRC_DIR} with {nvcc} on first use (then cached)"


@functools.cache
def load_ops() -> Any:
    """Register the ``core_C`` ops in this process (once) and return ``torch.ops.core_C``.

    :raises RuntimeError: when neither a prebuilt extension nor the sources plus nvcc exist.
    """
    if has_prebuilt():
        importlib.import_module(PREBUILT_MODULE)
        return torch.ops.core_C
    ok, why = kernels_status()
    if not ok:
        raise RuntimeError(f"cannot load the CUDA kernels: {why}")
    torch.ops.load_library(str(jit_build.build(jit_spec())))
    return torch.ops.core_C


def _gpu_targets() -> str:
    """The nvcc target flags torch's build will use (TORCH_CUDA_ARCH_LIST, else the visible
    GPUs): part of the cache key, so a cache shared across GPU models rebuilds per target."""
    from torch.utils import cpp_extension

    try:
        flags = cpp_extension._get_cuda_arch_flags()  # the very list the build passes to nvcc
    except Exception:  # no GPU visible and no arch list: the build itself will say so
        flags = []
    return f"cuda {torch.version.cuda}; " + " ".join(sorted(flags))


def jit_spec() -> JitSpec:
    """The JIT build of csrc/ (the sources shipped in the wheel, or a checkout's)."""
    return JitSpec(
        name=JIT_NAME,
        label="CUDA kernels",
        src_dir=CSRC_DIR,
        files=tuple(str(p.relative_to(CSRC_DIR)) for p in source_files()),
        units=tuple(str(p.relative_to(CSRC_DIR)) for p in kernel_sources()),
        cflags=CXX_FLAGS,
        cuda_cflags=NVCC_FLAGS,
        machine_key=_gpu_targets(),
        namespace="core_C",
        ops=OPS,
    )
