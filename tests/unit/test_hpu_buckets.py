"""The HPU bucket policy, and that the HPU attention really runs on bucketed shapes."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from core.batch_shape import BucketedBatchShaper
from core.conformance.harness import PagedCase, make_spec, seeded
from platforms.hpu.buckets import BucketPolicy, bucket, bucket_values
from platforms.hpu.platform import HpuPlatform


@pytest.mark.parametrize(
    "n, step, expected",
    [
        (1, 8, 1), (2, 8, 2), (3, 8, 4), (5, 8, 8), (8, 8, 8), (9, 8, 16), (16, 8, 16),
        (17, 8, 24), (100, 32, 128), (33, 32, 64), (20, 24, 24), (25, 24, 48), (7, 1, 7),
    ],
)
def test_bucket_examples(n: int, step: int, expected: int) -> None:
    assert bucket(n, step) == expected


def test_bucket_values_example() -> None:
    assert bucket_values(29, 8) == (1, 2, 4, 8, 16, 24, 32)
    assert bucket_values(5, 8) == (1, 2, 4, 8)


@pytest.mark.parametrize("n, step", [(0, 8), (-3, 8), (4, 0)])
def test_bucket_refuses_nonsense(n: int, step: int) -> None:
    with pytest.raises(ValueError, match=f"n={n}, step={step}"):
        bucket(n, step)


@given(st.integers(1, 5000), st.integers(1, 300))
def test_bucket_properties(n: int, step: int) -> None:
    b = bucket(n, step)
    assert b >= n
    assert bucket(b, step) == b  # a bucket is its own bucket
    assert bucket(n + 1, step) >= b  # monotone
    if n > step:
        assert b % step == 0 and b - n < step  # linear tail wastes less than one step
    else:
        assert b <= step and b < 2 * n  # power-of-two head wastes less than half


@given(st.integers(1, 3000), st.integers(1, 200))
def test_bucket_values_enumerate_every_bucket_and_stay_few(max_n: int, step: int) -> None:
    values = bucket_values(max_n, step)
    assert set(values) == {bucket(n, step) for n in range(1, max_n + 1)}
    assert len(values) <= math.ceil(math.log2(step)) + 1 + math.ceil(max_n / step)


# ---- the backend runs on bucketed shapes -----------------------------------------------------


class _BmmShapes(TorchDispatchMode):
    """Records the shapes of the backend's batched matmuls (what an HPU graph is compiled
    for); float64 ones belong to the reference and are left out."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        matmul = func in (torch.ops.aten.bmm.default, torch.ops.aten.matmul.default)
        if matmul and args[0].dtype != torch.float64:
            # As (batch, rows, cols): inference mode dispatches 4-D matmul undecomposed.
            a, b = args[0].shape, args[1].shape
            self.shapes.add(((math.prod(a[:-2]), *a[-2:]), (math.prod(b[:-2]), *b[-2:])))
        return func(*args, **(kwargs or {}))


def test_decode_and_prefill_shapes_are_bucketed() -> None:
    """Many batch sizes and lengths, few shapes: every attention matmul has a bucketed
    number of sequences, query length and context blocks, and outputs stay correct."""
    policy = BucketPolicy(seq_step=4, query_step=16, block_step=4)
    spec = make_spec(torch.float32, 16, "gqa")
    kvh, group = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads
    case = PagedCase(HpuPlatform(), spec, 400, seeded("hpu-buckets"))
    case.shaper = BucketedBatchShaper(policy, spec.block_size)  # the runner's, smaller steps
    rng = random.Random(0)
    recorder = _BmmShapes()
    steps = 0
    with recorder:
        for batch in range(1, 11):
            seqs = [case.new_seq(rng.randint(2, 120)) for _ in range(batch)]
            prefill = [(s, rng.randint(1, len(s.keys) - 1)) for s in seqs]
            results = [case.step(prefill[: batch // 2 + 1], label="prefill")]
            for s, n in prefill[batch // 2 + 1 :]:
                case.write(s, n)
            results.append(case.step([], seqs, label="decode"))
            steps += 2
            for r in results:
                torch.testing.assert_close(r.output, r.expected, atol=2e-5, rtol=2e-5)
    seq_buckets = set(bucket_values(10, policy.seq_step))
    query_buckets = set(bucket_values(120, policy.query_step))
    block_buckets = set(bucket_values(8, policy.block_step))
    scores = [(a, b) for a, b in recorder.shapes if b[1] == spec.head_size]  # q @ k^T
    assert scores
    for (sk, gq, _), (_, _, length) in scores:
        assert sk % kvh == 0 and sk // kvh in seq_buckets, (sk, seq_buckets)
        assert gq % group == 0 and gq // group in query_buckets | {1}, (gq, query_buckets)
        assert length % 16 == 0 and length // 16 in block_buckets, (length, block_buckets)
    assert len(scores) < steps  # shapes repeat across steps: that is the point of buckets
