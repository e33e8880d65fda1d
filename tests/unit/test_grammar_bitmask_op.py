"""How grammar masks reach the logits is an op the platform supplies (``grammar_bitmask`` in
core.ops.DEFAULT_OPS), not a probe of the device at run time: the default masks on the
logits' device, a platform whose device cannot run the unpack ops supplies the host path,
and a plugin can override it through ``core_op_overrides``. Through the engine on the CPU,
the host path must give the default path's outputs exactly, and be the one called."""

from __future__ import annotations

import torch

import core
from core.engine import LLMEngine
from core.engine_args import EngineArgs
from core.ops import DEFAULT_OPS, Ops
from core.plugins import load_plugins
from core.structured_output import GrammarSpec, apply_bitmask_default, apply_bitmask_host
from core.structured_output.bitmask import StepBitmask
from platforms.cpu.platform import CpuPlatform
from platforms.hpu.platform import HpuPlatform
from tests.helpers import tiny_llama_dir


def test_the_default_op_and_the_platforms_choices():
    assert DEFAULT_OPS["grammar_bitmask"] is apply_bitmask_default
    assert "grammar_bitmask" not in CpuPlatform().ops()
    gaudi = HpuPlatform.__new__(HpuPlatform)  # a Gaudi-mode instance without touching a device
    gaudi.emulated = False
    assert gaudi.ops()["grammar_bitmask"] is apply_bitmask_host
    emulated = HpuPlatform.__new__(HpuPlatform)
    emulated.emulated = True
    assert "grammar_bitmask" not in emulated.ops()


def test_row_masks_apply_with_the_op_they_were_given():
    calls = []

    def recording(logits, bitmask, rows):
        calls.append(rows)
        apply_bitmask_host(logits, bitmask, rows)

    gen = torch.Generator().manual_seed(3)
    mask = torch.randint(-(2**31), 2**31 - 1, (2, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    step = StepBitmask(seq_ids=(17, 5), bitmask=mask)
    logits = torch.randn(3, 90, generator=gen)
    want, got = logits.clone(), logits.clone()
    step.for_rows([5, 9, 17]).apply(want)  # the default op
    step.for_rows([5, 9, 17], recording).apply(got)
    assert calls == [[2, 0]] and torch.equal(got, want)


class HostMasks:
    """A plugin that sends grammar masks through the host path (as a platform that cannot
    unpack them on its device would), counting the calls."""

    CORE_PLUGIN_API = ">=1.0,<2"

    def __init__(self):
        self.calls = 0

    @core.hookimpl
    def core_op_overrides(self, platform_name):
        def host(logits, bitmask, rows):
            self.calls += 1
            apply_bitmask_host(logits, bitmask, rows)

        return {"grammar_bitmask": host}


def _generate(engine: LLMEngine, prompts, params):
    llm = core.LLM.__new__(core.LLM)  # the offline API over an engine built with these plugins
    llm.engine = engine
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_the_host_path_through_the_engine_equals_the_default(tmp_path):
    model = tiny_llama_dir(tmp_path, seed=5)
    args = dict(model=str(model), platform="cpu", dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
              "s": {"type": "string", "maxLength": 6}}, "required": ["n", "s"], "additionalProperties": False}
    params = [core.SamplingParams(temperature=t, seed=2, max_tokens=60,
                                  structured=GrammarSpec.of("json_schema", schema)) for t in (0.0, 1.0, 1.0)]
    params.append(core.SamplingParams(temperature=0.0, max_tokens=8))  # an unconstrained row beside
    prompts = ["JSON:", "JSON:", "other", "plain"]
    default = _generate(LLMEngine.from_args(EngineArgs(**args)), prompts, params)
    plugin = HostMasks()
    plugins = load_plugins()
    plugins.register(plugin, "host-masks")
    engine = LLMEngine.from_args(EngineArgs(**args), plugins)
    assert Ops.names(engine.executor.runner.setup.ops)["grammar_bitmask"].endswith("host")
    assert _generate(engine, prompts, params) == default
    assert plugin.calls > 0
