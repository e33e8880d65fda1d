"""Pooling requests through the engine itself (no HTTP): mixed into one batch with ordinary
generation, prefilled in chunks, repeated (prefix cache), under a KV cache small enough to
preempt - every vector still equals HF ``AutoModel``'s last hidden state pooled the same way
(fp32), and every generated token still equals HF greedy decoding.

``run_mixed`` is shared with tests/cuda/test_cuda_embeddings.py (the same checks on a GPU,
with CUDA graphs).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

from core import LLM
from core.pooling import PoolingParams
from core.sampling_params import SamplingParams
from tests.helpers import tiny_llama_dir
from tests.integration.test_engine_hf import assert_all_blocks_free, hf_greedy, random_prompts

MAX_NEW = 12


def hf_pooled(path, prompts: list[list[int]], kind: str, normalize: bool, device: str = "cpu") -> list[torch.Tensor]:
    model = AutoModel.from_pretrained(path, dtype=torch.float32).to(device).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            h = model(input_ids=torch.tensor([ids], device=device)).last_hidden_state[0].cpu()
            v = h[-1] if kind == "last" else h.mean(0)
            out.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return out


def run_mixed(llm: LLM, path, kind: str, normalize: bool, device: str = "cpu") -> None:
    """Embedding and generation requests in one engine, checked against HF."""
    engine = llm.engine
    embed = random_prompts(10, 512, seed=3, lo=3, hi=60)
    embed += [embed[0], embed[1][:9]]  # a repeat (cache hit possible) and a prefix of another
    gen = random_prompts(4, 512, seed=4, lo=3, hi=30)
    pool = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, pooling=PoolingParams(kind, normalize))
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    ids = {}
    for i in range(max(len(embed), len(gen))):  # interleaved, so batches mix both kinds
        if i < len(embed):
            ids[engine.add_request(f"e{i}", embed[i], pool)] = ("e", i)
        if i < len(gen):
            ids[engine.add_request(f"g{i}", gen[i], greedy)] = ("g", i)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert len(done) == len(ids)
    want_vecs = hf_pooled(path, embed, kind, normalize, device)
    for i, want in enumerate(want_vecs):
        got = done[f"e{i}"].pooled
        assert got is not None, f"embedding {i} has no vector"
        torch.testing.assert_close(torch.tensor(got), want, atol=3e-5, rtol=1e-4, msg=f"embedding {i}")
    assert [list(done[f"g{i}"].outputs[0].token_ids) for i in range(len(gen))] == hf_greedy(path, gen, MAX_NEW)
    assert all(done[f"g{i}"].pooled is None for i in range(len(gen)))
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("embed-engine"), seed=5)


@pytest.mark.parametrize("kind,normalize", [("last", True), ("mean", False), ("mean", True)])
def test_pooling_mixed_with_generation_matches_hf(path, kind, normalize):
    # 16-token steps: prompts of up to 60 tokens are prefilled in chunks beside decodes.
    llm = LLM(model=str(path), platform="cpu", dtype="float32", block_size=16, kv_cache_memory="8MiB",
              max_num_batched_tokens=16, max_model_len=128)
    run_mixed(llm, path, kind, normalize)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_pooling_survives_preemption(path, mode):
    # A cache of a few dozen blocks for 16 requests of up to 60 tokens: sequences are preempted
    # mid-prefill. A recomputed mean restarts from position 0 and must not keep stale sums; a
    # swapped one resumes where it was and must keep its sum.
    swap = dict(preemption_mode="swap", swap_space=0.01) if mode == "swap" else {}
    llm = LLM(model=str(path), platform="cpu", dtype="float32", block_size=16, kv_cache_memory="80KiB",
              max_num_batched_tokens=32, max_model_len=128, **swap)
    run_mixed(llm, path, "mean", True)
    assert llm.engine.scheduler.stats().num_preemptions > 0
