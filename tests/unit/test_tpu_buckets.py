"""The TPU platform's static-shape buckets, through the batch shaper (no torch-xla needed)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.batch_shape import BucketedBatchShaper, HostStep
from platforms.tpu.buckets import TpuBuckets, bucket_count, next_bucket

BUCKETS = TpuBuckets()
SHAPER = BucketedBatchShaper(BUCKETS, 16)


@pytest.mark.parametrize(
    "n,minimum,want",
    [(1, 1, 1), (2, 1, 2), (3, 1, 4), (5, 8, 8), (8, 8, 8), (9, 8, 16), (17, 16, 32), (64, 1, 64)],
)
def test_next_bucket_values(n, minimum, want):
    assert next_bucket(n, minimum) == want


def test_next_bucket_refuses_empty_dimension():
    with pytest.raises(ValueError, match="cannot bucket 0"):
        next_bucket(0, 8)


@given(st.integers(1, 5000), st.sampled_from([1, 2, 8, 16]))
def test_next_bucket_is_smallest_covering_power_of_two(n, minimum):
    b = next_bucket(n, minimum)
    assert b >= n and b >= minimum and b & (b - 1) == 0
    assert b // 2 < max(n, minimum)  # the next smaller power of two would not fit


@pytest.mark.parametrize("limit", [1, 7, 8, 9, 100, 256, 2048])
@pytest.mark.parametrize("minimum", [1, 8, 16])
def test_bucket_count_matches_enumeration(limit, minimum):
    distinct = {next_bucket(n, minimum) for n in range(1, limit + 1)}
    assert bucket_count(limit, minimum) == len(distinct)


def _decode_step(seq_lens, tables, block_size=16) -> HostStep:
    n = len(seq_lens)
    rows = np.arange(n, dtype=np.int64)
    ctx = np.asarray(seq_lens, dtype=np.int64) - 1
    table = np.asarray(tables, dtype=np.int32)
    slots = table[rows, ctx // block_size].astype(np.int64) * block_size + ctx % block_size
    return HostStep(rows, ctx, slots, rows, np.ones(n, np.int64), ctx, table, 0)


def test_steady_decode_keeps_its_shape_until_a_power_of_two_is_crossed():
    # 3 sequences decoding from 35/40/45 tokens: 3 blocks of 16 -> bucket 4 until 64 tokens
    tables = [list(range(1, 9))] * 3
    shapes = set()
    for step in range(20):  # longest reaches 64 tokens = exactly 4 blocks
        shaped = SHAPER.shape(_decode_step([35 + step, 40 + step, 45 + step], tables))
        shapes.add((len(shaped.input_ids), len(shaped.query_lens), shaped.block_tables.shape[1]))
    assert shapes == {(16, 8, 4)}
    crossed = SHAPER.shape(_decode_step([55, 60, 65], tables))  # 65 tokens: a 5th block
    assert crossed.block_tables.shape == (8, 8)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_steps_stay_within_the_shape_bound(data):
    max_seqs, max_tokens, max_blocks, bs = 64, 512, 32, 16
    seen = set()
    for _ in range(8):
        n = data.draw(st.integers(1, max_seqs))
        p = data.draw(st.integers(0, n))
        qlens = [data.draw(st.integers(1, max(1, (max_tokens - n) // n))) for _ in range(p)]
        qlens += [1] * (n - p)
        ctxs = [data.draw(st.integers(0, max_blocks * bs - q)) for q in qlens]
        tables = np.ones((n, max_blocks), dtype=np.int32)
        rows = sum(qlens)
        zeros = np.zeros(rows, dtype=np.int64)
        step = HostStep(zeros, zeros, zeros, zeros, np.asarray(qlens), np.asarray(ctxs), tables, p)
        s = SHAPER.shape(step)
        seen.add((len(s.input_ids), s.num_prefills, s.max_query_len, len(s.query_lens) - s.num_prefills, s.block_tables.shape[1]))
    assert len(seen) <= BUCKETS.max_shapes(max_tokens, max_seqs, max_tokens, max_blocks)


def test_max_shapes_counts_the_bucket_grid():
    # rows 16..512: 6 buckets; seqs 8..64: 4 (+ none); query 16..512: 6; blocks 1..32: 6
    assert BUCKETS.max_shapes(512, 64, 512, 32) == 6 * 5 * 6 * 5 * 6


def test_buckets_are_the_documented_powers_of_two():
    assert [BUCKETS.pad_tokens(n) for n in (1, 16, 17, 300)] == [16, 16, 32, 512]
    assert [BUCKETS.pad_seqs(n) for n in (1, 8, 9)] == [8, 8, 16]
    assert [BUCKETS.pad_query(n) for n in (1, 17)] == [16, 32]
    assert [BUCKETS.pad_blocks(n) for n in (1, 3, 5)] == [1, 4, 8]
