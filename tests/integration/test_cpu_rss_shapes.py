"""The offline engine's memory stays flat over many distinct prompt lengths (issue 16's soak).

oneDNN (torch's bf16 GEMM on a CPU with AVX-512) keeps two caches per GEMM shape, its
primitive cache and ideep's LRU of computations, about 0.55 MiB per (weight shape, rows) pair
and up to 1,024 entries each: a server that sees every prompt length grew by ~1.2 MiB per new
length of the embedded SmolLM2 (docs/benchmarks/soak.md). The CPU platform now hands oneDNN
only a bounded set of row counts (platforms/cpu/row_buckets.py). On a CPU where torch does not
use oneDNN for bf16 (no AVX-512) nothing grew before either and this test passes trivially.

This is a memory test, not a timing test: it measures the resident set after a warm-up that
visits every bucket, then again after 141 prompts of lengths not seen before. Before the fix
it grew by 305 MiB on this machine (4 weight shapes x 141 lengths x ~0.55 MiB), after it
3.9 MiB; the bound leaves room for allocator noise and nothing else.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from core.entrypoints.llm import LLM
from core.sampling_params import SamplingParams
from tests.helpers import tiny_llama_dir

GROWTH_BOUND_MIB = 40.0
"""Generous: the pre-fix growth here is ~8x this; allocator and Python noise is a few MiB."""


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmRSS line")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tiny_llama_dir(tmp_path_factory.mktemp("rss"), max_position_embeddings=1024)
    return LLM(model=str(path), dtype="bfloat16", platform="cpu", max_model_len=1024,
               max_num_batched_tokens=1024, kv_cache_memory="16MiB")


def _run_lengths(llm: LLM, lengths) -> None:
    params = SamplingParams(max_tokens=1, temperature=0)
    for n in lengths:
        # One prompt per call, random from its first token on (no prefix-cache hit): the
        # step's row count is the prompt's length.
        rng = random.Random(n)
        llm.generate([[rng.randrange(3, 512) for _ in range(n)]], params, use_tqdm=False)


def test_rss_stays_flat_over_many_distinct_prompt_lengths(llm):
    # Warm-up: every row bucket (and the decode shapes) once, plus the allocator's first growth.
    _run_lengths(llm, range(13, 1000, 7))
    before = _rss_mib()
    fresh = [n for n in range(14, 1000, 6) if (n - 13) % 7]  # 141 lengths the warm-up skipped
    _run_lengths(llm, fresh)
    growth = _rss_mib() - before
    assert growth < GROWTH_BOUND_MIB, (
        f"RSS grew {growth:.1f} MiB over {len(fresh)} new prompt lengths (bound "
        f"{GROWTH_BOUND_MIB} MiB): a per-shape cache is growing again"
    )
