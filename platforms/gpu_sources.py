"""The GPU extension's sources in csrc/: one list for the CUDA build, the ROCm build and
setup.py. Standard library only, so setup.py can import it before torch or core are
installed.

A source checkout has them in ``csrc/``; an installed wheel carries a copy in
``platforms/csrc/`` (setup.py's build_py puts it there), so ``pip install core[cuda]`` can
JIT-build the kernels on first use when no prebuilt extension was compiled at install time.
"""

from __future__ import annotations

from pathlib import Path

SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")
"""Every file of csrc/ (outside csrc/cpu) with these suffixes is shipped and digested."""
_CHECKOUT_CSRC = Path(__file__).resolve().parents[1] / "csrc"
_PACKAGED_CSRC = Path(__file__).resolve().parent / "csrc"
CSRC_DIR = _PACKAGED_CSRC if _PACKAGED_CSRC.is_dir() else _CHECKOUT_CSRC
"""The kernel sources: the copy inside an installed wheel, else the checkout's csrc/."""


def _gpu_side(path: Path, csrc: Path) -> bool:
    """csrc/cpu/ is the CPU platform's own extension and is left out."""
    return "cpu" not in path.relative_to(csrc).parts[:1]


def kernel_sources(csrc: Path = CSRC_DIR) -> list[Path]:
    """Every translation unit of the extension: device code (.cu) and op registration (.cpp)."""
    return sorted(p for p in csrc.rglob("*.cu") if _gpu_side(p, csrc)) + sorted(
        p for p in csrc.rglob("*.cpp") if _gpu_side(p, csrc)
    )


def source_files(csrc: Path = CSRC_DIR) -> list[Path]:
    """Every file the build reads: the translation units and the headers they include."""
    return sorted(
        p for p in csrc.rglob("*")
        if p.is_file() and p.suffix in SOURCE_SUFFIXES and _gpu_side(p, csrc)
    )
