"""platforms/cpu/row_buckets.py: bf16 GEMMs see a bounded set of row counts and the same results.

The reference for the products is a float64 matmul of the same bf16 values (and F.linear, the
call it replaces); the bound on shapes is checked over every row count a server could send.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from platforms.cpu.row_buckets import EXACT_ROWS, MAX_PIECE, bucketed_linear, row_pieces


def test_every_row_count_maps_to_few_shapes_with_little_padding():
    shapes: set[int] = set()
    for rows in range(1, 20_000):
        pieces = row_pieces(rows)
        shapes.update(pieces)
        padding = sum(pieces) - rows
        assert 0 <= padding < pieces[-1], (rows, pieces)
        assert all(p == MAX_PIECE for p in pieces[:-1]) and pieces[-1] <= MAX_PIECE, (rows, pieces)
        last_rows = pieces[-1] - padding
        # At most 15 rows or 1/8 of the last piece's real rows are padding.
        assert padding <= max(EXACT_ROWS - 1, last_rows // 8), (rows, pieces)
    assert set(range(1, EXACT_ROWS + 1)) <= shapes
    assert len(shapes) == 39, sorted(shapes)


@pytest.mark.parametrize("rows", [1, 16, 17, 100, 128, 300, 512, 777, 1100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bucketed_linear_matches_a_float64_reference_and_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    w = torch.randn(200, 96, generator=g).bfloat16()
    b = torch.randn(200, generator=g).bfloat16() if with_bias else None
    y = bucketed_linear(x, w, b)
    ref = x.double() @ w.double().t() + (b.double() if with_bias else 0)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 200)
    # bf16 output: one rounding of a value up to ~40 in magnitude (plus bf16 accumulation in
    # oneDNN's bias add).
    torch.testing.assert_close(y.double(), ref, atol=0.25, rtol=1e-2)
    torch.testing.assert_close(y, F.linear(x, w, b))


def test_bucketed_linear_keeps_leading_dims_and_takes_strided_rows():
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(3, 50, 128, generator=g).bfloat16()
    x = wide[..., :64]  # rows with a stride of 128: not contiguous
    w = torch.randn(40, 64, generator=g).bfloat16()
    y = bucketed_linear(x, w, None)
    assert y.shape == (3, 50, 40)
    torch.testing.assert_close(y, F.linear(x, w))


def test_other_dtypes_pass_through_unchanged():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(300, 64, generator=g), torch.randn(32, 64, generator=g)
    assert torch.equal(bucketed_linear(x, w, None), F.linear(x, w))
