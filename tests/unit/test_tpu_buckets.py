"""The TPU platform's static-shape bucket policy (pure Python; no torch-xla needed)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from platforms.tpu.buckets import BucketPolicy, blocks_for, bucket_count, next_bucket

POLICY = BucketPolicy()


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


def _random_prefill(rng: random.Random, block_size: int, num_blocks: int = 500):
    n = rng.randint(1, 12)
    qlens = [rng.randint(1, 90) for _ in range(n)]
    ctxs = [rng.choice([0, rng.randint(1, 200)]) for _ in range(n)]
    width = max(blocks_for(q + c, block_size) for q, c in zip(qlens, ctxs)) + 1
    tables = [[rng.randrange(1, num_blocks) for _ in range(width)] for _ in range(n)]
    return qlens, ctxs, tables


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_plan_places_every_row(seed, block_size):
    rng = random.Random(seed)
    qlens, ctxs, tables = _random_prefill(rng, block_size)
    plan = POLICY.plan_prefill(qlens, ctxs, tables, block_size)
    s, r, b = plan.num_seqs, plan.query_len, plan.num_blocks
    assert s == next_bucket(len(qlens), 8) and r == next_bucket(max(qlens), 16)
    assert len(plan.gather_rows) == len(plan.positions) == s * r
    assert len(plan.scatter_rows) == sum(qlens)
    flat = 0
    for i, (q, c) in enumerate(zip(qlens, ctxs)):
        for j in range(q):
            padded = plan.scatter_rows[flat]
            assert divmod(padded, r) == (i, j)
            assert plan.gather_rows[padded] == flat  # round trip: row -> padded -> row
            assert plan.positions[padded] == c + j
            flat += 1
    real = set(plan.scatter_rows)
    assert all(plan.positions[x] == 0 for x in range(s * r) if x not in real)
    _check_table(plan.block_table, tables, [q + c for q, c in zip(qlens, ctxs)], s, b, block_size)


def _check_table(table, tables, lengths, num_seqs, num_blocks, block_size):
    assert len(table) == num_seqs and all(len(row) == num_blocks for row in table)
    assert num_blocks == next_bucket(max(blocks_for(n, block_size) for n in lengths), 1)
    for row, src, n in zip(table, tables, lengths):
        used = blocks_for(n, block_size)
        assert list(row[:used]) == src[:used] and set(row[used:]) <= {0}
    assert all(set(row) == {0} for row in table[len(tables) :])


@pytest.mark.parametrize("seed", range(20))
def test_decode_plan_pads_with_inert_rows(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    seq_lens = [rng.randint(1, 300) for _ in range(n)]
    tables = [[rng.randrange(1, 99) for _ in range(blocks_for(300, 16))] for _ in range(n)]
    plan = POLICY.plan_decode(seq_lens, tables, 16)
    assert plan.num_seqs == next_bucket(n, 8)
    assert plan.gather_rows == tuple(range(n)) + (0,) * (plan.num_seqs - n)
    assert plan.lengths[:n] == tuple(seq_lens) and set(plan.lengths[n:]) <= {1}
    _check_table(plan.block_table, tables, seq_lens, plan.num_seqs, plan.num_blocks, 16)


def test_steady_decode_keeps_its_shape_until_a_power_of_two_is_crossed():
    # 3 sequences decoding from 35/40/45 tokens: 3 blocks of 16 -> bucket 4 until 64 tokens
    tables = [list(range(1, 9))] * 3
    shapes = set()
    for step in range(20):  # longest reaches 64 tokens = exactly 4 blocks
        plan = POLICY.plan_decode([35 + step, 40 + step, 45 + step], tables, 16)
        shapes.add((plan.num_seqs, plan.num_blocks))
    assert shapes == {(8, 4)}
    crossed = POLICY.plan_decode([55, 60, 65], tables, 16)  # 65 tokens need a 5th block
    assert (crossed.num_seqs, crossed.num_blocks) == (8, 8)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_steps_stay_within_the_shape_bound(data):
    max_seqs, max_tokens, max_blocks, bs = 64, 512, 32, 16
    seen = set()
    for _ in range(8):
        n = data.draw(st.integers(1, max_seqs))
        qlens = data.draw(st.lists(st.integers(1, max_tokens // n), min_size=n, max_size=n))
        ctxs = [data.draw(st.integers(0, max_blocks * bs - q)) for q in qlens]
        tables = [[1] * max_blocks] * n
        p = POLICY.plan_prefill(qlens, ctxs, tables, bs)
        d = POLICY.plan_decode([c + 1 for c in ctxs], tables, bs)
        seen.add(("prefill", p.num_seqs, p.query_len, p.num_blocks))
        seen.add(("decode", d.num_seqs, d.num_blocks))
    assert len(seen) <= POLICY.max_shapes(max_seqs, max_tokens, max_blocks)


def test_max_shapes_counts_the_bucket_grid():
    # seqs 8..64: 4 buckets; query 16..512: 6; blocks 1..32: 6
    assert POLICY.max_shapes(64, 512, 32) == 4 * 6 * 6 + 4 * 6
