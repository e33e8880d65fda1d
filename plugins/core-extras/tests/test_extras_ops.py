"""The rms_norm override on platform cpu: its numerics against a float64 formula, and
proof that an engine on cpu calls it (and only when the user opted in)."""

from __future__ import annotations

import pytest
import torch
from core_extras.rms_norm import counting_rms_norm, rms_norm_by_vector_norm
from extras_testkit import engine_ops, hf_greedy

import core
from core.ops import Ops
from platforms.cpu.platform import CpuPlatform


def naive_rms_norm(x, weight, eps):
    x64 = x.double()
    return x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_numerics_match_the_formula(dtype, tol):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(5, 3, 96, generator=g) * 3 + 0.5).to(dtype)
    w = (torch.randn(96, generator=g) + 1).to(dtype)
    out = rms_norm_by_vector_norm(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), naive_rms_norm(x, w, 1e-6), atol=tol, rtol=tol)


def test_counter_counts_calls():
    fn = counting_rms_norm()
    for _ in range(3):
        fn(torch.ones(2, 8), torch.ones(8), 1e-5)
    assert fn.counter.calls == 3 and counting_rms_norm().counter.calls == 0


MAX_TOKENS = 8


def test_engine_on_cpu_uses_the_override(tiny_llama, rms_norm_override):
    llm = core.LLM(model=str(tiny_llama), platform="cpu", dtype="float32", max_model_len=128,
                   kv_cache_memory="4MiB")
    ops = engine_ops(llm)
    assert ops.names()["rms_norm"] == "core_extras.rms_norm.counting_rms_norm.<locals>.rms_norm"
    own = Ops(CpuPlatform().ops()).names()  # what platform cpu uses without the plugin
    assert ops.names()["fused_add_rms_norm"] == own["fused_add_rms_norm"]  # one op only
    assert ops.rms_norm.counter.calls == 0
    prompt = llm.get_tokenizer()("Hello world")["input_ids"]
    out = llm.generate([prompt], core.SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                     ignore_eos=True), use_tqdm=False)
    assert ops.rms_norm.counter.calls >= MAX_TOKENS  # at least once per forward pass
    # ... and the model still computes what transformers computes.
    [(want, _)] = hf_greedy(tiny_llama, [prompt], MAX_TOKENS)
    assert list(out[0].outputs[0].token_ids) == want


def test_without_opt_in_cpu_keeps_its_own_op(tiny_llama, no_override):
    llm = core.LLM(model=str(tiny_llama), platform="cpu", max_model_len=128, kv_cache_memory="4MiB")
    assert engine_ops(llm).names()["rms_norm"] == Ops(CpuPlatform().ops()).names()["rms_norm"]
