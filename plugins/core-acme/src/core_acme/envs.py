"""Every environment variable the Acme plugin reads, read here and nowhere else.

``core`` reads its own variables in ``core.envs``; a plugin cannot add to that module, so
it keeps its own in the same style: one frozen value, read by one function.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

EMULATE = "ACME_NPU_EMULATE"
"""``1`` makes the emulated Acme NPU usable (its probe scores 0 otherwise)."""
MEMORY = "ACME_NPU_MEMORY"
"""Simulated on-device memory, e.g. ``4GiB`` or ``512MiB`` (default :data:`DEFAULT_MEMORY`)."""

DEFAULT_MEMORY = "2GiB"
MIN_MEMORY = 256 << 20
"""Smallest simulated memory accepted: the firmware region plus room for a tiny model."""

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``'4GiB'``, ``'512M'``, ``'1.5g'`` or a plain byte count -> bytes (powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 4GiB, 512MiB or 1073741824")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class AcmeEnv:
    emulate: bool
    """ACME_NPU_EMULATE is set to a true value."""
    memory_text: str
    """ACME_NPU_MEMORY as given (or the default), kept for messages."""
    memory_bytes: int | None
    """Parsed simulated memory; None when ACME_NPU_MEMORY is unreadable or too small."""
    memory_problem: str | None
    """Why ``memory_bytes`` is None (shown by the probe), else None."""


def read(environ: dict[str, str] | None = None) -> AcmeEnv:
    """The plugin's settings from ``environ`` (default ``os.environ``); never raises."""
    e = os.environ if environ is None else environ
    emulate = e.get(EMULATE, "").strip().lower() not in ("", "0", "false", "no")
    text = e.get(MEMORY, "").strip() or DEFAULT_MEMORY
    try:
        size = parse_size(text)
    except ValueError as err:
        return AcmeEnv(emulate, text, None, f"{MEMORY}: {err}")
    if size < MIN_MEMORY:
        return AcmeEnv(
            emulate, text, None,
            f"{MEMORY}={text} is {size} bytes; the emulated NPU needs at least "
            f"{MIN_MEMORY >> 20} MiB (e.g. {MEMORY}=1GiB)",
        )
    return AcmeEnv(emulate, text, size, None)
