"""Plugin loading, API-version checks and platform selection (core/plugins.py)."""

from __future__ import annotations

import types

import pytest
import torch

import core
from core.platform import Platform, ProbeResult
from core.plugins import PluginError, Plugins, load_plugins
from core.version import PLUGIN_API_VERSION


def _platform(name: str, score: int) -> type[Platform]:
    class P(Platform):
        @classmethod
        def probe(cls):
            return ProbeResult(score, f"{name} test device")

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


def _plugin(api: str | None, *platforms: type[Platform], **hooks) -> types.SimpleNamespace:
    ns = types.SimpleNamespace(**hooks)
    if api is not None:
        ns.CORE_PLUGIN_API = api

    @core.hookimpl
    def core_platforms():
        return list(platforms)

    ns.core_platforms = core_platforms
    return ns


def test_cpu_is_discovered_through_the_entry_point():
    plugins = load_plugins()
    found = plugins.platforms()
    assert "cpu" in found
    plugin_name, cls = found["cpu"]
    assert plugin_name == "cpu" and cls.__module__ == "platforms.cpu.platform"
    assert plugins.select(None).name in found


def test_autoload_off_loads_nothing():
    assert load_plugins(no_autoload=True).platforms() == {}


def test_highest_probe_wins_and_explicit_choice_overrides():
    p = Plugins()
    p.register(_plugin(">=1.0,<2", _platform("low", 1), _platform("high", 5)), "vendor")
    assert p.select(None).name == "high"
    assert p.select("low").name == "low"


def test_unknown_platform_lists_what_was_found():
    p = Plugins()
    p.register(_plugin(">=1.0,<2", _platform("a", 1)), "vendor")
    with pytest.raises(PluginError, match=r"unknown platform 'nope'.*a \(score 1"):
        p.select("nope")


def test_unusable_requested_platform_is_refused_with_its_reason():
    p = Plugins()
    p.register(_plugin(">=1.0,<2", _platform("dead", 0), _platform("ok", 1)), "vendor")
    with pytest.raises(PluginError, match="not usable on this host: dead test device"):
        p.select("dead")
    assert p.select(None).name == "ok"


def test_equal_scores_are_an_error_not_a_silent_pick():
    p = Plugins()
    p.register(_plugin(">=1.0,<2", _platform("x", 3)), "one")
    p.register(_plugin(">=1.0,<2", _platform("y", 3)), "two")
    with pytest.raises(PluginError, match="tie with probe score 3.*--platform"):
        p.select(None)


def test_two_plugins_claiming_one_name_are_refused():
    p = Plugins()
    p.register(_plugin(">=1.0,<2", _platform("dup", 1)), "one")
    p.register(_plugin(">=1.0,<2", _platform("dup", 2)), "two")
    with pytest.raises(PluginError, match="'dup' is claimed by plugins 'one' and 'two'"):
        p.platforms()


@pytest.mark.parametrize("api", [">=2.0", "<1.0", ">=0.1,<1"])
def test_incompatible_api_version_is_refused_naming_both(api):
    with pytest.raises(PluginError) as e:
        Plugins().register(_plugin(api, _platform("v", 1)), "old")
    assert api in str(e.value) and PLUGIN_API_VERSION in str(e.value)


def test_missing_api_declaration_is_refused():
    with pytest.raises(PluginError, match="does not declare CORE_PLUGIN_API"):
        Plugins().register(_plugin(None, _platform("v", 1)), "anon")


def test_unknown_hook_is_refused_at_load():
    plugin = _plugin(">=1.0,<2", _platform("v", 1))

    @core.hookimpl
    def core_make_coffee():
        return "espresso"

    plugin.core_make_coffee = core_make_coffee
    p = Plugins()
    with pytest.raises(PluginError, match="unknown hook"):
        p.register(plugin, "odd")
    assert not p.pm.has_plugin("odd")


