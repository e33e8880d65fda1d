"""Every environment variable core-extras reads, read here and nowhere else."""

from __future__ import annotations

import os
from dataclasses import dataclass

RMS_NORM = "CORE_EXTRAS_RMS_NORM"
"""``1`` installs the plugin's rms_norm on platform cpu (off by default: a plugin that
replaces a kernel on a platform it does not own should be asked to)."""


@dataclass(frozen=True)
class ExtrasEnv:
    override_rms_norm: bool


def read(environ: dict[str, str] | None = None) -> ExtrasEnv:
    e = os.environ if environ is None else environ
    return ExtrasEnv(override_rms_norm=e.get(RMS_NORM, "").strip().lower() not in ("", "0", "false", "no"))
