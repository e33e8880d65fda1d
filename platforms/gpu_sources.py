"""The GPU extension's sources in csrc/: one list for the CUDA build, the ROCm build and
setup.py. Standard library only, so setup.py can import it before torch or core are
installed."""

from __future__ import annotations

from pathlib import Path

CSRC_DIR = Path(__file__).resolve().parents[1] / "csrc"
"""The kernel sources; present in a source checkout, absent from an installed wheel."""


def kernel_sources(csrc: Path = CSRC_DIR) -> list[Path]:
    """Every translation unit of the extension: device code (.cu) and op registration (.cpp).
    csrc/cpu/ is the CPU platform's own extension and is left out."""
    return sorted(csrc.rglob("*.cu")) + sorted(
        p for p in csrc.rglob("*.cpp") if "cpu" not in p.relative_to(csrc).parts[:1]
    )
