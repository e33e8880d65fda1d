"""The CPU attention backend against the naive reference, directly and quickly.

The first tests build the metadata and the cache contents by hand from the documented
layout ``[2, blocks, block_size, kv_heads, head]`` (independent of the conformance
harness); the last ones drive random mixed batches through the harness.
"""

from __future__ import annotations

import pytest
import torch

from core.attention import AttentionSpec, build_metadata, reference_attention
from core.conformance.harness import PagedCase, make_spec, mismatch, seeded
from platforms.cpu.attention import CpuAttentionBackend
from platforms.cpu.platform import CpuPlatform

BS, H, KVH, D = 4, 4, 2, 8


def _spec(window: int | None = None) -> AttentionSpec:
    return AttentionSpec(H, KVH, D, torch.float32, BS, sliding_window=window)


def _slot(block: int, offset: int) -> int:
    return block * BS + offset


@pytest.mark.parametrize("window", [None, 3])
def test_hand_built_prefill_and_decode(window: int | None) -> None:
    """Sequence A: a 5-token prompt in blocks [3, 1]. Sequence B: 6 cached tokens in
    blocks [2, 5] (placed by hand in the documented layout) plus one decode token."""
    g = torch.Generator().manual_seed(7)
    backend = CpuAttentionBackend(_spec(window))
    cache = backend.allocate_kv_cache(8, "cpu")
    cache.normal_(generator=g)  # garbage everywhere that is not written below
    b_keys, b_values = torch.randn(7, KVH, D, generator=g), torch.randn(7, KVH, D, generator=g)
    for pos in range(6):
        block, off = [2, 5][pos // BS], pos % BS
        cache[0, block, off], cache[1, block, off] = b_keys[pos], b_values[pos]
    a_keys, a_values = torch.randn(5, KVH, D, generator=g), torch.randn(5, KVH, D, generator=g)
    query = torch.randn(6, H, D, generator=g)
    md = build_metadata([5, 1], [0, 6], [[3, 1, 0], [2, 5, 0]], BS, num_prefills=1)
    assert md.slot_mapping.tolist() == [*(_slot([3, 1][p // BS], p % BS) for p in range(5)), _slot(5, 2)]
    key = torch.cat([a_keys, b_keys[6:]])
    value = torch.cat([a_values, b_values[6:]])
    out = backend.forward(query, key, value, cache, md)
    expected = reference_attention(query, [a_keys, b_keys], [a_values, b_values], [5, 1], D**-0.5, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # The new tokens landed where the layout says.
    torch.testing.assert_close(cache[0, 1, 0], a_keys[4])
    torch.testing.assert_close(cache[1, 5, 2], b_values[6])


def test_write_kv_skips_negative_slots() -> None:
    backend = CpuAttentionBackend(_spec())
    cache = backend.allocate_kv_cache(4, "cpu").fill_(-3.0)
    key, value = torch.randn(3, KVH, D), torch.randn(3, KVH, D)
    backend.write_kv(key, value, cache, torch.tensor([_slot(2, 1), -1, _slot(3, 3)]))
    torch.testing.assert_close(cache[0, 2, 1], key[0])
    torch.testing.assert_close(cache[1, 3, 3], value[2])
    assert int((cache != -3.0).sum()) == 2 * 2 * KVH * D  # two rows of keys and values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 13])
def test_random_mixed_batches(dtype: torch.dtype, block_size: int, window: int | None) -> None:
    """Prefill, chunk over context, and decodes in the same batches, shuffled blocks."""
    case = PagedCase(CpuPlatform(), make_spec(dtype, block_size, "gqa", window), 24, seeded(dtype, block_size))
    a, b, c = case.new_seq(40), case.new_seq(block_size + 3), case.new_seq(2 * block_size + 1)
    steps = [
        case.step([(a, 21), (c, 2 * block_size - 1)], label="two prefills"),
        case.step([(a, 17), (b, block_size)], [c], label="chunk, prefill, decode"),
        case.step([(b, 2)], [a, c], label="chunk, two decodes"),
        case.step([], [a, b], label="decodes"),
    ]
    problems = [p for p in (mismatch(s, dtype) for s in steps) if p]
    assert not problems, problems
