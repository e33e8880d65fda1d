"""Paged decode kernels (v1 and v2) against core.attention.reference_attention.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/cuda`` (the first test
JIT-builds csrc/ unless the prebuilt extension is installed).
"""

from __future__ import annotations

import pytest
import torch

from core.attention import reference_attention
from tests.cuda.kv_helpers import TOLERANCE, poisoned_cache, rel_error, scatter_sequences

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

LENS = [1, 15, 17, 100, 513, 1100]  # mostly not multiples of the block size


@pytest.fixture(scope="module")
def ops():
    from platforms.cuda.build import load_ops

    return load_ops()


def run_decode(ops, dtype, head, bs, group, partition, window=None, lens=LENS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hkv = 2
    hq = hkv * group
    cache = poisoned_cache(sum(-(-n // bs) for n in lens) + 7, bs, hkv, head, dtype)
    paged = scatter_sequences(cache, lens, gen)
    query = torch.randn(len(lens), hq, head, generator=gen).to(dtype)
    out = torch.full_like(query, float("nan"), device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = head**-0.5
    ops.paged_decode(out, query.cuda(), cache, paged.block_tables, seq_lens, scale, max(lens),
                     partition, window or 0)
    torch.cuda.synchronize()
    ref = reference_attention(query, paged.keys, paged.values, [1] * len(lens), scale, window)
    return out.cpu(), ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 6, 8])
@pytest.mark.parametrize("partition", [0, 32, 512], ids=["v1", "v2p32", "v2p512"])
def test_decode_matches_reference(ops, dtype, head, bs, group, partition):
    out, ref = run_decode(ops, dtype, head, bs, group, partition)
    assert torch.isfinite(out).all(), "unwritten or NaN output rows"
    err = rel_error(out, ref)
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("partition", [0, 64], ids=["v1", "v2"])
def test_sliding_window(ops, partition):
    out, ref = run_decode(ops, torch.float32, 128, 16, 4, partition, window=100, seed=3)
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < TOLERANCE[torch.float32]


def test_v1_and_v2_agree_on_long_context(ops):
    """Many partitions (32k tokens / 256) through the reduce kernel, vs single pass."""
    lens = [32768, 4097]
    a, ref = run_decode(ops, torch.bfloat16, 128, 16, 4, 0, lens=lens, seed=5)
    b, _ = run_decode(ops, torch.bfloat16, 128, 16, 4, 256, lens=lens, seed=5)
    assert rel_error(a, ref) < TOLERANCE[torch.bfloat16]
    assert rel_error(b, ref) < TOLERANCE[torch.bfloat16]


def test_fresh_inputs_each_seed_differ(ops):
    """Guard against a kernel that ignores its inputs: two seeds give different outputs."""
    a, _ = run_decode(ops, torch.float32, 64, 16, 4, 0, seed=1)
    b, _ = run_decode(ops, torch.float32, 64, 16, 4, 0, seed=2)
    assert rel_error(a, b) > 0.1


def test_bad_head_size_is_refused(ops):
    cache = poisoned_cache(4, 16, 2, 96, torch.bfloat16)
    q = torch.zeros(1, 2, 96, dtype=torch.bfloat16, device="cuda")
    bt = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    lens = torch.ones(1, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="head size 96"):
        ops.paged_decode(q.clone(), q, cache, bt, lens, 1.0, 1, 0, 0)
