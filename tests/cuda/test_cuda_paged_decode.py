"""Paged decode kernels (v1 and v2) against core.attention.reference_attention, and the fused
cache write of paged_decode_and_cache against reshape_and_cache + paged_decode.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/cuda`` (the first test
JIT-builds csrc/ unless the prebuilt extension is installed).
"""

from __future__ import annotations

import pytest
import torch

from core.attention import reference_attention
from tests.cuda.kv_helpers import TOLERANCE, poisoned_cache, rel_error, scatter_sequences, slots_for

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

LENS = [1, 15, 17, 100, 513, 1100]  # mostly not multiples of the block size


@pytest.fixture(scope="module")
def ops():
    from platforms.cuda.build import load_ops

    return load_ops()


def run_decode(ops, dtype, head, bs, group, partition, window=None, lens=LENS, seed=0,
               counts=None, max_len=None):
    """``counts``: int32 arrival counts (the v2 merge in the main kernel) or None (the reduce
    kernel); ``max_len``: the max_seq_len argument (default: the longest of ``lens``)."""
    gen = torch.Generator().manual_seed(seed)
    hkv = 2
    hq = hkv * group
    cache = poisoned_cache(sum(-(-n // bs) for n in lens) + 7, bs, hkv, head, dtype)
    paged = scatter_sequences(cache, lens, gen)
    query = torch.randn(len(lens), hq, head, generator=gen).to(dtype)
    out = torch.full_like(query, float("nan"), device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = head**-0.5
    extra = {} if counts is None else {"part_count": counts}
    ops.paged_decode(out, query.cuda(), cache, paged.block_tables, seq_lens, scale,
                     max_len or max(lens), partition, window or 0, **extra)
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


def decode_kernels(fn) -> list[str]:
    """Names of the CUDA kernels ``fn`` launches (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 6, 8])  # 6: a partial tile of 8 heads
@pytest.mark.parametrize("partition", [32, 512], ids=["p32", "p512"])
def test_v2_merge_in_the_main_kernel(ops, dtype, head, group, partition):
    """With arrival counts the CTA that finishes a sequence's last partition merges them (one
    partition: the CTA writes the output itself): the reference's result, the reduce kernel's
    to float rounding, no reduce kernel launched, and the counts left zero for the next launch
    (three launches on the same counts, fresh inputs each)."""
    counts = torch.zeros(len(LENS) * 2 * group, dtype=torch.int32, device="cuda")
    for seed in (11, 12, 13):
        out, ref = run_decode(ops, dtype, head, 16, group, partition, seed=seed, counts=counts)
        assert torch.isfinite(out).all(), "unwritten or NaN output rows"
        assert rel_error(out, ref) < TOLERANCE[dtype]
        assert not counts.any(), f"arrival counts left nonzero: {counts.nonzero().flatten().tolist()}"
        reduced, _ = run_decode(ops, dtype, head, 16, group, partition, seed=seed)
        # the same partials, summed in another order: float rounding, then one output rounding
        assert rel_error(out, reduced) < {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    names = decode_kernels(lambda: run_decode(ops, dtype, head, 16, group, partition, counts=counts))
    assert any("paged_decode_kernel" in n for n in names), names
    assert not any("paged_decode_reduce" in n for n in names), names
    names = decode_kernels(lambda: run_decode(ops, dtype, head, 16, group, partition))
    assert any("paged_decode_reduce" in n for n in names), names


def test_v2_merge_with_a_sliding_window_and_many_partitions(ops):
    """Partitions wholly before the window (no token attended) still arrive and weigh zero;
    32k tokens in partitions of 256 (128 of them) merge in the main kernel."""
    counts = torch.zeros(64, dtype=torch.int32, device="cuda")
    out, ref = run_decode(ops, torch.float32, 128, 16, 4, 64, window=100, seed=3, counts=counts)
    assert torch.isfinite(out).all() and rel_error(out, ref) < TOLERANCE[torch.float32]
    lens = [32768, 4097]
    out, ref = run_decode(ops, torch.bfloat16, 128, 16, 4, 256, lens=lens, seed=5, counts=counts)
    assert rel_error(out, ref) < TOLERANCE[torch.bfloat16]
    assert not counts.any()


def test_v2_merge_falls_back_to_the_reduce_kernel(ops):
    """More partitions than the main kernel's shared memory holds weights for (7,000 of 16
    tokens, from max_seq_len): the reduce kernel merges and the counts are not touched (they
    hold 7s here, which the merge would have both used and changed)."""
    counts = torch.full((64,), 7, dtype=torch.int32, device="cuda")
    run = lambda: run_decode(ops, torch.bfloat16, 128, 16, 4, 16, counts=counts, max_len=16 * 7000)  # noqa: E731
    out, ref = run()
    assert rel_error(out, ref) < TOLERANCE[torch.bfloat16]
    assert (counts == 7).all()
    assert any("paged_decode_reduce" in n for n in decode_kernels(run))


def test_v2_merge_in_a_cuda_graph(ops):
    """paged_decode_and_cache with counts, captured once and replayed on fresh queries: each
    replay gives its own attention and leaves the counts zero."""
    gen = torch.Generator().manual_seed(31)
    hkv, group, head, bs = 2, 4, 128, 16
    lens = [1, 17, 300, 1100]
    cache = poisoned_cache(sum(-(-n // bs) for n in lens) + 7, bs, hkv, head, torch.bfloat16)
    paged = scatter_sequences(cache, lens, gen)
    newest = torch.stack([slots_for(paged.block_tables[i], n - 1, 1, bs)[0] for i, n in enumerate(lens)]).cuda()
    key = torch.stack([k[-1] for k in paged.keys]).cuda()
    value = torch.stack([v[-1] for v in paged.values]).cuda()
    query = torch.zeros(len(lens), hkv * group, head, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros_like(query)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    counts = torch.zeros(len(lens) * hkv * group, dtype=torch.int32, device="cuda")
    step = lambda: ops.paged_decode_and_cache(out, query, key, value, newest, cache, paged.block_tables,  # noqa: E731
                                              seq_lens, head**-0.5, max(lens), 64, 0, part_count=counts)
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(4):
        q = torch.randn(query.shape, generator=gen).to(torch.bfloat16)
        query.copy_(q)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_attention(q, paged.keys, paged.values, [1] * len(lens), head**-0.5, None)
        assert rel_error(out.cpu(), ref) < TOLERANCE[torch.bfloat16]
        assert not counts.any()


def tiny_decode_inputs(seqs: int, heads: int, head: int):
    """(cache, query, block_tables, seq_lens) of ``seqs`` one-token sequences, for refusals."""
    cache = poisoned_cache(8, 16, 2, head, torch.bfloat16)
    q = torch.zeros(seqs, heads, head, dtype=torch.bfloat16, device="cuda")
    bt = torch.zeros(seqs, 2, dtype=torch.int32, device="cuda")
    return cache, q, bt, torch.ones(seqs, dtype=torch.int32, device="cuda")


def test_v2_merge_refuses_short_counts(ops):
    cache, q, bt, lens = tiny_decode_inputs(2, 4, 64)
    with pytest.raises(RuntimeError, match="at least sequences x query heads = 8"):
        ops.paged_decode(q.clone(), q, cache, bt, lens, 1.0, 32, 16, 0,
                         part_count=torch.zeros(7, dtype=torch.int32, device="cuda"))
    with pytest.raises(RuntimeError, match="part_count must be a 1-d Int"):
        ops.paged_decode(q.clone(), q, cache, bt, lens, 1.0, 32, 16, 0,
                         part_count=torch.zeros(8, dtype=torch.int64, device="cuda"))


def test_fresh_inputs_each_seed_differ(ops):
    """Guard against a kernel that ignores its inputs: two seeds give different outputs."""
    a, _ = run_decode(ops, torch.float32, 64, 16, 4, 0, seed=1)
    b, _ = run_decode(ops, torch.float32, 64, 16, 4, 0, seed=2)
    assert rel_error(a, b) > 0.1


def test_bad_head_size_is_refused(ops):
    cache, q, bt, lens = tiny_decode_inputs(1, 2, 96)
    with pytest.raises(RuntimeError, match="head size 96"):
        ops.paged_decode(q.clone(), q, cache, bt, lens, 1.0, 1, 0, 0)


def run_decode_and_cache(ops, dtype, head, group, partition, window=0, pad=(), seed=0, graph=False):
    """paged_decode_and_cache on sequences whose newest token is not in the cache yet, next to
    the two-launch path it replaces (reshape_and_cache, then paged_decode) on a copy of the
    same cache. Rows in ``pad`` are padding (slot -1: nothing written, like a graph bucket's
    padding rows). Returns (fused out, two-launch out, fused cache, two-launch cache, ref)."""
    gen = torch.Generator().manual_seed(seed)
    hkv, bs = 2, 16
    lens = [1, 15, 16, 17, 100, 513, 1100]
    cache = poisoned_cache(sum(-(-n // bs) for n in lens) + 7, bs, hkv, head, dtype)
    paged = scatter_sequences(cache, lens, gen)
    last = [n - 1 for n in lens]
    newest = torch.stack([slots_for(paged.block_tables[i], p, 1, bs)[0] for i, p in enumerate(last)])
    blocks, offs = (newest // bs).cuda(), (newest % bs).cuda()
    cache[blocks, :, :, offs, :] = float("nan")  # the newest token is not in the cache yet
    slots = newest.clone()
    slots[list(pad)] = -1
    key = torch.stack([k[-1] for k in paged.keys]).cuda()  # [seqs, hkv, head]
    value = torch.stack([v[-1] for v in paged.values]).cuda()
    two = cache.clone()
    query = torch.randn(len(lens), hkv * group, head, generator=gen).to(dtype).cuda()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale, slots = head**-0.5, slots.cuda()
    out = torch.full_like(query, float("nan"))
    fused = lambda: ops.paged_decode_and_cache(out, query, key, value, slots, cache, paged.block_tables,  # noqa: E731
                                               seq_lens, scale, max(lens), partition, window)
    if graph:  # captured with its programmatic edge, replayed on fresh poison
        fused()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fused()
        out.fill_(float("nan"))
        cache[blocks, :, :, offs, :] = float("nan")
        g.replay()
    else:
        fused()
    want = torch.full_like(query, float("nan"))
    ops.reshape_and_cache(key, value, two, slots)
    ops.paged_decode(want, query, two, paged.block_tables, seq_lens, scale, max(lens), partition, window)
    torch.cuda.synchronize()
    ref = reference_attention(query.cpu(), paged.keys, paged.values, [1] * len(lens), scale, window or None)
    return out.cpu(), want.cpu(), cache, two, ref


@pytest.mark.parametrize("dtype,head", [(torch.bfloat16, 128), (torch.float16, 64),
                                        (torch.float32, 128), (torch.bfloat16, 256)])
@pytest.mark.parametrize("group", [1, 4, 16])  # 16: two CTAs (tiles of 8 heads) store each row
@pytest.mark.parametrize("partition", [0, 32, 512], ids=["v1", "v2p32", "v2p512"])
def test_decode_and_cache_equals_write_then_decode(ops, dtype, head, group, partition):
    """The fused op stores each sequence's newest key/value where reshape_and_cache does (the
    whole cache, poison included, ends up equal) and computes the same output bit for bit."""
    out, want, cache, two, ref = run_decode_and_cache(ops, dtype, head, group, partition, seed=group)
    assert torch.isfinite(out).all(), "the newest token was not in the cache when it was read"
    assert torch.equal(out, want)
    assert torch.equal(cache.isnan(), two.isnan()) and torch.equal(cache.nan_to_num(), two.nan_to_num())
    assert rel_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("partition", [0, 64], ids=["v1", "v2"])
def test_decode_and_cache_skips_padding_rows_and_windows(ops, partition):
    """Padding rows (slot -1) write nothing, so they read their still-poisoned newest slot
    exactly as the two-launch path does; the sliding window changes nothing about the write."""
    out, want, cache, two, _ = run_decode_and_cache(ops, torch.float32, 64, 4, partition, window=24,
                                                    pad=(2, 5), seed=11)
    assert torch.equal(cache.isnan(), two.isnan()) and torch.equal(cache.nan_to_num(), two.nan_to_num())
    real = [i for i in range(out.shape[0]) if i not in (2, 5)]
    assert torch.isfinite(out[real]).all() and torch.equal(out[real], want[real])
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())


def test_decode_and_cache_in_a_cuda_graph(ops):
    """Captured (the launch carries a programmatic dependency on the previous kernel) and
    replayed after the cache slots and the output are poisoned again."""
    out, want, cache, two, _ = run_decode_and_cache(ops, torch.bfloat16, 128, 4, 256, seed=21, graph=True)
    assert torch.equal(out, want)
    assert torch.equal(cache.isnan(), two.isnan()) and torch.equal(cache.nan_to_num(), two.nan_to_num())


def test_decode_and_cache_refuses_an_fp8_cache_and_copied_metadata(ops):
    cache = torch.zeros(4, 2, 2, 16, 64, dtype=torch.float8_e4m3fn, device="cuda")
    q = torch.randn(1, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 64, device="cuda", dtype=torch.bfloat16)
    bt = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    lens = torch.ones(1, dtype=torch.int32, device="cuda")
    slots = torch.zeros(1, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match="fp8 caches"):
        ops.paged_decode_and_cache(q.clone(), q, k, k, slots, cache, bt, lens, 1.0, 1, 0, 0)
    cache = torch.zeros(4, 2, 2, 16, 64, dtype=torch.bfloat16, device="cuda")
    q, k = q.expand(2, -1, -1).contiguous(), k.expand(2, -1, -1).contiguous()
    strided = torch.ones(4, dtype=torch.int32, device="cuda")[::2]  # two entries, stride 2
    with pytest.raises(RuntimeError, match="must be contiguous"):
        ops.paged_decode_and_cache(q.clone(), q, k, k, torch.zeros(2, dtype=torch.int64, device="cuda"),
                                   cache, bt.expand(2, -1).contiguous(), strided, 1.0, 1, 0, 0)
