"""Every Python script under docs/ (the benchmark and diagnosis scripts that figures in the
docs point at) at least parses: they run only on the device or by hand, so nothing else in CI
would notice one that cannot even start (fp8_block_agreement.py did not, 2026-12-06)."""

import ast
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
SCRIPTS = sorted(DOCS.rglob("*.py"))


def test_there_are_scripts_to_check():
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(DOCS)))
def test_the_script_parses(path):
    ast.parse(path.read_text(), filename=str(path))
