"""A whole tiny Llama on the CPU platform with ``--kv-cache-dtype fp8`` against ``auto``.

* greedy tokens with an FP8 cache against the fp32 cache, both CPU backends: the agreement
  is measured and printed (an FP8 cache rounds every key and value to 3 mantissa bits, so
  exact agreement is not expected; the figures are in docs/quantization.md);
* the KV plan of the same memory holds twice the blocks of a bf16 cache (four times fp32's);
* a checkpoint's per-layer KV scales reach the attention layers, and the checkpoint still
  loads with ``--kv-cache-dtype auto``.
"""

from __future__ import annotations

import json

import pytest
import torch

from core import LLM, SamplingParams
from core.quantization.writers import write_quantized
from tests.helpers import tiny_llama_dir
from tests.integration.test_engine_hf import random_prompts

MAX_NEW = 24
PROMPTS = 16


def _llm(path, kv_cache_dtype, **kw):
    args = dict(model=str(path), platform="cpu", dtype="float32", block_size=16, kv_cache_memory="16MiB",
                kv_cache_dtype=kv_cache_dtype)
    return LLM(**{**args, **kw})


def _greedy(llm, prompts):
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


def _top1(llm, seqs: list[list[int]]) -> list[list[int]]:
    """Teacher-forced: the engine's top-1 next token after every prefix of each sequence
    (from its prompt logprobs: the token ranked 1 at each position)."""
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate(seqs, sp, use_tqdm=False)
    return [[next(t for t, lp in pos.items() if lp.rank == 1) for pos in o.prompt_logprobs[1:]] for o in outs]


def _agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(share of generated tokens before the first difference, share of identical
    sequences): after a first difference the two continue from different text."""
    before = 0
    for x, y in zip(a, b):
        first = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
        before += first
    return before / sum(map(len, a)), sum(x == y for x, y in zip(a, b)) / len(a)


@pytest.mark.parametrize("backend", ["cpu_paged", "cpu_sdpa"])
def test_fp8_cache_greedy_agreement_with_the_full_precision_cache(tmp_path, backend):
    path = tiny_llama_dir(tmp_path, seed=4)
    prompts = random_prompts(PROMPTS, 512, seed=9, lo=5, hi=60)
    auto = _llm(path, "auto", attention_backend=backend)
    ref = _greedy(auto, prompts)
    llm = _llm(path, "fp8", attention_backend=backend)
    runner = llm.engine.executor.runner
    assert {c.dtype for c in runner.kv_caches} == {torch.float8_e4m3fn}
    assert {b.name for b in runner._backends} == {backend}
    tokens, seqs = _agreement(ref, _greedy(llm, prompts))
    # teacher-forced over the reference's own text: every position counts once
    full = [p + r for p, r in zip(prompts, ref)]
    a, b = torch.tensor(sum(_top1(auto, full), [])), torch.tensor(sum(_top1(llm, full), []))
    top1 = float((a == b).float().mean())
    print(f"\n[{backend}] fp8 KV vs fp32 KV: teacher-forced top-1 agreement {top1:.3f} over {a.numel()} "
          f"positions; free-running greedy: {tokens:.3f} of {PROMPTS}x{MAX_NEW} tokens before the first "
          f"difference, {seqs:.3f} of sequences identical")
    assert top1 >= 0.6, f"fp8 cache agrees on only {top1:.3f} of the teacher-forced positions"


@pytest.mark.parametrize("dtype,ratio", [("bfloat16", 2), ("float32", 4)])
def test_fp8_plan_holds_more_blocks_in_the_same_memory(tmp_path, dtype, ratio):
    path = tiny_llama_dir(tmp_path)
    auto = _llm(path, "auto", dtype=dtype, kv_cache_memory="8MiB").engine
    fp8 = _llm(path, "fp8", dtype=dtype, kv_cache_memory="8MiB").engine
    a, b = auto.executor.runner.kv_bytes_per_block(), fp8.executor.runner.kv_bytes_per_block()
    # 2 layers x keys and values x 2 kv heads x head 16 x 16 tokens x bytes per element
    assert (a, b) == (2 * 2 * 2 * 16 * 16 * torch.tensor([], dtype=getattr(torch, dtype)).element_size(),
                      2 * 2 * 2 * 16 * 16)
    assert fp8.kv_plan.num_blocks == ratio * auto.kv_plan.num_blocks


def _with_kv_scales(src, dst, scales: dict[int, tuple[float, float]]):
    """An ``fp8`` (128x128 block) checkpoint of ``src`` plus compressed-tensors-style
    ``self_attn.k_scale`` / ``v_scale`` tensors."""
    from safetensors.torch import load_file, save_file

    write_quantized(src, dst, "fp8-block", seed=1)
    state = load_file(str(dst / "model.safetensors"))
    for layer, (k, v) in scales.items():
        state[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        state[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([v])
    save_file(state, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    return dst


def test_checkpoint_kv_scales_reach_every_layer(tmp_path):
    scales = {0: (0.03125, 0.0625), 1: (0.125, 0.015625)}  # exact in float32
    path = _with_kv_scales(tiny_llama_dir(tmp_path), tmp_path / "fp8-kv", scales)
    prompts = random_prompts(4, 512, seed=2)
    llm = _llm(path, "fp8")
    specs = [b.spec for b in llm.engine.executor.runner._backends]
    assert [(s.k_scale, s.v_scale) for s in specs] == [scales[0], scales[1]]
    assert all(s.kv_cache_dtype == torch.float8_e4m3fn for s in specs)
    fp8_out = _greedy(llm, prompts)
    auto = _llm(path, "auto")  # the scale tensors are not weights: the checkpoint loads without them
    assert all(b.spec.kv_cache_dtype is None for b in auto.engine.executor.runner._backends)
    tokens, _ = _agreement(_greedy(auto, prompts), fp8_out)
    print(f"\ncheckpoint-scaled fp8 KV vs fp32 KV: {tokens:.3f} of the tokens before the first difference")
