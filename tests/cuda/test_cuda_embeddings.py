"""Pooling (embedding) requests on CUDA, with and without CUDA graphs, mixed with generation:
vectors equal HF ``AutoModel``'s pooled last hidden state (fp32), tokens equal HF greedy.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/cuda/test_cuda_embeddings.py``.
"""

from __future__ import annotations

import pytest
import torch

from core import LLM
from tests.integration.test_embeddings_engine import run_mixed

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

# Head size 64: the smallest the CUDA decode kernels take.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("kind", ["last", "mean"])
def test_pooling_on_cuda_matches_hf(tiny_llama, eager, kind):
    path = tiny_llama(seed=9, **SHAPE)
    llm = LLM(model=str(path), platform="cuda", dtype="float32", block_size=16, enforce_eager=eager,
              kv_cache_memory="64MiB", max_num_batched_tokens=32, max_model_len=128)
    run_mixed(llm, path, kind, normalize=True, device="cuda")
