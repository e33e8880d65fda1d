"""The plugins in plugins/ — each its own distribution, installed with ``pip install -e`` —
tested as their vendors would: each plugin's own suite runs in its own pytest process,
rooted in the plugin's directory (its pyproject's pytest settings, not ours).

Also here, because it needs two plugins at once: OLMo (from core-extras) runs on the Acme
NPU (from core-acme) and gives the CPU platform's greedy tokens — plugins compose without
knowing about each other.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_DIRS = sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file())


def _dist_name(plugin_dir: Path) -> str:
    return tomllib.loads((plugin_dir / "pyproject.toml").read_text())["project"]["name"]


def test_plugins_exist():
    names = {_dist_name(p) for p in PLUGIN_DIRS}
    assert {"core-acme", "core-extras"} <= names, f"plugins/ holds {sorted(names)}"


@pytest.mark.parametrize("plugin_dir", PLUGIN_DIRS, ids=lambda p: p.name)
def test_plugin_is_installed_from_this_checkout(plugin_dir: Path):
    name = _dist_name(plugin_dir)
    hint = f"install it with: pip install -e {plugin_dir.relative_to(ROOT)} (make setup does)"
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"plugin distribution {name!r} is not installed; {hint}")
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    assert url == plugin_dir.as_uri(), f"{name} is installed from {url or 'an index'}, not {plugin_dir}; {hint}"


@pytest.mark.slow
@pytest.mark.parametrize("plugin_dir", PLUGIN_DIRS, ids=lambda p: p.name)
def test_plugin_suite_passes(plugin_dir: Path):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
    # The suites test discovery and selection themselves: nothing in our environment may steer it.
    env = {k: v for k, v in os.environ.items() if k not in ("CORE_PLATFORM", "CORE_PLUGINS", "CORE_NO_PLUGIN_AUTOLOAD")}
    run = subprocess.run(cmd, cwd=plugin_dir, capture_output=True, text=True, timeout=1200, env=env)
    assert run.returncode == 0, (
        f"{plugin_dir.name}'s own tests failed (rerun: cd {plugin_dir} && {' '.join(cmd[2:])}):\n"
        f"{run.stdout[-8000:]}\n{run.stderr[-3000:]}"
    )


@pytest.mark.slow
def test_a_plugin_model_runs_on_a_plugin_platform(tmp_path, monkeypatch):
    import transformers

    import core
    from tests.helpers import TINY_LLAMA, save_tiny_model

    fields = {k: v for k, v in TINY_LLAMA.items() if k != "rms_norm_eps"}  # OLMo has no RMSNorm
    config = transformers.OlmoConfig(**fields, clip_qkv=2.0, attention_bias=True)
    model = str(save_tiny_model(tmp_path / "olmo", transformers.OlmoForCausalLM, config, seed=5))
    params = core.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = ["Hello world", "ka lo mi ne su ta ri po the and ing er on " * 2]
    common = dict(dtype="float32", max_model_len=128, kv_cache_memory="4MiB")
    cpu = core.LLM(model=model, platform="cpu", **common).generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv("ACME_NPU_EMULATE", "1")
    monkeypatch.setenv("ACME_NPU_MEMORY", "512MiB")
    acme = core.LLM(model=model, platform="acme", **common)
    assert acme.engine.config.model.architecture == "OlmoForCausalLM"
    assert acme.engine.config.cache.block_size == 32  # the NPU's block size, not cpu's 16
    got = acme.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in cpu]
