"""How a GPU vendor's compiler turns csrc/ into the ``core_C`` ops: one strategy, two uses.

The CUDA and ROCm platforms load the same kernels from the same sources in the same ways:
the extension compiled at install time if present (``pip install --no-build-isolation
.[cuda]`` / ``.[rocm]``, see setup.py), else a JIT build of the shipped sources through
:mod:`platforms.jit_build` on first use, else an explanation of what is missing. They
differ only in the facts a :class:`GpuToolchain` holds: the compiler (nvcc, or hipcc after
hipify), its flags, the prebuilt module's name, how the build targets are read, and a step
that prepares the sources (hipify for ROCm). ``platforms.cuda.build`` and
``platforms.rocm.build`` each define one toolchain.

Standard library only at import time (setup.py loads the ROCm build module by path before
the package is installed); torch is imported inside the methods that need it.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from platforms import jit_build
from platforms.gpu_sources import CSRC_DIR, kernel_sources, source_files
from platforms.jit_build import JitSpec

OPS = ("reshape_and_cache", "paged_decode", "paged_decode_and_cache", "copy_blocks", "swap_blocks",
       "sample_rows")
"""Ops a built library must register before it is cached (namespace ``core_C``)."""

_LOADED: dict[str, Any] = {}
_LOAD_LOCK = threading.Lock()


@dataclass(frozen=True)
class GpuToolchain:
    """One vendor's way to build and load csrc/ (see module docstring)."""

    label: str
    """For messages and the JIT build's log, e.g. "CUDA kernels"."""
    compiler: str
    """Executable that compiles device code (``nvcc``, ``hipcc``)."""
    default_compiler: Path
    """Where the vendor's toolkit puts it when it is not on PATH."""
    prebuilt_module: str
    """The extension compiled at install time (``platforms.cuda._C``)."""
    jit_name: str
    """Library and cache folder name of the JIT build (distinct per vendor)."""
    extra: str
    """The ``core[...]`` extra of the platform (for install hints)."""
    toolkit: str
    """How to get the compiler, in words (for the "not available" reason)."""
    device_flags: tuple[str, ...]
    """Added to torch's own device-compiler flags."""
    cxx_flags: tuple[str, ...]
    targets: Callable[[], str]
    """The build targets (GPU architectures) torch's build will use: part of the cache key,
    so one cache shared across GPU models rebuilds per target."""
    prepare: Callable[[Path], tuple[str, ...]] | None = field(default=None, compare=False)
    """Turns a private copy of csrc/ into this compiler's sources (hipify); None: as is."""

    # ---- what is here ---------------------------------------------------------------------
    def find_compiler(self) -> str | None:
        """Path of the compiler on PATH or in the toolkit's default place, without running it."""
        found = shutil.which(self.compiler)
        if found:
            return found
        return str(self.default_compiler) if self.default_compiler.exists() else None

    def has_prebuilt(self) -> bool:
        """Whether ``pip install`` compiled the extension (looked up, not imported)."""
        try:
            return importlib.util.find_spec(self.prebuilt_module) is not None
        except (ImportError, ValueError):
            return False

    def kernels_status(self) -> tuple[bool, str]:
        """(can the kernels be loaded here, how or why not). No compilation, no device init."""
        if self.has_prebuilt():
            return True, f"prebuilt extension {self.prebuilt_module}"
        if not CSRC_DIR.is_dir():
            return False, (
                f"the kernels were not compiled at install time and their sources ({CSRC_DIR}) "
                f"are not here to JIT-build; reinstall with `pip install --no-build-isolation "
                f".[{self.extra}]` on a machine with {self.toolkit}"
            )
        compiler = self.find_compiler()
        if compiler is None:
            return False, (
                f"no prebuilt core_C extension and no {self.compiler} to JIT-build csrc/; "
                f"install {self.toolkit} or `pip install --no-build-isolation .[{self.extra}]` "
                "where it is present"
            )
        how = " (hipified)" if self.prepare else ""
        return True, f"JIT build of {CSRC_DIR}{how} with {compiler} on first use (then cached)"

    # ---- building and loading -------------------------------------------------------------
    def jit_spec(self) -> JitSpec:
        """The JIT build of csrc/ (the sources shipped in the wheel, or a checkout's)."""
        return JitSpec(
            name=self.jit_name,
            label=self.label,
            src_dir=CSRC_DIR,
            files=tuple(str(p.relative_to(CSRC_DIR)) for p in source_files()),
            units=tuple(str(p.relative_to(CSRC_DIR)) for p in kernel_sources()),
            cflags=self.cxx_flags,
            cuda_cflags=self.device_flags,
            machine_key=self.targets(),
            namespace="core_C",
            ops=OPS,
            prepare=self.prepare,
        )

    def load_ops(self) -> Any:
        """Register the ``core_C`` ops in this process (once) and return ``torch.ops.core_C``.

        :raises RuntimeError: when neither a prebuilt extension nor the sources plus the
            compiler exist (the message says which, and what to install).
        """
        with _LOAD_LOCK:
            if self.jit_name not in _LOADED:
                _LOADED[self.jit_name] = self._load()
            return _LOADED[self.jit_name]

    def _load(self) -> Any:
        import torch

        if self.has_prebuilt():
            importlib.import_module(self.prebuilt_module)
            return torch.ops.core_C
        ok, why = self.kernels_status()
        if not ok:
            raise RuntimeError(f"cannot load the {self.label}: {why}")
        torch.ops.load_library(str(jit_build.build(self.jit_spec())))
        return torch.ops.core_C
