"""Which op writes which rows' keys and values into the cache in the CUDA backend, checked on
the CPU with stand-in ops in plain torch (the kernels themselves are checked on the GPU:
tests/cuda/test_cuda_paged_decode.py): a step's decode rows go to ``paged_decode_and_cache``
(the decode kernel stores their new tokens itself), its prompt rows to ``reshape_and_cache``;
an fp8 cache, and rows the kernel cannot read 16 bytes at a time, keep the two-launch path."""

from __future__ import annotations

import torch

from core.attention import AttentionSpec, build_metadata, reference_attention
from platforms.cuda.attention import CudaPagedAttention
from tests.cuda.kv_helpers import poisoned_cache, slots_for, write_tokens


def _store(key, value, cache, slots) -> None:
    bs = cache.shape[3]
    keep = slots >= 0
    blocks, offs = slots[keep] // bs, slots[keep] % bs
    cache[blocks, 0, :, offs, :] = key[keep].to(cache.dtype)
    cache[blocks, 1, :, offs, :] = value[keep].to(cache.dtype)


def _decode(out, query, cache, tables, lens, scale) -> None:
    bs = cache.shape[3]
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        blocks = tables[i].long()[pos // bs]
        k, v = cache[blocks, 0, :, pos % bs, :], cache[blocks, 1, :, pos % bs, :]  # [n, Hkv, D]
        out[i] = reference_attention(query[i : i + 1], [k], [v], [1], scale)[0]


class RecordingOps:
    """Plain-torch stand-ins of the three ops, each noting the slots (or lengths) it got."""

    def __init__(self):
        self.calls: list[tuple[str, list[int]]] = []
        self.counts: list[torch.Tensor | None] = []  # the part_count= of each decode launch

    def reshape_and_cache(self, key, value, cache, slots, k_scale=1.0, v_scale=1.0):
        self.calls.append(("reshape_and_cache", slots.tolist()))
        _store(key, value, cache, slots)

    def paged_decode(self, out, query, cache, tables, lens, scale, max_len, partition, window, cap,
                     k_scale=1.0, v_scale=1.0, part_count=None):
        self.calls.append(("paged_decode", lens.tolist()))
        self.counts.append(part_count)
        _decode(out, query, cache, tables, lens, scale)

    def paged_decode_and_cache(self, out, query, key, value, slots, cache, tables, lens, scale,
                               max_len, partition, window, cap=0.0, part_count=None):
        assert key.shape[0] == value.shape[0] == slots.shape[0] == query.shape[0]
        self.calls.append(("paged_decode_and_cache", slots.tolist()))
        self.counts.append(part_count)
        _store(key, value, cache, slots)
        _decode(out, query, cache, tables, lens, scale)


SEQS = [(0, 20), (16, 8), (30, 1), (5, 1)]  # (cached context, new tokens): 2 prompts, 2 decodes


def _step(spec, gen):
    """A mixed step over a NaN-poisoned cache holding each sequence's context only."""
    bs, hkv, d = spec.block_size, spec.num_kv_heads, spec.head_size
    cache = poisoned_cache(40, bs, hkv, d, spec.dtype, device="cpu")
    tables = torch.zeros(len(SEQS), 3, dtype=torch.int32)
    keys, values, new_k, new_v, slots = [], [], [], [], []
    for i, (ctx, new) in enumerate(SEQS):
        tables[i, : -(-(ctx + new) // bs)] = torch.arange(1 + 3 * i, 1 + 3 * i + -(-(ctx + new) // bs))
        k, v = torch.randn(ctx + new, hkv, d, generator=gen), torch.randn(ctx + new, hkv, d, generator=gen)
        write_tokens(cache, tables[i], 0, k[:ctx], v[:ctx])
        keys.append(k)
        values.append(v)
        new_k.append(k[ctx:])
        new_v.append(v[ctx:])
        slots.append(slots_for(tables[i], ctx, new, bs))
    q_lens = [n for _, n in SEQS]
    query = torch.randn(sum(q_lens), spec.num_heads, d, generator=gen)
    md = build_metadata(q_lens, [c for c, _ in SEQS], tables.numpy(), bs, num_prefills=2,
                        slot_mapping=torch.cat(slots).numpy())
    ref = reference_attention(query, keys, values, q_lens, spec.softmax_scale)
    return query, torch.cat(new_k), torch.cat(new_v), cache, md, ref, torch.cat(slots).tolist()


def test_decode_rows_are_stored_by_the_decode_kernel():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32, block_size=16)
    query, key, value, cache, md, ref, slots = _step(spec, torch.Generator().manual_seed(3))
    ops = RecordingOps()
    out = CudaPagedAttention(spec, decode_partition=0, ops=ops).forward(query, key, value, cache, md)
    prompt_rows = md.num_prefill_tokens
    assert ops.calls == [("reshape_and_cache", slots[:prompt_rows]),
                         ("paged_decode_and_cache", slots[prompt_rows:])]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    at = torch.tensor(slots)  # every new token, prompt or decode, is in the cache
    assert torch.equal(cache[at // 16, 0, :, at % 16, :], key)
    assert torch.equal(cache[at // 16, 1, :, at % 16, :], value)


def test_fp8_caches_and_unaligned_rows_keep_the_cache_write_kernel():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32, block_size=16)
    query, key, value, cache, md, ref, slots = _step(spec, torch.Generator().manual_seed(4))
    wide = torch.zeros(key.shape[0], 2, 65)
    wide[..., 1:] = key
    shifted = wide[..., 1:]  # contiguous in head_size, but rows start 4 bytes off 16
    ops = RecordingOps()
    out = CudaPagedAttention(spec, decode_partition=0, ops=ops).forward(query, shifted, value, cache, md)
    assert ops.calls == [("reshape_and_cache", slots), ("paged_decode", [31, 6])]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

    fp8 = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32, block_size=16,
                        kv_cache_dtype=torch.float8_e4m3fn)
    ops = RecordingOps()
    backend = CudaPagedAttention(fp8, decode_partition=0, ops=ops)
    decode = build_metadata([1, 1], [30, 5], [[1, 2], [4, 0]], 16, num_prefills=0, slot_mapping=[46, 69])
    q = torch.randn(2, 4, 64)
    kv = torch.randn(2, 2, 64)
    backend.forward(q, kv, kv, torch.zeros(8, 2, 2, 16, 64, dtype=torch.float8_e4m3fn), decode)
    assert [name for name, _ in ops.calls] == ["reshape_and_cache", "paged_decode"]


def test_v2_launches_get_this_layers_arrival_counts():
    """A v2 decode (partitions) passes the layer's int32 zeros for the merge in the main kernel
    (csrc/launchers.h part_count): at least sequences x query heads of them, the same tensor on
    every launch that fits, a larger one when the batch outgrows it; v1 passes none."""
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32, block_size=16)
    query, key, value, cache, md, ref, _ = _step(spec, torch.Generator().manual_seed(5))
    ops = RecordingOps()
    backend = CudaPagedAttention(spec, decode_partition=64, ops=ops)
    out = backend.forward(query, key, value, cache, md)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    first = ops.counts[-1]
    assert first is not None and first.dtype == torch.int32 and first.numel() >= 2 * 4
    assert not first.any()
    backend.forward(query, key, value, cache, md)
    assert ops.counts[-1] is first
    n = 300  # decode rows: more (sequence, head) pairs than the first allocation holds
    tables = torch.arange(1, 1 + n, dtype=torch.int32).unsqueeze(1)
    many = build_metadata([1] * n, [3] * n, tables.numpy(), 16, num_prefills=0,
                          slot_mapping=(tables[:, 0].long() * 16 + 3).numpy())
    big = poisoned_cache(n + 1, 16, 2, 64, torch.float32, device="cpu")
    kv = torch.randn(n, 2, 64)
    for i in range(n):
        write_tokens(big, tables[i], 0, torch.randn(3, 2, 64), torch.randn(3, 2, 64))
    backend.forward(torch.randn(n, 4, 64), kv, kv, big, many)
    grown = ops.counts[-1]
    assert grown is not first and grown.numel() >= n * 4 and not grown.any()
    assert any(t is first for t in backend._retired_counts)  # graphs may still replay on it
    CudaPagedAttention(spec, decode_partition=0, ops=ops).forward(query, key, value, cache, md)
    assert ops.counts[-1] is None
