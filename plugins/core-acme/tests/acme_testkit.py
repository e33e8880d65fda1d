"""Helpers shared by the core-acme tests (a uniquely named module, so that the test
suites of several plugins can run in one pytest session)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EMULATED = {"ACME_NPU_EMULATE": "1", "ACME_NPU_MEMORY": "512MiB"}
"""Environment of an opted-in host; 512 MiB keeps the emulated KV cache small."""
SELECTION_VARS = ("CORE_PLATFORM", "CORE_PLUGINS", "CORE_NO_PLUGIN_AUTOLOAD")
"""core's variables that change which plugins load and which platform is chosen."""


def core_command() -> list[str]:
    """The installed ``core`` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("core")
    if not script.exists():
        pytest.fail(f"the `core` command is not installed next to {sys.executable}; pip install core")
    return [str(script)]


def run_core(*args: str, env: dict[str, str] | None = None, pythonpath: Path | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``core ARGS`` in a fresh process; ``env`` is added to a copy of os.environ."""
    full = {**os.environ, "CORE_NUM_THREADS": "1", **(env or {})}
    for key in ("ACME_NPU_EMULATE", "ACME_NPU_MEMORY", *SELECTION_VARS):
        if env is None or key not in env:  # the caller's shell must not steer selection
            full.pop(key, None)
    if pythonpath is not None:
        full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), full.get("PYTHONPATH")]))
    return subprocess.run([*core_command(), *args], capture_output=True, text=True, env=full,
                          timeout=timeout)
