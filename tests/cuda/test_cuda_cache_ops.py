"""reshape_and_cache, copy_blocks and swap_blocks against plain torch indexing.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/cuda``.
"""

from __future__ import annotations

import pytest
import torch

from tests.cuda.kv_helpers import poisoned_cache

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.fixture(scope="module")
def ops():
    from platforms.cuda.build import load_ops

    return load_ops()


def qkv_views(tokens, hq, hkv, head, dtype, gen, misalign=0):
    """key/value as strided views into one fused qkv buffer, as a model produces them."""
    width = (hq + 2 * hkv) * head
    flat = torch.randn(tokens, width + misalign, generator=gen).to(dtype).cuda()
    qkv = flat[:, misalign:]
    key = qkv[:, hq * head : (hq + hkv) * head].view(tokens, hkv, head)
    value = qkv[:, (hq + hkv) * head :].view(tokens, hkv, head)
    return key, value


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("misalign", [0, 1], ids=["aligned", "misaligned"])
def test_reshape_and_cache_writes_only_real_slots(ops, dtype, head, bs, misalign):
    gen = torch.Generator().manual_seed(11)
    tokens, hkv, num_blocks = 57, 2, 9
    key, value = qkv_views(tokens, 4, hkv, head, dtype, gen, misalign)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:tokens]
    slots[torch.randperm(tokens, generator=gen)[:9]] = -1  # padding tokens
    cache = poisoned_cache(num_blocks, bs, hkv, head, dtype)
    ops.reshape_and_cache(key, value, cache, slots.cuda())

    real = slots >= 0
    s = slots[real]
    blocks, offs = (s // bs).cuda(), (s % bs).cuda()
    assert torch.equal(cache[blocks, 0, :, offs, :], key[real.cuda()])
    assert torch.equal(cache[blocks, 1, :, offs, :], value[real.cuda()])
    written = int(real.sum()) * 2 * hkv * head
    assert int(torch.isnan(cache).sum()) == cache.numel() - written, "a padding slot was written"


def random_caches(layers, num_blocks, gen, dtype=torch.bfloat16, device="cuda"):
    return [
        torch.randn(num_blocks, 2, 2, 16, 64, generator=gen).to(dtype).to(device)
        for _ in range(layers)
    ]


@pytest.mark.parametrize("pairs_device", ["cpu", "cuda"])
def test_copy_blocks_all_layers(ops, pairs_device):
    gen = torch.Generator().manual_seed(12)
    caches = random_caches(3, 12, gen)
    expected = [c.clone() for c in caches]
    pairs = torch.tensor([[1, 5], [2, 6], [7, 3], [11, 0]])
    for e in expected:
        e[pairs[:, 1]] = e[pairs[:, 0]]
    ops.copy_blocks(caches, pairs.to(pairs_device))
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)


def test_copy_blocks_refuses_out_of_range_ids(ops):
    caches = random_caches(1, 4, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="block_mapping ids"):
        ops.copy_blocks(caches, torch.tensor([[1, 4]]))


def test_swap_blocks_device_host_round_trip(ops):
    gen = torch.Generator().manual_seed(13)
    gpu = random_caches(1, 10, gen)[0]
    host = torch.full((8, *gpu.shape[1:]), float("nan"), dtype=gpu.dtype).pin_memory()
    out_pairs = torch.tensor([[1, 0], [2, 1], [3, 2], [9, 7]])  # a run of three, then one
    ops.swap_blocks(gpu, host, out_pairs)
    torch.cuda.synchronize()
    assert torch.equal(host[out_pairs[:, 1]], gpu[out_pairs[:, 0]].cpu())
    assert torch.isnan(host[[3, 4, 5, 6]]).all(), "swap wrote outside its pairs"

    back = torch.full_like(gpu, float("nan"))
    in_pairs = torch.tensor([[0, 4], [1, 5], [7, 8]])
    ops.swap_blocks(host, back, in_pairs)
    torch.cuda.synchronize()
    assert torch.equal(back[in_pairs[:, 1]], host[in_pairs[:, 0]].cuda())
    assert torch.isnan(back[[0, 1, 2, 3, 6, 7, 9]]).all()
