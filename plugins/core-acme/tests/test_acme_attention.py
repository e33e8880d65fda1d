"""The Acme KV layout and kernels, checked element by element against the documented
layout and against core's float64 reference attention, on seeded random data."""

from __future__ import annotations

import random

import pytest
import torch
from core_acme.attention import QUERY_TILE, AcmeAttentionBackend

from core.attention import AttentionSpec, build_metadata, reference_attention


def spec(block_size=32, heads=8, kv_heads=2, head=64, dtype=torch.float32, window=None):
    return AttentionSpec(heads, kv_heads, head, dtype, block_size, sliding_window=window)


def test_layout_is_block_major_with_keys_transposed():
    s = spec(block_size=32, kv_heads=2, head=16)
    backend = AcmeAttentionBackend(s)
    cache = backend.allocate_kv_cache(5, "cpu")
    assert cache.shape == (5, 2, 2, 16 * 32)
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([3 * 32 + 7, 1 * 32 + 0, 4 * 32 + 31, -1, 2 * 32 + 5])
    key = torch.randn(5, 2, 16, generator=g)
    value = torch.randn(5, 2, 16, generator=g)
    backend.write_kv(key, value, cache, slots)
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, t = divmod(slot, 32)
        for h in range(2):
            keys = cache[block, 0, h].view(16, 32)  # documented: [head, block]
            values = cache[block, 1, h].view(32, 16)  # documented: [block, head]
            assert torch.equal(keys[:, t], key[row, h])
            assert torch.equal(values[t], value[row, h])
    # Exactly the 4 real tokens were written (2 heads x 16 x K and V each); padding nowhere.
    assert int((cache != 0).sum()) == 4 * 2 * 2 * 16
    assert not torch.isin(key[3], cache).any()


def test_all_padding_write_changes_nothing():
    backend = AcmeAttentionBackend(spec())
    cache = backend.allocate_kv_cache(3, "cpu")
    backend.write_kv(torch.randn(4, 2, 64), torch.randn(4, 2, 64), cache, torch.full((4,), -1))
    assert int((cache != 0).sum()) == 0


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (dict(block_size=16), r"blocks of \[32, 64\] tokens, got block size 16; pass --block-size 32"),
        (dict(head=12), r"head size that is a multiple of 8 between 8 and 256; this model has head size 12"),
        (dict(head=512), r"this model has head size 512"),
        (dict(dtype=torch.float16), r"got torch.float16; pass --dtype float32 or --dtype bfloat16"),
    ],
)
def test_layer_shapes_the_npu_cannot_run_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        AcmeAttentionBackend(spec(**bad))


def _run_step(s: AttentionSpec, chunks, num_prefills: int, seed=0, num_blocks=40):
    """Write each sequence's context through write_kv, then one forward over ``chunks``:
    (context_len, new_len) per sequence, prefills first, decodes (new_len 1) last."""
    g = torch.Generator().manual_seed(seed)
    backend = AcmeAttentionBackend(s)
    cache = backend.allocate_kv_cache(num_blocks, "cpu").normal_(generator=g)  # stale garbage
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    keys, values, tables, slots, q_rows = [], [], [], [], []
    for ctx, new in chunks:
        n = ctx + new
        k = torch.randn(n, s.num_kv_heads, s.head_size, generator=g).to(s.dtype)
        v = torch.randn(n, s.num_kv_heads, s.head_size, generator=g).to(s.dtype)
        table = [free.pop() for _ in range(-(-n // s.block_size))]
        seq_slots = [table[p // s.block_size] * s.block_size + p % s.block_size for p in range(n)]
        if ctx:
            backend.write_kv(k[:ctx], v[:ctx], cache, torch.tensor(seq_slots[:ctx]))
        keys.append(k)
        values.append(v)
        tables.append(table)
        slots += seq_slots[ctx:]
        q_rows.append(torch.randn(new, s.num_heads, s.head_size, generator=g).to(s.dtype))
    width = max(map(len, tables)) + 2  # unused null columns, as a runner pads
    padded = [t + [0] * (width - len(t)) for t in tables]
    md = build_metadata([n for _, n in chunks], [c for c, _ in chunks], padded, s.block_size,
                        num_prefills=num_prefills, slot_mapping=slots)
    q = torch.cat(q_rows)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(keys, chunks)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(values, chunks)])
    out = backend.forward(q, new_k, new_v, cache, md)
    want = reference_attention(q, keys, values, [n for _, n in chunks], s.softmax_scale, s.sliding_window)
    return out, want


MIXED = [(0, 2 * QUERY_TILE + 37), (45, 70), (0, 5), (31, 1), (100, 1), (64, 1)]
"""Three prefills then three decodes: a prompt longer than two query tiles, a chunk over cached context, a short prompt,
then decodes whose contexts end inside, at, and past block boundaries."""


@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4), (6, 1)])
def test_mixed_batch_matches_the_reference(block_size, heads, kv_heads):
    s = spec(block_size=block_size, heads=heads, kv_heads=kv_heads)
    out, want = _run_step(s, MIXED, 3, seed=block_size + heads)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_sliding_window_matches_the_reference():
    s = spec(window=40)
    out, want = _run_step(s, MIXED, 3, seed=7)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_bfloat16_matches_the_reference_within_bf16_rounding():
    s = spec(dtype=torch.bfloat16, block_size=64)
    out, want = _run_step(s, MIXED, 3, seed=3)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_copy_blocks_copies_whole_blocks_on_every_layer():
    g = torch.Generator().manual_seed(5)
    caches = [AcmeAttentionBackend(spec()).allocate_kv_cache(8, "cpu").normal_(generator=g) for _ in range(3)]
    before = [c.clone() for c in caches]
    pairs = torch.tensor([[1, 6], [4, 2], [6, 7]])  # 6 is read before it is overwritten
    AcmeAttentionBackend.copy_blocks(caches, pairs)
    for c, b in zip(caches, before):
        expected = b.clone()
        for src, dst in pairs.tolist():
            expected[dst] = b[src]
        assert torch.equal(c, expected)


def test_swap_blocks_round_trip():
    g = torch.Generator().manual_seed(6)
    backend = AcmeAttentionBackend(spec(block_size=64))
    device = backend.allocate_kv_cache(6, "cpu").normal_(generator=g)
    host = backend.allocate_kv_cache(4, "cpu")
    AcmeAttentionBackend.swap_blocks(device, host, torch.tensor([[5, 0], [2, 3]]))
    assert torch.equal(host[0], device[5]) and torch.equal(host[3], device[2])
    assert int((host[1:3] != 0).sum()) == 0
    back = backend.allocate_kv_cache(6, "cpu")
    AcmeAttentionBackend.swap_blocks(host, back, torch.tensor([[0, 1], [3, 4]]))
    assert torch.equal(back[1], device[5]) and torch.equal(back[4], device[2])
