"""The engine on CUDA against HF transformers (fp32 greedy tokens identical), with decode
CUDA graphs on and off, and the memory profile that sizes the KV cache.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/cuda/test_cuda_engine_graphs.py``.
"""

from __future__ import annotations

import gc

import pytest
import torch

from core import LLM
from tests.integration.test_engine_hf import (
    assert_all_blocks_free,
    hf_greedy,
    random_prompts,
    run,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

# Head size 64: the smallest the CUDA decode kernels take.
SHAPES = {
    "gqa": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                num_key_value_heads=2),
    "mha-tied": dict(hidden_size=128, intermediate_size=384, num_attention_heads=2,
                     num_key_value_heads=2, tie_word_embeddings=True),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_tokens_match_hf_with_and_without_graphs(tiny_llama, shape):
    path = tiny_llama(seed=7, **SHAPES[shape])
    # Decode steps of 11 and of 3 sequences run padded to the buckets of 16 and 4 rows.
    prompts = random_prompts(11, 512, seed=8, lo=3, hi=70)
    want = hf_greedy(path, prompts, 24)
    for eager in (True, False):
        llm = LLM(model=str(path), platform="cuda", dtype="float32", block_size=16,
                  enforce_eager=eager, kv_cache_memory="64MiB")
        runner = llm.engine.executor.runner
        assert (runner.graphs is None) == eager
        if not eager:  # every bucket captured at start-up, none on first use
            assert set(runner.graphs._graphs) == set(runner.graphs.buckets) and runner.graph_capture_s > 0
            captured = runner.graphs.capture_seconds
        assert run(llm, prompts, max_new=24) == want, f"enforce_eager={eager}"
        assert run(llm, prompts[:3], max_new=24) == want[:3], f"enforce_eager={eager}"
        if not eager:
            assert runner.graphs.capture_seconds == captured
        assert_all_blocks_free(llm)
        llm.engine.shutdown()


def test_memory_profile_sizes_the_cache_from_the_utilization(tiny_llama):
    path = tiny_llama(seed=9, **SHAPES["gqa"])
    _, total = torch.cuda.mem_get_info()
    small = LLM(model=str(path), platform="cuda", dtype="float32", block_size=16,
                gpu_memory_utilization=0.05, max_num_batched_tokens=4096)
    plan_small = small.engine.kv_plan
    runner = small.engine.executor.runner
    bytes_small = plan_small.num_blocks * plan_small.bytes_per_block
    del small, runner
    gc.collect()  # the first engine's cache must be gone before the second one measures
    torch.cuda.empty_cache()
    larger = LLM(model=str(path), platform="cuda", dtype="float32", block_size=16,
                 gpu_memory_utilization=0.10, max_num_batched_tokens=4096)
    plan = larger.engine.kv_plan
    grown = plan.num_blocks * plan.bytes_per_block - bytes_small
    # Same model and step sizes, so the same profiled peak: five more percent of the
    # device go to the cache, up to block rounding and allocator slack (64 MiB).
    assert abs(grown - 0.05 * total) <= 2 * plan.bytes_per_block + (64 << 20)
    assert plan.num_blocks * plan.bytes_per_block <= 0.10 * total
