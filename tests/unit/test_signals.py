"""core.entrypoints.signals: the exit status a CLI chooses after a Ctrl-C is the one the
process ends with.

CPython ends a ``python -m`` run by SIGINT, whatever ``sys.exit`` said, once a
KeyboardInterrupt has escaped code run through ``PyRun_String`` (as extension modules do),
even if Python code caught it. The control case shows the quirk is real on this
interpreter; the other shows ``keep_exit_status_after_ctrl_c`` undoes it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# a KeyboardInterrupt raised inside PyRun_String and caught by Python code, as when a
# Ctrl-C lands in an extension module's embedded code during start-up
_PROGRAM = """
import ctypes, sys
from core.entrypoints.signals import keep_exit_status_after_ctrl_c
ctypes.pythonapi.PyRun_SimpleString(b"raise KeyboardInterrupt")
if sys.argv[1] == "keep":
    keep_exit_status_after_ctrl_c()
sys.exit(130)
"""


def _run_as_module(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    (tmp_path / "ctrl_c_program.py").write_text(_PROGRAM)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "ctrl_c_program", mode], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_without_the_fix_python_m_dies_by_sigint(tmp_path):
    r = _run_as_module(tmp_path, "plain")
    assert r.returncode == -signal.SIGINT, (r.returncode, r.stderr)


def test_the_chosen_exit_status_stands(tmp_path):
    r = _run_as_module(tmp_path, "keep")
    assert r.returncode == 130, (r.returncode, r.stderr)
