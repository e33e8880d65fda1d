"""The core_C ops under CUDA-graph capture and torch.compile.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/cuda``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core.attention import AttentionSpec, reference_attention
from tests.cuda.kv_helpers import TOLERANCE, rel_error
from tests.cuda.test_cuda_backend import build_batch, make_backend

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=128, dtype=torch.bfloat16,
                     block_size=16)
DECODES = [(70, 1), (5, 1), (900, 1), (33, 1), (1, 1)]


def decode_batch(seed):
    """Decode-only batch plus one padding row (slot -1, null block 0, length 1), the way a
    graph-padded batch arrives."""
    query, key, value, cache, md, _ = build_batch(SPEC, DECODES, torch.Generator().manual_seed(seed))

    def pad(t, fill):
        return torch.cat([t, torch.full_like(t[:1], fill)])

    md = dataclasses.replace(
        md,
        num_decode_tokens=md.num_decode_tokens + 1,
        slot_mapping=pad(md.slot_mapping, -1),
        seq_lens=pad(md.seq_lens, 1),
        context_lens=pad(md.context_lens, 0),
        query_start_loc=torch.cat([md.query_start_loc, md.query_start_loc[-1:] + 1]),
        block_tables=pad(md.block_tables, 0),
        seq_lens_host=(*md.seq_lens_host, 1),
        context_lens_host=(*md.context_lens_host, 0),
    )
    return pad(query, 1.0), pad(key, 1.0), pad(value, 1.0), cache, md


@pytest.mark.parametrize("partition", [0, 64], ids=["v1", "v2"])
def test_decode_forward_replays_in_a_cuda_graph(partition):
    query, key, value, cache, md = decode_batch(21)
    backend = make_backend(SPEC, decode_partition=partition)
    backend.forward(query, key, value, cache, md)  # warm-up outside capture (loads kernels)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(query, key, value, cache, md)

    # New inputs in the captured buffers; the graph must compute with them.
    gen = torch.Generator().manual_seed(22)
    for t in (query, key, value):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    real = len(DECODES)
    keys, values = gather_all(cache, md, real)
    ref = reference_attention(query[:real].cpu(), keys, values, [1] * real, SPEC.softmax_scale)
    assert rel_error(out[:real], ref) < TOLERANCE[SPEC.dtype]
    assert torch.isnan(cache[0]).all(), "the padding row's key/value was written"


def gather_all(cache, md, count):
    """The first ``count`` sequences' K/V read back from the cache with plain indexing
    (after the replay wrote this step's tokens)."""
    bs = cache.shape[3]
    keys, values = [], []
    for i, n in enumerate(md.seq_lens_host[:count]):
        pos = torch.arange(n, device=cache.device)
        blocks = md.block_tables[i].long()[pos // bs]
        kv = cache[blocks, :, :, pos % bs, :]  # [n, 2, Hkv, D]
        keys.append(kv[:, 0].cpu())
        values.append(kv[:, 1].cpu())
    return keys, values


def test_ops_under_torch_compile():
    query, key, value, cache, md = decode_batch(23)
    ops = torch.ops.core_C
    n = md.num_decode_tokens

    def step(q, k, v, kv_cache, slots, tables, lens):
        ops.reshape_and_cache(k, v, kv_cache, slots)
        out = torch.empty_like(q)
        ops.paged_decode(out, q, kv_cache, tables, lens, SPEC.softmax_scale, md.max_seq_len,
                         64, 0)
        return out * 2.0

    compiled = torch.compile(step, fullgraph=True)
    args = (query, key, value, cache, md.slot_mapping, md.block_tables[:n], md.seq_lens[:n])
    got = compiled(*args)
    want = step(*args)
    torch.cuda.synchronize()
    real = len(DECODES)
    assert torch.isfinite(got[:real]).all()
    assert torch.equal(got[:real], want[:real])