def test_op_override_conflict_is_an_error():
    def ov(platform_name):
        return {"rms_norm": lambda *a: None} if platform_name == "cpu" else {}

    p = Plugins()
    p.register(_plugin(">=1.0,<2", core_op_overrides=core.hookimpl(ov)), "a")
    assert set(p.op_overrides("cpu")) == {"rms_norm"} and p.op_overrides("cuda") == {}
    p.register(
        _plugin(
            ">=1.0,<2", core_op_overrides=core.hookimpl(lambda platform_name: ov(platform_name))
        ),
        "b",
    )
    with pytest.raises(PluginError, match="overridden by both"):
        p.op_overrides("cpu")


def _arch_plugin(**archs) -> types.SimpleNamespace:
    ns = _plugin(">=1.0,<2")

    @core.hookimpl
    def core_model_architectures():
        return dict(archs)

    ns.core_model_architectures = core_model_architectures
    return ns


class _ModelA:
    pass


class _ModelB:
    pass


def test_an_architecture_clash_fails_only_the_models_it_names(caplog):
    """Two plugins providing one name, and a plugin re-registering a built-in: loading those
    architectures fails with both owners named; every other architecture still resolves."""
    from core.models import ModelRegistry

    p = Plugins()
    p.register(_arch_plugin(ToyForCausalLM=_ModelA, OnlyAForCausalLM=_ModelA), "plugin-a")
    p.register(_arch_plugin(ToyForCausalLM=_ModelB, LlamaForCausalLM=_ModelB), "plugin-b")
    with caplog.at_level("WARNING", logger="core.plugins"):
        registry = ModelRegistry(p.model_architectures())
    assert "registered by plugins 'plugin-a' and 'plugin-b'" in caplog.text
    assert registry.resolve("OnlyAForCausalLM") is _ModelA
    with pytest.raises(ValueError, match="registered by plugins 'plugin-a' and 'plugin-b'.*CORE_PLUGINS"):
        registry.resolve("ToyForCausalLM")
    with pytest.raises(ValueError, match="plugin 'plugin-b' registers model architecture 'LlamaForCausalLM', which is built in"):
        registry.resolve("LlamaForCausalLM")
    assert registry.resolve("Qwen2ForCausalLM").__name__ == "Qwen2ForCausalLM"


def test_a_registry_built_directly_still_refuses_a_builtin_name():
    from core.models import ModelRegistry

    registry = ModelRegistry({"GPT2LMHeadModel": _ModelA})
    with pytest.raises(ValueError, match="'GPT2LMHeadModel', which is built in"):
        registry.resolve("GPT2LMHeadModel")
    assert registry.resolve("LlamaForCausalLM").__name__ == "LlamaForCausalLM"


def test_op_overrides_see_the_engine_config_and_old_hookimpls_still_work():
    """core_op_overrides(platform_name, config) (API 1.1); an implementation taking only
    platform_name (API 1.0) is still called."""
    seen = {}

    def fast_norm(x, weight, eps):
        return x

    new_style = _plugin(">=1.1,<2")

    @core.hookimpl
    def core_op_overrides(platform_name, config):
        seen["config"] = config
        return {"rms_norm": fast_norm} if config.startswith("bf16") else {}

    new_style.core_op_overrides = core_op_overrides
    old_style = _plugin(">=1.0,<2")

    @core.hookimpl
    def core_op_overrides(platform_name):  # noqa: F811 (a second plugin's hook)
        return {"silu_and_mul": fast_norm} if platform_name == "cpu" else {}

    old_style.core_op_overrides = core_op_overrides
    both = _plugin(">=1.0,<2")  # written for 1.0 and 1.1: config with a default

    @core.hookimpl
    def core_op_overrides(platform_name, config=None):  # noqa: F811
        seen["defaulted"] = config
        return {}

    both.core_op_overrides = core_op_overrides
    p = Plugins()
    p.register(new_style, "new")
    p.register(old_style, "old")
    p.register(both, "both")
    assert p.op_overrides("cpu", "bf16-config") == {"rms_norm": fast_norm, "silu_and_mul": fast_norm}
    assert seen["config"] == "bf16-config" and seen["defaulted"] == "bf16-config"
    assert p.op_overrides("cpu", "fp32-config") == {"silu_and_mul": fast_norm}


