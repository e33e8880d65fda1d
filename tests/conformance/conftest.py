"""Runs the conformance suite for the platforms testable on this machine: cpu, and hpu with
its ops on CPU tensors (no Gaudi here; see platforms/hpu).

The checks come from ``core.conformance``; this conftest only chooses the platforms. The
suite's pytest plugin is normally registered by core's ``pytest11`` entry point; when core
is not installed (a plain PYTHONPATH checkout) it is registered here instead, so the
summary section appears either way.
"""

from __future__ import annotations

import pytest

import core.conformance.plugin as conformance_plugin
from core.conformance.plugin import select_platform
from platforms.hpu import EMULATE_ENV

PLATFORMS = ("cpu", "hpu")


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.is_registered(conformance_plugin):
        config.pluginmanager.register(conformance_plugin, "core_conformance")


@pytest.fixture(scope="module", params=PLATFORMS)  # module: the HPU opt-in must not outlive it
def core_platform(request: pytest.FixtureRequest):
    """Each platform in turn, selected through the engine's discovery path."""
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "hpu":
            mp.setenv(EMULATE_ENV, "1")  # Gaudi is absent here: run the HPU ops on CPU tensors
        yield select_platform(request.param)
