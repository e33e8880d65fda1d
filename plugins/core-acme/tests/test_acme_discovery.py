"""The installed distribution is found through the entry point and selected by its probe."""

from __future__ import annotations

import importlib.metadata

import core_acme
import pytest
from acme_testkit import EMULATED, run_core
from core_acme.platform import EMULATED_SCORE, AcmePlatform

from core.plugins import PluginError, load_plugins


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group="core.platforms")
    acme = [ep for ep in eps if ep.name == "acme"]
    assert [ep.value for ep in acme] == ["core_acme"], f"core.platforms entry points: {list(eps)}"
    assert acme[0].dist.name == "core-acme"


def test_core_discovers_the_platform_through_the_entry_point(no_npu):
    plugins = load_plugins()
    plugin, cls = plugins.platforms()["acme"]
    assert (plugin, cls) == ("acme", AcmePlatform)
    assert plugins.pm.get_plugin("acme") is core_acme


def test_probe_without_opt_in_scores_zero_and_says_how_to_opt_in(no_npu):
    result = AcmePlatform.probe()
    assert result.score == 0
    assert "ACME_NPU_EMULATE=1" in result.reason
    assert load_plugins().select(None).name == "cpu"  # never picked by accident
    with pytest.raises(PluginError, match=r"platform 'acme' is not usable on this host: no Acme NPU"):
        load_plugins().select("acme")


def test_probe_with_opt_in_beats_the_cpu(emulated):
    result = AcmePlatform.probe()
    assert result.score == EMULATED_SCORE > 1
    assert "0.50 GiB simulated memory" in result.reason
    assert load_plugins().select(None).name == "acme"
    assert load_plugins().select("cpu").name == "cpu"  # an explicit choice still wins


@pytest.mark.parametrize(
    ("memory", "message"),
    [("lots", "cannot read 'lots' as a size"), ("1MiB", "needs at least 256 MiB")],
)
def test_unusable_memory_setting_makes_the_probe_say_why(monkeypatch, memory, message):
    monkeypatch.setenv("ACME_NPU_EMULATE", "1")
    monkeypatch.setenv("ACME_NPU_MEMORY", memory)
    result = AcmePlatform.probe()
    assert result.score == 0 and message in result.reason


def test_core_platforms_command_lists_it():
    off = run_core("platforms")
    assert off.returncode == 0, off.stderr
    row = next(line for line in off.stdout.splitlines() if line.startswith("acme "))
    assert row.split()[1:3] == ["acme", "0"] and "emulated" in row
    assert "selected: cpu" in off.stdout
    on = run_core("platforms", env=EMULATED)
    assert on.returncode == 0, on.stderr
    assert "selected: acme" in on.stdout, on.stdout
