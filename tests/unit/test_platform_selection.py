"""Emulations never take part in automatic platform selection (issue #19's tie bug).

On a CPU host with ``core[xpu]`` or ``core[tpu]`` installed (or ``CORE_HPU_EMULATE=1``), the
xpu/tpu/hpu probes find their software but no device and say so with
``ProbeResult.emulated``; a plain ``core generate`` must still run on the CPU platform, and
``--platform NAME`` must still select the emulation.

IPEX and torch-xla are not in the main venv, so the "installed" state is made real for the
real probes: a directory on PYTHONPATH holds an importable ``intel_extension_for_pytorch``
and ``torch_xla`` package (never imported: the probes only locate them) plus their
distribution metadata, which is exactly what the probes look at.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import core
from core.platform import Platform, ProbeResult
from core.plugins import PluginError, Plugins, load_plugins
from platforms.hpu import EMULATE_ENV

SELECTION_VARS = ("CORE_PLATFORM", "CORE_PLUGINS", "CORE_NO_PLUGIN_AUTOLOAD", EMULATE_ENV)


def _platform(name: str, score: int, emulated: bool = False) -> type[Platform]:
    class P(Platform):
        @classmethod
        def probe(cls):
            return ProbeResult(score, f"{name} test device", emulated=emulated)

        def device_count(self):
            return 1

        def memory_info(self, device_index=0):
            return (1, 2)

        def supported_dtypes(self):
            return (torch.float32,)

        def supported_block_sizes(self):
            return (16,)

        def attention_backend_class(self, spec, requested=None):
            raise AssertionError("not used here")

    P.name = name
    return P


def _plugin(*platforms: type[Platform]) -> types.SimpleNamespace:
    @core.hookimpl
    def core_platforms():
        return list(platforms)

    return types.SimpleNamespace(CORE_PLUGIN_API=">=1.0,<2", core_platforms=core_platforms)


def fake_installs(root: Path) -> Path:
    """A directory that makes IPEX and torch-xla look installed (spec + metadata only)."""
    for module, dist, version in (
        ("intel_extension_for_pytorch", "intel_extension_for_pytorch", "2.8.0"),
        ("torch_xla", "torch_xla", "2.9.0"),
    ):
        pkg = root / module
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('test stand-in: never imported')\n")
        info = root / f"{dist}-{version}.dist-info"
        info.mkdir()
        name = dist.replace("_", "-")
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


@pytest.fixture
def emulations_installed(tmp_path, monkeypatch):
    """IPEX and torch-xla 'installed' (no device) and HPU emulation on, in this process."""
    root = fake_installs(tmp_path / "site")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv(EMULATE_ENV, "1")
    return root


def test_an_emulation_with_the_top_score_is_skipped_by_automatic_selection():
    p = Plugins()
    p.register(_plugin(_platform("host", 1), _platform("emu", 5, emulated=True)), "vendor")
    assert p.select(None).name == "host"
    assert p.select("emu").name == "emu"  # asking by name still works


def test_only_emulations_usable_is_an_error_that_says_how_to_pick_one():
    p = Plugins()
    p.register(_plugin(_platform("emu", 1, emulated=True)), "vendor")
    with pytest.raises(PluginError, match=r"emu \(score 1, emulation.*emu run only when named: --platform"):
        p.select(None)


def test_real_probes_mark_the_emulations_and_selection_picks_cpu(emulations_installed):
    plugins = load_plugins(only=("cpu", "xpu", "tpu", "hpu"))
    infos = {i.name: i for i in plugins.discover()}
    for name in ("xpu", "tpu", "hpu"):
        probe = infos[name].probe
        assert probe.score > 0 and probe.emulated, (name, probe)
        assert infos[name].capabilities == frozenset(), (name, infos[name].capabilities)
        assert f"--platform {name}" in probe.reason
    assert not infos["cpu"].probe.emulated
    assert plugins.select(None).name == "cpu"
    assert plugins.select("hpu").name == "hpu"


@pytest.mark.slow
def test_plain_core_generate_runs_on_cpu_next_to_the_emulations(tmp_path):
    from tests.helpers import tiny_llama_dir

    model = tiny_llama_dir(tmp_path)
    site = fake_installs(tmp_path / "site")
    env = {k: v for k, v in os.environ.items() if k not in SELECTION_VARS}
    env.update({EMULATE_ENV: "1", "CORE_NUM_THREADS": "1"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(Path.cwd()), env.get("PYTHONPATH")]))
    listing = subprocess.run(
        [sys.executable, "-m", "core.entrypoints.cli", "platforms"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert listing.returncode == 0, listing.stderr
    assert "selected: cpu" in listing.stdout, listing.stdout
    cmd = [
        sys.executable, "-m", "core.entrypoints.cli", "generate", "hello", "--model", str(model),
        "--max-tokens", "4", "--temperature", "0", "--max-model-len", "64",
        "--kv-cache-memory", "4MiB", "--no-chat-template",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "tie with probe score" not in run.stderr
    assert "platform cpu" in run.stderr, run.stderr  # the engine's start-up log line
