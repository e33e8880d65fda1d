"""The batch shaper (core/batch_shape.py) and the metadata builder (core.attention):
random steps padded by each built-in bucket policy keep their real rows in place, pad
with inert rows only, and the gather indices a static-shape backend derives from the
shaped metadata find every real row again."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.attention import build_metadata
from core.batch_shape import (
    BucketedBatchShaper,
    HostStep,
    rows_of_groups,
    scatter_groups,
    shape_key,
)
from platforms.hpu.buckets import BucketPolicy
from platforms.tpu.buckets import TpuBuckets

BLOCK = 16
POLICIES = {"tpu": TpuBuckets(), "hpu": BucketPolicy(token_step=32, seq_step=4, query_step=16)}


@st.composite
def host_steps(draw) -> HostStep:
    """A step of prefills then decodes over random (non-contiguous) block tables."""
    p, d = draw(st.integers(0, 6)), draw(st.integers(0, 10))
    if p + d == 0:
        d = 1
    qlens = [draw(st.integers(1, 40)) for _ in range(p)] + [1] * d
    ctxs = [draw(st.integers(0, 100)) for _ in range(p + d)]
    width = max(-(-(c + q) // BLOCK) for c, q in zip(ctxs, qlens)) + draw(st.integers(0, 2))
    tables = np.asarray(
        [[draw(st.integers(1, 500)) for _ in range(width)] for _ in qlens], dtype=np.int32
    )
    md = build_metadata(qlens, ctxs, tables, BLOCK, num_prefills=p)
    rows = np.repeat(np.arange(p + d), qlens)
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(ctxs, qlens)])
    ids = np.asarray([draw(st.integers(-1, 999)) for _ in rows], dtype=np.int64)
    return HostStep(ids, positions, md.slot_mapping.numpy(), rows + 3, np.asarray(qlens),
                    np.asarray(ctxs), tables, p)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=60, deadline=None)
@given(step=host_steps())
def test_shaped_steps_keep_real_rows_and_pad_with_inert_ones(policy, step):
    buckets = POLICIES[policy]
    shaped = BucketedBatchShaper(buckets, BLOCK).shape(step)
    n, p = len(step.input_ids), step.num_prefills
    d = len(step.query_lens) - p
    sp, sd = (buckets.pad_seqs(p) if p else 0), (buckets.pad_seqs(d) if d else 0)
    assert shaped.num_prefills == sp and len(shaped.query_lens) == sp + sd
    rows = len(shaped.input_ids)
    assert rows == buckets.pad_tokens(int(step.query_lens[:p].sum()) + sd) >= n
    for name in ("input_ids", "positions", "slot_mapping", "token_rows"):
        assert np.array_equal(getattr(shaped, name)[:n], getattr(step, name)), name
    assert set(shaped.slot_mapping[n:]) <= {-1} and set(shaped.input_ids[n:]) <= {0}
    # real sequences in place within their groups; padding empty prefills, unit decodes
    q, c = shaped.query_lens, shaped.context_lens
    assert np.array_equal(q[:p], step.query_lens[:p]) and set(q[p:sp]) <= {0}
    assert np.array_equal(q[sp : sp + d], step.query_lens[p:]) and set(q[sp + d :]) <= {1}
    assert np.array_equal(c[:p], step.context_lens[:p]) and set(c[p:sp]) <= {0}
    assert np.array_equal(c[sp : sp + d], step.context_lens[p:]) and set(c[sp + d :]) <= {0}
    width = shaped.block_tables.shape[1]
    used = -(-(step.context_lens + step.query_lens) // BLOCK)
    assert width == buckets.pad_blocks(int(used.max()))
    real_rows = np.concatenate([np.arange(p), np.arange(sp, sp + d)]).astype(int)
    for src, dst in enumerate(real_rows):
        u = used[src]
        assert np.array_equal(shaped.block_tables[dst, :u], step.block_tables[src, :u])
    pad_seqs = sorted(set(range(sp + sd)) - set(real_rows.tolist()))
    assert not shaped.block_tables[pad_seqs].any()
    if p:
        assert shaped.max_query_len == buckets.pad_query(int(step.query_lens[:p].max()))
    else:
        assert shaped.max_query_len == 1


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=40, deadline=None)
@given(step=host_steps())
def test_group_rows_of_a_shaped_step_find_every_real_row(policy, step):
    """A backend's gathers over shaped metadata, then its scatter back, return each real row
    its own values: label every flat row by its index and follow it through."""
    shaped = BucketedBatchShaper(POLICIES[policy], BLOCK).shape(step)
    _, _, _, md = shaped.upload(torch.device("cpu"), BLOCK)
    num_rows = md.slot_mapping.shape[0]
    assert shape_key(md) == (num_rows, md.num_prefills, md.max_query_len,
                             md.num_decode_tokens, md.block_tables.shape[1])
    g = rows_of_groups(md, num_rows)
    labels = torch.arange(num_rows) * 10 + 7
    pre = labels[g.prefill_rows] if md.num_prefills else None
    dec = labels[g.decode_rows] if md.num_decode_tokens else None
    out = scatter_groups(g, md.num_prefills, pre, dec)
    n = len(step.input_ids)
    assert out.shape == (num_rows,) and torch.equal(out[:n], labels[:n])
    # the padded query positions of real prefill rows are their absolute positions
    if md.num_prefills:
        valid = g.prefill_valid
        got = g.prefill_positions[valid]
        want = torch.from_numpy(step.positions[: int(step.query_lens[: step.num_prefills].sum())])
        assert torch.equal(got, want)


def test_build_metadata_computes_slots_from_tables_and_pads_short_rows():
    md = build_metadata([3, 1], [2, 17], [[5, 9], [4, 8]], 16, num_prefills=1)
    assert md.slot_mapping.tolist() == [5 * 16 + 2, 5 * 16 + 3, 5 * 16 + 4, 8 * 16 + 1]
    assert md.query_start_loc.tolist() == [0, 3, 4] and md.seq_lens.tolist() == [5, 18]
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (1, 3, 1)
    assert (md.max_query_len, md.max_seq_len) == (3, 18)
    ragged = build_metadata([1, 1], [0, 20], [[3], [4, 6]], 16, num_prefills=0)
    assert ragged.block_tables.tolist() == [[3, 0], [4, 6]]
    assert ragged.seq_lens_host == (1, 21) and ragged.context_lens_host == (0, 20)


def test_build_metadata_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match="2 query lengths, 1 context lengths"):
        build_metadata([1, 2], [0], [[1], [2]], 16, num_prefills=1)
    with pytest.raises(ValueError, match="1 block tables for 2 sequences"):
        build_metadata([1, 2], [0, 0], [[1]], 16, num_prefills=1)


def test_a_bucket_smaller_than_its_size_is_refused():
    class Shrinking:
        def pad_tokens(self, n):
            return n

        def pad_seqs(self, n):
            return n

        def pad_query(self, n):
            return n

        def pad_blocks(self, n):
            return max(1, n - 1)

    md = build_metadata([1], [40], [[3, 4, 5]], BLOCK, num_prefills=0)
    step = HostStep(np.zeros(1, np.int64), np.full(1, 40), md.slot_mapping.numpy(),
                    np.zeros(1, np.int64), np.ones(1, np.int64), np.full(1, 40),
                    md.block_tables.numpy(), 0)
    with pytest.raises(ValueError, match=r"pad_blocks\(3\) returned 2: a bucket must be at least"):
        BucketedBatchShaper(Shrinking(), BLOCK).shape(step)
