"""Conformance checks: ``copy_blocks`` and ``swap_blocks``.

Layouts are opaque, so copies are verified two layout-free ways: the number of cache
elements still holding the poison drops by exactly the number of written elements the
copied blocks carry (so nothing else was touched), and attending through a block table
that names the destination blocks gives the reference output (so the right data landed
in the right place). Copy pairs live on the device, swap pairs on the host (as the
model runner passes them).
"""

from __future__ import annotations

import random

import torch

from core.conformance.harness import (
    HEAD_SIZE,
    Failures,
    PagedCase,
    Seq,
    case_grid,
    describe,
    make_spec,
    seeded,
)
from core.platform import Platform

NUM_BLOCKS = 24
NUM_LAYERS = 3


def _same_blocks(case: PagedCase, seq: Seq) -> Seq:
    """A sequence of the same length in the same blocks, with its own random data."""
    n, s = len(seq.keys), case.spec
    return Seq(
        case.randn(n, s.num_kv_heads, s.head_size),
        case.randn(n, s.num_kv_heads, s.head_size),
        case.randn(n, s.num_heads, s.head_size),
        list(seq.blocks),
    )


def _moved(seq: Seq, blocks: list[int]) -> Seq:
    """The same tokens, looked up through other blocks."""
    return Seq(seq.keys, seq.values, seq.queries, blocks, seq.cached)


def test_copy_blocks(core_platform: Platform) -> None:
    """copy_blocks copies every pair on every layer in one call and touches nothing else;
    attending through the destination blocks gives the reference output; no pairs, no change."""
    f = Failures()
    for dtype, bs, heads in case_grid(core_platform):
        f.case()
        _copy_case(core_platform, dtype, bs, heads, f)
    f.raise_if_any("copy_blocks")


def _copy_case(platform: Platform, dtype, bs: int, heads: str, f: Failures) -> None:
    label = describe(dtype, bs, heads)
    case = PagedCase(platform, make_spec(dtype, bs, heads), NUM_BLOCKS, seeded("copy", dtype, bs, heads))
    caches = [case.cache, *(case.new_cache() for _ in range(NUM_LAYERS - 1))]
    x0, y0 = case.new_seq(2 * bs + 4), case.new_seq(bs + 6)
    layers = [(x0, y0)] + [(_same_blocks(case, x0), _same_blocks(case, y0)) for _ in caches[1:]]
    for cache, (x, y) in zip(caches, layers):
        case.write(x, len(x.keys) - 1, cache)
        case.write(y, len(y.keys) - 1, cache)
    before = [case.sentinel_count(c) for c in caches]

    dst = [case.free.pop() for _ in x0.blocks]
    pairs = [[s, d] for s, d in zip(x0.blocks, dst)]
    random.Random(bs).shuffle(pairs)
    backend = type(case.backend)
    backend.copy_blocks(caches, torch.tensor(pairs, dtype=torch.int64, device=case.device))

    written = 2 * (len(x0.keys) - 1) * case.spec.num_kv_heads * HEAD_SIZE
    for layer, (cache, (x, y)) in enumerate(zip(caches, layers)):
        drop = before[layer] - case.sentinel_count(cache)
        f.expect(
            drop == written,
            f"{label}/layer {layer}: copying {len(pairs)} blocks replaced {drop} poisoned "
            f"elements, expected exactly {written} (the written elements of the source blocks)",
        )
        via_dst = case.step([], [_moved(x, dst)], cache=cache, label=f"{label}/layer {layer}: via dst")
        f.compare(via_dst, dtype)
        via_src = case.step([], [x, y], cache=cache, label=f"{label}/layer {layer}: via src")
        f.compare(via_src, dtype)

    snapshot = [c.clone() for c in caches]
    backend.copy_blocks(caches, torch.empty((0, 2), dtype=torch.int64, device=case.device))
    f.expect(
        all(torch.equal(a, b) for a, b in zip(snapshot, caches)),
        f"{label}: copy_blocks with no pairs changed a cache",
    )


def test_swap_blocks(core_platform: Platform) -> None:
    """swap_blocks moves blocks device -> host -> device (host cache from
    allocate_kv_cache(n, 'cpu')) in one call each way; attending through the blocks they
    land in gives the reference output; the source is left unchanged."""
    f = Failures()
    for dtype, bs, heads in case_grid(core_platform):
        f.case()
        _swap_case(core_platform, dtype, bs, heads, f)
    f.raise_if_any("swap_blocks")


def _swap_case(platform: Platform, dtype, bs: int, heads: str, f: Failures) -> None:
    label = describe(dtype, bs, heads)
    case = PagedCase(platform, make_spec(dtype, bs, heads), NUM_BLOCKS, seeded("swap", dtype, bs, heads))
    seqs = [case.new_seq(2 * bs + 4), case.new_seq(bs + 6)]
    for s in seqs:
        case.write(s, len(s.keys) - 1)
    src_blocks = [b for s in seqs for b in s.blocks]
    written = sum(2 * s.cached * case.spec.num_kv_heads * HEAD_SIZE for s in seqs)
    rng = random.Random(bs * 7 + len(heads))

    host = case.new_cache(10, "cpu")
    f.expect(host.device.type == "cpu", f"{label}: host cache allocated on {host.device}")
    host_blocks = rng.sample(range(10), len(src_blocks))
    device_before = case.cache.clone()
    backend = type(case.backend)
    backend.swap_blocks(case.cache, host, torch.tensor(list(zip(src_blocks, host_blocks))))
    f.expect(torch.equal(device_before, case.cache), f"{label}: swap-out changed the device cache")
    drop = host.numel() - case.sentinel_count(host)
    f.expect(
        drop == written,
        f"{label}: swap-out replaced {drop} poisoned host elements, expected exactly {written}",
    )

    back = case.new_cache()
    back_blocks = rng.sample(range(1, NUM_BLOCKS), len(src_blocks))
    backend.swap_blocks(host, back, torch.tensor(list(zip(host_blocks, back_blocks))))
    drop = back.numel() - case.sentinel_count(back)
    f.expect(
        drop == written,
        f"{label}: swap-in replaced {drop} poisoned device elements, expected exactly {written}",
    )
    moved, at = [], 0
    for s in seqs:
        moved.append(_moved(s, back_blocks[at : at + len(s.blocks)]))
        at += len(s.blocks)
    f.compare(case.step([], moved, cache=back, label=f"{label}: decode after swap-out and in"), dtype)
