"""Conformance checks: the declared KV layout, and ``write_kv`` with padding slots."""

from __future__ import annotations

import math

import torch

from core.conformance.harness import (
    HEAD_SIZE,
    Failures,
    PagedCase,
    case_grid,
    describe,
    make_spec,
    seeded,
)
from core.platform import Platform


def test_kv_cache_layout(core_platform: Platform) -> None:
    """kv_cache_shape holds exactly 2*blocks*block_size*kv_heads*head elements;
    allocate_kv_cache returns that shape in the spec's dtype on the device and on the host."""
    f = Failures()
    device_type = core_platform.device(0).type
    for dtype, bs, heads in case_grid(core_platform):
        spec = make_spec(dtype, bs, heads)
        backend = core_platform.attention_backend_class(spec)(spec)
        for num_blocks in (1, 7):
            f.case()
            label = f"{describe(dtype, bs, heads)}/{num_blocks} blocks"
            shape = tuple(backend.kv_cache_shape(num_blocks, bs, spec.num_kv_heads, HEAD_SIZE))
            want = 2 * num_blocks * bs * spec.num_kv_heads * HEAD_SIZE
            f.expect(
                all(isinstance(d, int) and d > 0 for d in shape) and math.prod(shape) == want,
                f"{label}: kv_cache_shape {shape} holds {math.prod(shape)} elements, "
                f"expected 2*{num_blocks}*{bs}*{spec.num_kv_heads}*{HEAD_SIZE} = {want}",
            )
            for where, expect_type in ((core_platform.device(0), device_type), ("cpu", "cpu")):
                cache = backend.allocate_kv_cache(num_blocks, where)
                got = (tuple(cache.shape), cache.dtype, cache.device.type)
                f.expect(
                    got == (shape, dtype, expect_type),
                    f"{label}: allocate_kv_cache(device={where}) gave shape/dtype/device {got}, "
                    f"expected {(shape, dtype, expect_type)}",
                )
    f.raise_if_any("KV-cache layout")


def test_write_kv_padding(core_platform: Platform) -> None:
    """write_kv stores every real row where the backend's forward finds it and writes
    nothing for negative (padding) slots: the number of changed cache elements is exactly
    2*tokens*kv_heads*head, padding values appear nowhere, an all-padding write is a no-op."""
    f = Failures()
    for dtype, bs, heads in case_grid(core_platform):
        f.case()
        _padding_case(core_platform, dtype, bs, heads, f)
    f.raise_if_any("write_kv with padding slots")


def _padding_case(platform: Platform, dtype, bs: int, heads: str, f: Failures) -> None:
    label = describe(dtype, bs, heads)
    case = PagedCase(platform, make_spec(dtype, bs, heads), 8, seeded("pad", dtype, bs, heads))
    per_token = 2 * case.spec.num_kv_heads * HEAD_SIZE
    total = case.cache.numel()
    length = 2 * bs + 3  # ends inside a block
    seq = case.new_seq(length + 1)

    # Interleave padding rows (slots -1 and -7, one of them first) whose values sit near
    # 1000, far from both the data and the sentinel, so a stray write is unmistakable.
    real = case.slots(seq, 0, length)
    order = [-1, *[i for r in range(length) for i in ((r, -7) if r % 3 == 1 else (r,))], -1]
    pad_k = case.randn(len(order), case.spec.num_kv_heads, HEAD_SIZE, offset=1000.0)
    pad_v = case.randn(len(order), case.spec.num_kv_heads, HEAD_SIZE, offset=1000.0)
    is_real = torch.tensor([i >= 0 for i in order])
    idx = torch.tensor([max(i, 0) for i in order])
    keys = torch.where(is_real[:, None, None], seq.keys[idx], pad_k)
    values = torch.where(is_real[:, None, None], seq.values[idx], pad_v)
    slots = torch.tensor([real[i] if i >= 0 else i for i in order], dtype=torch.int64)
    dev = case.device
    case.backend.write_kv(keys.to(dev), values.to(dev), case.cache, slots.to(dev))
    seq.cached = length

    changed = total - case.sentinel_count()
    f.expect(
        changed == length * per_token,
        f"{label}: write_kv of {length} real + {len(order) - length} padding rows changed "
        f"{changed} cache elements, expected exactly {length * per_token}",
    )
    f.expect(
        not bool((case.cache.float() > 500).any()),
        f"{label}: values of padding rows (slot < 0) were written into the cache",
    )
    before = case.cache.clone()
    none = torch.full((3,), -1, dtype=torch.int64, device=dev)
    case.backend.write_kv(keys[:3].to(dev), values[:3].to(dev), case.cache, none)
    f.expect(torch.equal(before, case.cache), f"{label}: an all-padding write_kv changed the cache")

    # The written rows are where the backend's own attention looks for them.
    f.compare(case.step([], [seq], label=f"{label}: decode over write_kv'd context"), dtype)
    changed = total - case.sentinel_count()
    f.expect(
        changed == (length + 1) * per_token,
        f"{label}: after one decode step {changed} cache elements differ from the poison, "
        f"expected {(length + 1) * per_token}",
    )

