"""What core does with plugins that do not fit: an unsupported plugin API version, two
platforms claiming the Acme NPU with equal scores, two plugins claiming the name 'acme'.

Each case runs twice: registered programmatically (fast, exact), and as a real installed
distribution (a ``*.dist-info`` with an ``entry_points.txt`` on PYTHONPATH, which is all
``pip install`` leaves behind) driven through the ``core`` command in a fresh process.
"""

from __future__ import annotations

import re
import types
from pathlib import Path

import core_acme
import pytest
from acme_testkit import EMULATED, run_core
from core_acme.platform import EMULATED_SCORE, AcmePlatform

import core
from core.plugins import PluginError, Plugins
from core.version import PLUGIN_API_VERSION

OLD_API = ">=0.1,<1"


def refusal(plugin: str, declared: str) -> str:
    """The refusal documented in docs/plugins.md ("Troubleshooting")."""
    return (
        f"plugin {plugin!r} supports core plugin API {declared!r}, but this core provides plugin "
        f"API {PLUGIN_API_VERSION}; install a version of the plugin built for plugin API "
        f"{PLUGIN_API_VERSION} (or a core matching {declared!r})"
    )


def tie(score: int, *names: str) -> str:
    return (
        f"platforms {', '.join(names)} tie with probe score {score}; choose one with --platform "
        f"NAME (or CORE_PLATFORM=NAME)"
    )


class AcmeCommunityPlatform(AcmePlatform):
    """A second driver for the same NPU (say, a community build): same probe, same score."""

    name = "acme_community"


def _module(name: str, api: str, platform: type) -> types.ModuleType:
    module = types.ModuleType(name)
    module.CORE_PLUGIN_API = api

    @core.hookimpl
    def core_platforms():
        return [platform]

    module.core_platforms = core_platforms
    return module


# ---- programmatic registration -------------------------------------------------------------
def test_unsupported_api_version_is_refused_with_the_documented_message():
    plugins = Plugins()
    with pytest.raises(PluginError) as err:
        plugins.register(_module("acme_legacy", OLD_API, AcmePlatform), "acme_legacy")
    assert str(err.value) == refusal("acme_legacy", OLD_API)
    assert not plugins.pm.has_plugin("acme_legacy")


def test_a_plugin_without_a_declared_range_is_refused():
    module = _module("acme_undeclared", OLD_API, AcmePlatform)
    del module.CORE_PLUGIN_API
    with pytest.raises(PluginError, match=r"plugin 'acme_undeclared' does not declare CORE_PLUGIN_API"):
        Plugins().register(module, "acme_undeclared")


def test_our_declared_range_admits_this_core():
    Plugins().register(core_acme, "acme")  # raises if CORE_PLUGIN_API excluded this core


def test_equal_scores_for_the_same_device_are_an_error_not_a_silent_pick(emulated):
    plugins = Plugins()
    plugins.register(core_acme, "acme")
    plugins.register(_module("acme_community", ">=1.0,<2", AcmeCommunityPlatform), "acme_community")
    with pytest.raises(PluginError) as err:
        plugins.select(None)
    assert str(err.value) == tie(EMULATED_SCORE, "acme", "acme_community")
    assert plugins.select("acme").cls is AcmePlatform  # naming one resolves it
    assert plugins.select("acme_community").cls is AcmeCommunityPlatform


def test_two_plugins_claiming_the_name_acme_are_refused():
    plugins = Plugins()
    plugins.register(core_acme, "acme")
    plugins.register(_module("acme_fork", ">=1.0,<2", AcmePlatform), "acme_fork")
    with pytest.raises(PluginError, match=r"platform name 'acme' is claimed by plugins 'acme' and "
                                          r"'acme_fork'; uninstall one of them"):
        plugins.platforms()


# ---- real installed distributions ---------------------------------------------------------------
def install(site: Path, dist: str, entry_name: str, source: str) -> Path:
    """Lay out a distribution the way pip leaves it: a module plus ``*.dist-info`` whose
    entry_points.txt registers it in the ``core.platforms`` group."""
    module = dist.replace("-", "_")
    site.mkdir(exist_ok=True)
    (site / f"{module}.py").write_text(source)
    info = site / f"{module}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(f"[core.platforms]\n{entry_name} = {module}\n")
    return site


LEGACY_SOURCE = f'''
import core
from core_acme.platform import AcmePlatform

CORE_PLUGIN_API = "{OLD_API}"


@core.hookimpl
def core_platforms():
    return [AcmePlatform]
'''

COMMUNITY_SOURCE = '''
import core
from core_acme.platform import AcmePlatform

CORE_PLUGIN_API = ">=1.0,<2"


class AcmeCommunityPlatform(AcmePlatform):
    name = "acme_community"


@core.hookimpl
def core_platforms():
    return [AcmeCommunityPlatform]
'''


def test_installed_plugin_with_an_old_api_is_refused_at_load(tmp_path):
    site = install(tmp_path / "site", "core-acme-legacy", "acme_legacy", LEGACY_SOURCE)
    run = run_core("platforms", pythonpath=site)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip() == f"error: {refusal('acme_legacy', OLD_API)}"
    # The documented way out until the plugin is upgraded: load only the named plugins.
    run = run_core("platforms", pythonpath=site, env={"CORE_PLUGINS": "cpu,acme"})
    assert run.returncode == 0, run.stderr
    assert "acme_legacy" not in run.stdout and re.search(r"^acme\s", run.stdout, re.M)


def test_installed_plugins_tying_for_the_device_give_a_clear_error(tmp_path, tiny_model):
    site = install(tmp_path / "site", "core-acme-community", "acme_community", COMMUNITY_SOURCE)
    listing = run_core("platforms", pythonpath=site, env=EMULATED)
    assert listing.returncode == 0, listing.stderr
    assert f"selected: none ({tie(EMULATED_SCORE, 'acme', 'acme_community')})" in listing.stdout
    gen = run_core("generate", "hi", "--model", str(tiny_model), "--max-tokens", "2",
                   pythonpath=site, env=EMULATED)
    assert gen.returncode == 2
    assert gen.stderr.strip().endswith(f"error: {tie(EMULATED_SCORE, 'acme', 'acme_community')}")
