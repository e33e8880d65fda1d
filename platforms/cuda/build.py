"""Loading the ``core_C`` CUDA kernels: the prebuilt extension if installed, else a JIT build.

``pip install --no-build-isolation .[cuda]`` on a machine with a CUDA toolkit and a CUDA torch
compiles ``csrc/`` into ``platforms.cuda._C`` (see setup.py). Without it, running from a
source checkout builds the same sources once with :func:`torch.utils.cpp_extension.load`
into torch's extension cache (``~/.cache/torch_extensions/<python>_<cuda>/core_C``), which
is reused until a source file or flag changes. Either way the ops appear as
``torch.ops.core_C.*``; nothing here runs at import time.
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

from platforms.gpu_sources import CSRC_DIR, kernel_sources

logger = logging.getLogger(__name__)

PREBUILT_MODULE = "platforms.cuda._C"
JIT_NAME = "core_C"
NVCC_FLAGS = ("-O3", "-lineinfo")
"""Target architectures come from torch (TORCH_CUDA_ARCH_LIST, else the visible GPUs),
so a JIT build on an H200 compiles exactly sm_90 and nothing else."""
CXX_FLAGS = ("-O3",)


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
    return True, f"JIT build of {CSRC_DIR} with {nvcc} (cached after the first run)"


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
    from torch.utils.cpp_extension import load

    logger.info("JIT-building the CUDA kernels from %s (first run only; takes a minute)", CSRC_DIR)
    load(
        name=JIT_NAME,
        sources=[str(p) for p in kernel_sources()],
        extra_include_paths=[str(CSRC_DIR)],
        extra_cflags=list(CXX_FLAGS),
        extra_cuda_cflags=list(NVCC_FLAGS),
        is_python_module=False,
        verbose=logger.isEnabledFor(logging.DEBUG),
    )
    return torch.ops.core_C
