"""A float32 embedding table released for its exact int8 codes (QuantizedLinear.prepare_embedding).

Reference: the dense table itself, kept by the test. Lookups must equal ``F.embedding`` over it
bit for bit on random ids, a tied LM head must give the logits it gave before the release (its
int8 codes at up to GROUPED_MAX_ROWS rows, ``F.linear`` over the dense table above), and a
table its codes do not reproduce must stay dense.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from core.models.layers import VocabParallelEmbedding, prepare_weights
from platforms.cpu.kernels import kernels_or_none
from platforms.cpu.linear import (
    GROUPED_MAX_ROWS,
    group_int8,
    grouped_matmul,
    linear_method,
    released_codes,
)
from platforms.cpu.ops import CpuOps, HeadPolicy
from tests.helpers import cpu_context

pytestmark = pytest.mark.skipif(kernels_or_none() is None, reason="the CPU kernels do not build here")


def q8_grid_table(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A table on GGUF Q8_0's grid: per 32 columns a float16 scale times codes -127..127, one
    code of each group at +-127 (Q8_0's scale is the group's max |w| / 127)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (rows, cols // 32, 32), generator=g)
    top = torch.randint(0, 32, (rows, cols // 32, 1), generator=g)
    sign = torch.where(torch.rand(rows, cols // 32, 1, generator=g) < 0.5, -1, 1)
    codes.scatter_(2, top, 127 * sign)
    scales = (torch.rand(rows, cols // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    return (codes.float() * scales).view(rows, cols)


def embedding(table: torch.Tensor, fmt: str = "int4") -> VocabParallelEmbedding:
    ctx = dataclasses.replace(cpu_context(), weight_format=fmt, linear_method=linear_method(fmt))
    emb = VocabParallelEmbedding(table.shape[0], table.shape[1], ctx)
    emb.load_weight("weight", table)
    with torch.no_grad():
        prepare_weights(emb)
    return emb


def test_released_lookups_equal_the_dense_lookup() -> None:
    table = q8_grid_table(300, 96, seed=1)
    emb = embedding(table)
    assert released_codes(emb.weight) is not None and emb.weight.numel() == 0  # no dense copy
    g = torch.Generator().manual_seed(2)
    for shape in ((1,), (7,), (3, 5)):
        ids = torch.randint(0, 300, shape, generator=g)
        got = emb(ids)
        assert got.shape == (*shape, 96)
        assert torch.equal(got, F.embedding(ids, table))
    ids = torch.tensor([0, 299, 299, 17])  # first, last and repeated rows
    assert torch.equal(emb(ids), F.embedding(ids, table))


@pytest.mark.parametrize("fmt", ["dense", "int4"])
def test_tables_off_the_grid_or_dense_formats_stay_dense(fmt: str) -> None:
    table = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)) if fmt == "int4" else q8_grid_table(64, 64, 3)
    emb = embedding(table, fmt)
    assert released_codes(emb.weight) is None and torch.equal(emb.weight, table)
    ids = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(4))
    assert torch.equal(emb(ids), F.embedding(ids, table))


def test_tied_lm_head_over_the_released_codes_gives_the_same_logits() -> None:
    table = q8_grid_table(200, 64, seed=5)
    emb = embedding(table)
    ops = CpuOps(kernels_or_none(), HeadPolicy(quantized=True))
    g = torch.Generator().manual_seed(6)
    for rows in (1, 5, GROUPED_MAX_ROWS):  # quant_linear over the codes, as before the release
        hidden = torch.randn(rows, 64, generator=g)
        got = ops.lm_head(hidden, emb.weight)
        assert torch.equal(got, ops.lm_head(hidden, table))  # the dense table's codes (before)
        assert torch.equal(got, grouped_matmul(kernels_or_none(), hidden, group_int8(table)))
    hidden = torch.randn(GROUPED_MAX_ROWS + 9, 64, generator=g)  # above: the dense product
    assert torch.equal(ops.lm_head(hidden, emb.weight), F.linear(hidden, table))
