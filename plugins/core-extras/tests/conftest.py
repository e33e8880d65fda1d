"""Fixtures for the core-extras tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from extras_testkit import build_tiny_olmo


@pytest.fixture(scope="session")
def tiny_olmo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_olmo(tmp_path_factory.mktemp("extras") / "tiny-olmo", seed=3)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from core.conformance.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("extras") / "tiny-llama", seed=2)


@pytest.fixture
def rms_norm_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORE_EXTRAS_RMS_NORM", "1")


@pytest.fixture
def no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CORE_EXTRAS_RMS_NORM", raising=False)


@pytest.fixture(autouse=True)
def _no_selection_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests choose platforms and plugins themselves; the shell's choice must not leak in."""
    for key in ("CORE_PLATFORM", "CORE_PLUGINS", "CORE_NO_PLUGIN_AUTOLOAD"):
        monkeypatch.delenv(key, raising=False)