def test_a_plugin_model_with_its_own_config_class_loads_and_matches_llama(tmp_path):
    """core_model_configs (API 1.1): a checkpoint whose model_type transformers does not
    know loads through the plugin's config class; here a renamed Llama, which must give the
    built-in Llama's greedy tokens."""
    import json

    from transformers import LlamaConfig

    from core.engine import LLMEngine
    from core.engine_args import EngineArgs
    from core.models.llama import LlamaForCausalLM
    from core.sampling_params import SamplingParams
    from tests.helpers import tiny_llama_dir

    class ToyConfig(LlamaConfig):
        model_type = "core_test_toy_llama"

    class ToyForCausalLM(LlamaForCausalLM):
        pass

    plain = tiny_llama_dir(tmp_path, name="plain")
    toy = tiny_llama_dir(tmp_path, name="toy")
    cfg = json.loads((toy / "config.json").read_text())
    cfg.update(model_type="core_test_toy_llama", architectures=["ToyForCausalLM"])
    (toy / "config.json").write_text(json.dumps(cfg))

    plugin = _plugin(">=1.1,<2")
    plugin.core_model_configs = core.hookimpl(lambda: {"core_test_toy_llama": ToyConfig})
    plugin.core_model_architectures = core.hookimpl(lambda: {"ToyForCausalLM": ToyForCausalLM})

    def greedy(model_dir, plugins):
        engine = LLMEngine.from_args(EngineArgs(model=str(model_dir), platform="cpu", dtype="float32",
                                                max_model_len=128, kv_cache_memory=4 << 20), plugins)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        rid = engine.add_request(None, [5, 9, 13, 2, 7], params)
        while engine.has_unfinished_requests():
            done = {o.request_id: o for o in engine.step() if o.finished}
            if rid in done:
                out = done[rid]
        engine.shutdown()
        return list(out.outputs[0].token_ids), type(engine.config.model.hf_config)

    with_plugin = load_plugins(only=("cpu",))
    with_plugin.register(plugin, "toy")
    tokens, config_cls = greedy(toy, with_plugin)
    assert config_cls is ToyConfig
    assert tokens == greedy(plain, load_plugins(only=("cpu",)))[0]


def test_model_configs_refused_when_provided_twice_or_already_known(caplog):
    from transformers import LlamaConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    class DupConfig(LlamaConfig):
        model_type = "core_test_dup"

    class MyLlamaConfig(LlamaConfig):
        model_type = "llama"

    class FineConfig(LlamaConfig):
        model_type = "core_test_fine"

    a, b = _plugin(">=1.1,<2"), _plugin(">=1.1,<2")
    a.core_model_configs = core.hookimpl(lambda: {"core_test_dup": DupConfig, "llama": MyLlamaConfig})
    b.core_model_configs = core.hookimpl(lambda: {"core_test_dup": DupConfig, "core_test_fine": FineConfig})
    p = Plugins()
    p.register(a, "a")
    p.register(b, "b")
    with caplog.at_level("WARNING", logger="core.plugins"):
        assert p.register_model_configs() == ["core_test_fine"]
    assert "model_type 'core_test_dup' is provided by plugins ['a', 'b']" in caplog.text
    assert "plugin 'a' provides model_type 'llama', which transformers already knows" in caplog.text
    assert "core_test_dup" not in CONFIG_MAPPING and CONFIG_MAPPING["llama"] is LlamaConfig
    assert CONFIG_MAPPING["core_test_fine"] is FineConfig

    class FineConfigReloaded(LlamaConfig):  # the plugin's module reloaded: a new class object
        model_type = "core_test_fine"

    again = Plugins()
    again.register(_arch_free_config_plugin({"core_test_fine": FineConfigReloaded}), "b")
    assert again.register_model_configs() == ["core_test_fine"]
    assert CONFIG_MAPPING["core_test_fine"] is FineConfigReloaded


def _arch_free_config_plugin(configs: dict) -> types.SimpleNamespace:
    ns = _plugin(">=1.1,<2")
    ns.core_model_configs = core.hookimpl(lambda: dict(configs))
    return ns
