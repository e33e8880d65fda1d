"""Conformance check: end-to-end greedy generation through the public ``core.LLM`` API.

The platform generates from a tiny random Llama (see :mod:`core.conformance.tiny_model`)
and must produce the CPU platform's tokens and text exactly (fp32). When the platform
under test *is* the CPU, the comparison is with ``transformers`` itself, so the check is
never a comparison of a platform with itself.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from core.conformance.harness import Failures
from core.platform import Platform

PROMPTS = ("Hello world", "The quick brown fox jumps over", "ka lo mi ne su ta ri po the")
MAX_TOKENS = 8
KV_CACHE_BYTES = 8 << 20
"""A small KV budget: the model needs ~1 KiB per token, and a big default budget would
allocate (and touch) gigabytes on a CPU-backed platform."""


def e2e_dtype(platform: Platform) -> str:
    """fp32 where supported (tokens must then be identical), else the preferred dtype."""
    dtypes = platform.supported_dtypes()
    chosen = torch.float32 if torch.float32 in dtypes else dtypes[0]
    return str(chosen).removeprefix("torch.")


def generate(model_dir: Path, platform: str, dtype: str) -> list:
    """Greedy outputs (list of core.outputs.RequestOutput) of ``PROMPTS`` on ``platform``."""
    import core

    llm = core.LLM(
        model=str(model_dir),
        platform=platform,
        dtype=dtype,
        seed=0,
        max_model_len=256,
        kv_cache_memory=KV_CACHE_BYTES,
    )
    params = core.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate(list(PROMPTS), params, use_tqdm=False)


def test_greedy_generation(
    core_platform: Platform,
    conformance_model_dir: Path,
    conformance_cpu_outputs: Callable[[str], list],
) -> None:
    """LLM(platform=NAME).generate greedy tokens and text equal the CPU platform's (on the
    CPU platform itself: equal to transformers' greedy tokens)."""
    from core.outputs import RequestOutput

    f = Failures()
    f.case()
    dtype = e2e_dtype(core_platform)
    outputs = generate(conformance_model_dir, core_platform.name, dtype)
    f.expect(
        isinstance(outputs, list)
        and len(outputs) == len(PROMPTS)
        and all(isinstance(o, RequestOutput) and o.finished for o in outputs),
        f"generate() returned {type(outputs).__name__} of {len(outputs)}; expected a list of "
        f"{len(PROMPTS)} finished RequestOutput",
    )
    got = [list(o.outputs[0].token_ids) for o in outputs]
    f.expect(all(len(t) == MAX_TOKENS for t in got), f"expected {MAX_TOKENS} tokens each, got {got}")
    if core_platform.name == "cpu":
        from core.conformance.tiny_model import hf_greedy

        prompts = [list(o.prompt_token_ids) for o in outputs]
        want = hf_greedy(conformance_model_dir, prompts, MAX_TOKENS)
        f.expect(got == want, f"cpu tokens {got} differ from transformers' greedy {want}")
    else:
        ref = conformance_cpu_outputs(dtype)
        _compare(outputs, ref, core_platform.name, f)
    f.raise_if_any(f"greedy generation ({dtype})")


def _compare(outputs: list, ref: list, name: str, f: Failures) -> None:
    for i, (o, r) in enumerate(zip(outputs, ref)):
        f.expect(
            o.prompt_token_ids == r.prompt_token_ids,
            f"prompt {i}: prompt tokens {o.prompt_token_ids} differ from cpu's {r.prompt_token_ids}",
        )
        a, b = o.outputs[0], r.outputs[0]
        f.expect(
            a.token_ids == b.token_ids,
            f"prompt {i} {PROMPTS[i]!r}: {name} generated {list(a.token_ids)}, cpu {list(b.token_ids)}",
        )
        f.expect(a.text == b.text, f"prompt {i}: {name} text {a.text!r}, cpu text {b.text!r}")
        f.expect(
            a.finish_reason == b.finish_reason,
            f"prompt {i}: finish reason {a.finish_reason!r}, cpu {b.finish_reason!r}",
        )
