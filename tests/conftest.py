"""Shared fixtures. Builders themselves live in tests/helpers.py (importable from any test)."""

from __future__ import annotations

import itertools

import pytest

from tests.helpers import tiny_llama_dir


@pytest.fixture
def tiny_llama(tmp_path):
    """Factory: ``tiny_llama(**config_overrides) -> Path`` of a fresh tiny random Llama
    directory (safetensors + tokenizer) under this test's tmp_path; each call gets its own
    directory, so one test can build several variants."""
    counter = itertools.count()

    def make(seed: int = 0, **overrides):
        return tiny_llama_dir(tmp_path, name=f"tiny-llama-{next(counter)}", seed=seed, **overrides)

    return make
