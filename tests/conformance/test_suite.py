"""The conformance suite itself, run for every platform of ``conftest.PLATFORMS``, and the
vendor's command line (``pytest --core-platform=NAME --pyargs core.conformance``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from core.conformance import all_checks
from platforms.hpu import EMULATE_ENV

REPO = Path(__file__).resolve().parents[2]

# Bring every check (test_* functions of core.conformance.checks_*) into this module so
# pytest collects them here, with this directory's core_platform fixture.
globals().update(all_checks())


def test_vendor_command_line_reports_each_check(tmp_path: Path) -> None:
    """The documented command, run from an unrelated directory as a vendor would, runs the
    suite through the plugin; its summary names each check, the device type and the
    verification level."""
    cmd = [
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
        # Load the plugin by module whether or not core's pytest11 entry point is installed.
        "-p", "no:core_conformance", "-p", "core.conformance.plugin",
        "--core-platform=hpu", "--pyargs", "core.conformance", "-k", "probe or kv_cache_layout",
    ]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, EMULATE_ENV: "1", "PYTHONPATH": path}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "core conformance: platform 'hpu'" in out, out
    assert "tensors on device type 'cpu'; verification level: emulated" in out, out
    for check in ("probe", "kv_cache_layout"):
        assert f"PASSED  {check}" in out, out
    assert "2/2 checks passed on 'hpu' (emulated)" in out, out
