"""Builders for the CUDA kernel tests: poisoned caches filled by plain torch indexing.

Everything here is independent of the code under test: sequences are scattered into the
``[num_blocks, 2, num_kv_heads, block_size, head_size]`` layout with ordinary tensor
indexing, and every slot no sequence owns holds NaN, so a kernel that reads past a
sequence (or writes where it should not) shows up as NaN or as a changed poison value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
"""Relative L2 error allowed against the float64 reference (output rounding dominates)."""


def poisoned_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device="cuda"):
    shape = (num_blocks, 2, num_kv_heads, block_size, head_size)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@dataclass
class Paged:
    """Sequences scattered into a cache."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, unused entries 0
    keys: list[torch.Tensor]  # per sequence [len, num_kv_heads, head_size] (cache dtype, CPU)
    values: list[torch.Tensor]


def scatter_sequences(cache, lens, gen, reserve_block_zero=True) -> Paged:
    """Random K/V for sequences of ``lens`` tokens written into distinct random blocks."""
    num_blocks, _, hkv, bs, d = cache.shape
    need = [-(-n // bs) for n in lens]
    first = 1 if reserve_block_zero else 0
    pool = torch.randperm(num_blocks - first, generator=gen)[: sum(need)] + first
    assert pool.numel() == sum(need), "cache too small for these sequences"
    tables = torch.zeros(len(lens), max(need + [1]), dtype=torch.int32)
    keys, values, used = [], [], 0
    for i, n in enumerate(lens):
        tables[i, : need[i]] = pool[used : used + need[i]].int()
        used += need[i]
        k = torch.randn(n, hkv, d, generator=gen).to(cache.dtype)
        v = torch.randn(n, hkv, d, generator=gen).to(cache.dtype)
        write_tokens(cache, tables[i], 0, k, v)
        keys.append(k)
        values.append(v)
    return Paged(tables.to(cache.device), keys, values)


def write_tokens(cache, table_row, first_pos, k, v) -> None:
    """Plain-indexing write of tokens at positions first_pos.. of one sequence."""
    bs = cache.shape[3]
    pos = torch.arange(first_pos, first_pos + k.shape[0])
    blocks = table_row.cpu().long()[pos // bs].to(cache.device)
    offs = (pos % bs).to(cache.device)
    cache[blocks, 0, :, offs, :] = k.to(cache.device)
    cache[blocks, 1, :, offs, :] = v.to(cache.device)


def slots_for(table_row, first_pos, count, block_size) -> torch.Tensor:
    """Slot ids (block * block_size + offset) of positions first_pos.. of one sequence."""
    pos = torch.arange(first_pos, first_pos + count)
    return table_row.cpu().long()[pos // block_size] * block_size + pos % block_size


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm())
