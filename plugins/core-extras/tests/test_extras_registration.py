"""core finds each extension through the entry point and its hook."""

from __future__ import annotations

import importlib.metadata

import core_extras
from core_extras.naive_attention import NaiveCpuAttentionBackend
from core_extras.olmo import OlmoForCausalLM

from core.plugins import load_plugins


def test_entry_point_is_installed():
    eps = [ep for ep in importlib.metadata.entry_points(group="core.platforms") if ep.name == "extras"]
    assert [(ep.value, ep.dist.name) for ep in eps] == [("core_extras", "core-extras")]


def test_hooks_reach_core_registries(no_override):
    plugins = load_plugins()
    assert plugins.pm.get_plugin("extras") is core_extras
    assert plugins.model_architectures()["OlmoForCausalLM"] is OlmoForCausalLM
    assert plugins.attention_backends("cpu") == {"cpu_naive": NaiveCpuAttentionBackend}
    assert "cpu_naive" not in plugins.attention_backends("acme")  # only the platform named
    assert "extras" not in {p for p, _ in plugins.platforms().values()}  # no platform of its own


def test_op_override_is_opt_in_and_only_on_cpu(monkeypatch):
    monkeypatch.delenv("CORE_EXTRAS_RMS_NORM", raising=False)
    assert load_plugins().op_overrides("cpu") == {}
    monkeypatch.setenv("CORE_EXTRAS_RMS_NORM", "1")
    plugins = load_plugins()
    assert set(plugins.op_overrides("cpu")) == {"rms_norm"}
    assert plugins.op_overrides("acme") == {}
    # Each engine gets its own counting function (no shared global state).
    assert plugins.op_overrides("cpu")["rms_norm"] is not plugins.op_overrides("cpu")["rms_norm"]
