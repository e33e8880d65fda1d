"""The transformers fallback on CUDA: tiny models core has no model file for, through
transformers' modules with the CUDA paged-attention backend, against HF fp32.

Run on the GPU machine (with the core.platforms entry points on the path, as
docs/benchmarks/cuda_e2e.sh sets them):
``PYTHONPATH=. python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_fallback.py``
(or ``OUT=/tmp/out bash docs/benchmarks/cuda_moe.sh build test_gemma``, which runs it too).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.mark.parametrize("case", ["stablelm-gqa-partial-rotary", "starcoder2-window"])
def test_fallback_greedy_on_cuda_matches_transformers(tmp_path, case):
    """fp32, eager: identical greedy tokens, also with chunked prefills and preemption."""
    from core import LLM
    from tests.integration.test_engine_hf import (
        assert_all_blocks_free,
        hf_greedy,
        random_prompts,
        run,
    )
    from tests.integration.test_models_fallback import VOCAB, fallback_dir

    # head size 64 (hidden 256 over 4 heads): the CUDA kernels support 64 and 128
    path = fallback_dir(tmp_path, case, hidden_size=256)
    prompts = random_prompts(6, VOCAB, seed=5, lo=5, hi=50)
    expected = hf_greedy(path, prompts, 16)
    llm = LLM(model=str(path), platform="cuda", dtype="float32", block_size=16, enforce_eager=True)
    assert run(llm, prompts, max_new=16) == expected
    assert_all_blocks_free(llm)
    pressed = LLM(model=str(path), platform="cuda", dtype="float32", block_size=16,
                  enforce_eager=True, num_blocks_override=6, max_model_len=80,
                  max_num_batched_tokens=7)
    assert run(pressed, prompts, max_new=16) == expected
    assert pressed.engine.scheduler.stats().num_preemptions > 0


def test_fallback_refuses_graph_capture_on_cuda(tmp_path):
    from core import LLM
    from tests.integration.test_models_fallback import fallback_dir

    path = fallback_dir(tmp_path, "stablelm-gqa-partial-rotary", hidden_size=256)
    with pytest.raises(ValueError, match="graph capture.*--enforce-eager"):
        LLM(model=str(path), platform="cuda", dtype="float32", block_size=16)
