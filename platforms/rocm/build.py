"""The ``core_C`` kernels on ROCm: csrc/ hipified into a build directory, compiled with hipcc.

The CUDA sources in ``csrc/`` are the only sources. For ROCm they are copied into a staging
directory and translated there by :func:`torch.utils.hipify.hipify_python.hipify` (never in
``csrc/`` itself: the checkout stays CUDA-only), then compiled by torch's extension build,
which drives hipcc when ``torch.version.hip`` is set. ``csrc/cuda_compat.h`` carries every
difference hipify cannot express (warp size 64, shuffles, launch bounds, ...).

Two ways in, as on CUDA: ``pip install --no-build-isolation .[rocm]`` with a ROCm build of
torch compiles ``platforms.rocm._C`` (see setup.py), or a source checkout JIT-builds the same
sources once with :func:`torch.utils.cpp_extension.load`. Either way the ops appear as
``torch.ops.core_C.*``, the namespace the CUDA attention backend calls.

How the kernels are found, built and loaded is the CUDA platform's way too
(:class:`platforms.gpu_toolchain.GpuToolchain`); this module holds ROCm's facts (:data:`HIPCC`)
and the hipify step.

At import time this module needs only the standard library and standard-library-only project
modules (platforms.gpu_sources, platforms.gpu_toolchain, platforms.jit_build): setup.py loads
it by path, before the package is importable. It does nothing at import time.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from platforms.gpu_sources import CSRC_DIR, kernel_sources
from platforms.gpu_toolchain import OPS, GpuToolchain
from platforms.jit_build import JitSpec

__all__ = ["CSRC_DIR", "HIPCC", "OPS", "check_offload_archs", "find_hipcc", "hipify_sources",
           "jit_spec", "kernel_sources", "kernels_status", "load_ops"]

HIPCC_FLAGS = ("-O3",)
"""Added to torch's own hipcc flags (-DUSE_ROCM=1, -D__HIP_NO_HALF_CONVERSIONS__=1, ...)."""
CXX_FLAGS = ("-O3",)
DEFAULT_OFFLOAD_ARCHS = ("gfx90a", "gfx942")
"""What setup.py compiles for when PYTORCH_ROCM_ARCH is unset: MI200 and MI300 (CDNA)."""
WAVE64_ARCH_PREFIX = "gfx9"
"""The kernels need 64-wide wavefronts; HIP offers them on gfx9 (GCN/CDNA) only."""


def check_offload_archs(archs: Iterable[str]) -> tuple[str, ...]:
    """``archs`` (e.g. ``gfx90a``, ``gfx942:xnack-``) if every one runs 64-wide wavefronts.

    :raises ValueError: naming the unsupported targets and what to choose instead.
    """
    archs = tuple(a.strip() for a in archs if a.strip())
    if not archs:
        raise ValueError("no ROCm offload architecture given; set e.g. PYTORCH_ROCM_ARCH=gfx90a")
    bad = [a for a in archs if not a.startswith(WAVE64_ARCH_PREFIX)]
    if bad:
        raise ValueError(
            f"offload architecture(s) {bad} cannot run the csrc/ kernels: they need 64-wide "
            "wavefronts, which HIP provides on gfx9 targets only (CDNA: gfx908, gfx90a, "
            "gfx942). Set PYTORCH_ROCM_ARCH to CDNA targets, e.g. 'gfx90a;gfx942'"
        )
    return archs


def _sync_tree(src: Path, dst: Path) -> None:
    """Make ``dst`` hold a copy of every file of ``src``; unchanged files are not rewritten,
    so their timestamps (and the incremental build) survive."""
    for path in src.rglob("*"):
        if not path.is_file():
            continue
        target = dst / path.relative_to(src)
        if target.is_file() and target.read_bytes() == path.read_bytes():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def hipify_sources(stage: Path, csrc: Path = CSRC_DIR) -> list[Path]:
    """Copy ``csrc`` into ``stage`` and hipify it there; return the HIP translation units.

    Each ``.cu`` becomes a ``.hip`` file and each header it includes a ``*_hip`` twin in
    ``stage``; sources hipify leaves unchanged are returned as their staged copies.
    Nothing is written under ``csrc``.
    """
    from torch.utils.hipify.hipify_python import hipify

    stage = stage.resolve()
    _sync_tree(csrc, stage)
    units = [stage / p.relative_to(csrc) for p in kernel_sources(csrc)]
    result = hipify(
        project_directory=str(stage),
        output_directory=str(stage),
        includes=[f"{stage}/*"],
        header_include_dirs=[str(stage)],
        extra_files=[str(u) for u in units],
        hipify_extra_files_only=True,
        is_pytorch_extension=True,
        show_detailed=False,
        show_progress=False,
    )
    out = []
    for unit in units:
        entry = result.get(str(unit))
        out.append(Path(entry.hipified_path) if entry and entry.hipified_path else unit)
    return out


def _hipify_in_place(src: Path) -> tuple[str, ...]:
    """The toolchain's ``prepare``: hipify the attempt's private copy of csrc/ where it lies."""
    src = src.resolve()  # hipify reports resolved paths
    return tuple(str(u.relative_to(src)) for u in hipify_sources(src, csrc=src))


def _gpu_targets() -> str:
    """The offload targets torch's build will use (PYTORCH_ROCM_ARCH, else the visible GPUs);
    a 32-wide target stops the compile with the reason (cuda_compat.h)."""
    import torch
    from torch.utils import cpp_extension

    try:
        flags = cpp_extension._get_rocm_arch_flags(list(HIPCC_FLAGS))  # what hipcc is given
    except Exception:  # no GPU visible and no arch list: the build itself will say so
        flags = []
    return f"hip {torch.version.hip}; " + " ".join(sorted(flags))


HIPCC = GpuToolchain(
    label="ROCm kernels",
    compiler="hipcc",
    default_compiler=Path("/opt/rocm/bin/hipcc"),
    prebuilt_module="platforms.rocm._C",
    jit_name="core_C_hip",
    extra="rocm",
    toolkit="ROCm's HIP SDK (hipcc) and a ROCm build of torch",
    device_flags=HIPCC_FLAGS,
    cxx_flags=CXX_FLAGS,
    targets=_gpu_targets,
    prepare=_hipify_in_place,
)
PREBUILT_MODULE = HIPCC.prebuilt_module
JIT_NAME = HIPCC.jit_name


def find_hipcc() -> str | None:
    """Path of hipcc on PATH or in the default ROCm location, without running it."""
    return HIPCC.find_compiler()


def kernels_status() -> tuple[bool, str]:
    """(can the kernels be loaded here, how or why not). No compilation, no device init."""
    return HIPCC.kernels_status()


def load_ops() -> Any:
    """``torch.ops.core_C`` with the hipified kernels registered (built or loaded once)."""
    return HIPCC.load_ops()


def jit_spec() -> JitSpec:
    """The JIT build of csrc/, hipified in each attempt's own copy (never in csrc/)."""
    return HIPCC.jit_spec()
