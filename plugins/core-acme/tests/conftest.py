"""Fixtures for the core-acme tests: a tiny random model and the emulation on or off."""

from __future__ import annotations

from pathlib import Path

import pytest
from acme_testkit import EMULATED, SELECTION_VARS


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded random Llama (head size 64) and its tokenizer, from core's conformance kit."""
    from core.conformance.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("acme") / "tiny-llama", seed=1)


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this host an (emulated) Acme NPU host for one test."""
    for key, value in EMULATED.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def no_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host without an Acme NPU and without opting into the emulation."""
    monkeypatch.delenv("ACME_NPU_EMULATE", raising=False)
    monkeypatch.delenv("ACME_NPU_MEMORY", raising=False)


@pytest.fixture(autouse=True)
def _no_selection_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests choose platforms and plugins themselves; the shell's choice must not leak in."""
    for key in SELECTION_VARS:
        monkeypatch.delenv(key, raising=False)
