"""A bounded set of row counts for oneDNN's bf16 GEMMs, so its per-shape caches stay bounded.

torch multiplies bf16 matrices on an AVX-512 CPU through oneDNN, and oneDNN keeps every GEMM
shape it has seen in two caches (its primitive cache and ideep's LRU of computations, 1,024
entries each by default), about 0.55 MiB per (weight shape, rows) pair whatever the matrix
size (measured, docs/benchmarks/soak.md). A server sees every prompt length and every mixed
batch size up to --max-num-batched-tokens, so each new row count cost ~1.2 MiB for the
embedded SmolLM2 (4 weight shapes), up to ~1.2 GiB before the caches fill. A new shape also
costs ~20 ms of primitive creation per weight shape.

:func:`bucketed_linear` therefore never shows oneDNN an arbitrary row count: up to
:data:`EXACT_ROWS` rows (decode batches) go as they are; more rows are cut into pieces of
:data:`MAX_PIECE` rows and one last piece padded up to a multiple of 16 rows (32 above 256):
1,300 rows -> 512 + 512 + 288 (276 + 12 padding). That is 16 + 23 row counts per weight shape
in all (~86 MiB of cache for SmolLM2's four), seen in the first minutes of serving. Padding,
not more pieces: one more small GEMM re-reads the weight (~20 padded rows' worth of time on
SmolLM2's MLP), so padding of at most 15 rows or 1/8 of the last piece is the cheaper side.
Each row's result is what a GEMM of its piece's size gives (bit-identical to the unpadded
call in the tests). float32 and float16 go to MKL / torch's own GEMMs, which keep no
per-shape state (measured flat): they pass through unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EXACT_ROWS = 16
"""Row counts up to this (decode batches) go to oneDNN unchanged."""
MAX_PIECE = 512
"""The largest piece (a power of two): longer inputs are cut into pieces of this many rows."""

_BUCKETED_DTYPES = (torch.bfloat16,)
"""Dtypes torch's CPU GEMM sends to oneDNN (the ones whose caches grow per shape)."""


def row_pieces(rows: int) -> list[int]:
    """The row counts the GEMM of ``rows`` rows is cut into (the last one may hold padding).

    :param rows: activation rows of one call (> 0).
    :return: ``[rows]`` when ``rows`` <= :data:`EXACT_ROWS`; else :data:`MAX_PIECE`-row
        pieces and one last piece of the remaining rows rounded up to a multiple of 16 (up
        to 256 rows) or 32 (above): at most 15 rows, or 1/8 of them, padding.
    """
    if rows <= EXACT_ROWS:
        return [rows]
    pieces = [MAX_PIECE] * (rows // MAX_PIECE)
    rest = rows % MAX_PIECE
    if rest:
        grain = 16 if rest <= 256 else 32
        pieces.append(-(-rest // grain) * grain)
    return pieces


def bucketed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, with oneDNN only ever seeing :func:`row_pieces` shapes."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if x.dtype not in _BUCKETED_DTYPES or rows <= EXACT_ROWS:
        return F.linear(x, weight, bias)
    pieces = row_pieces(rows)
    if pieces == [rows]:  # already a bucket (e.g. a decode batch of 32): one plain call
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, k).contiguous()
    out = torch.empty((rows, weight.shape[0]), dtype=x.dtype)
    start = 0
    for size in pieces:
        stop = min(start + size, rows)
        if stop - start == size:
            _mm(flat[start:stop], weight, bias, out[start:stop])
        else:  # the last piece: padded with zero rows (finite values; their results dropped)
            src = torch.zeros((size, k), dtype=x.dtype)
            src[: stop - start] = flat[start:stop]
            dst = torch.empty((size, weight.shape[0]), dtype=x.dtype)
            _mm(src, weight, bias, dst)
            out[start:stop] = dst[: stop - start]
        start = stop
    return out.view(*x.shape[:-1], weight.shape[0])


def _mm(src: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dst: torch.Tensor) -> None:
    """dst = src @ weight^T (+ bias), written in place (dst: contiguous rows)."""
    if bias is None:
        torch.mm(src, weight.t(), out=dst)
    else:
        torch.addmm(bias, src, weight.t(), out=dst)
