"""CUDA graphs of decode steps: one graph per batch-size bucket, all captured at start-up.

A decode-only step of ``n`` sequences runs as the graph of the smallest bucket ``B >= n``
(buckets: 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs; padding a step to a
multiple of 8 adds at most 7 rows, cheap next to the weight reads a decode step is made of).
The graph reads its inputs from static buffers; rows ``n..B-1`` are padding: slot -1 (their
keys and values are never written), context length 1 over block 0 (the reserved null block,
so attention reads a real block and stays finite), token 0 at position 0.

The decode kernel's v1/v2 choice and its partition count depend on the batch size and the
longest context (see ``choose_decode_partition``); a graph freezes both. Each bucket is
captured with ``max_seq_len = max_model_len``, so its plan (and v2's scratch size) is right
for every context the engine can reach: partitions past a sequence's end exit at once.

The model runner captures every bucket when it allocates the KV cache (:meth:`capture_all`:
a capture while serving stalls every running request for its 40-120 ms on an 8B model). A
bucket not captured yet (a runner built directly, as the tests do) is captured on first use:
that step runs the model once eagerly (warm-up, which also computes its real result into the
cache), then captures and replays. All graphs share one memory pool; they never run
concurrently and each keeps only its output alive.

Steps with prefills of up to ``spec.max_mixed_tokens`` tokens replay piecewise, around
eager attention calls (platforms/cuda/piecewise.py), when the runner passed the model's
attention sites.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from core.attention import AttentionMetadata
from core.platform import DecodeGraphRunner, DecodeGraphSpec, ModelForward
from platforms.cuda.piecewise import PiecewiseGraphs

logger = logging.getLogger(__name__)

BUCKET_STEP = 8
"""Granularity of the buckets above 8 rows."""


def decode_buckets(max_batch_size: int) -> tuple[int, ...]:
    """Batch sizes that get a graph: 1, 2, 4, then multiples of 8; the last covers
    ``max_batch_size``."""
    if max_batch_size < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_batch_size}")
    sizes = [1, 2, 4, *range(BUCKET_STEP, max_batch_size + BUCKET_STEP, BUCKET_STEP)]
    last = next(b for b in sizes if b >= max_batch_size)
    return tuple(b for b in sizes if b <= last)


def bucket_for(num_seqs: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket holding ``num_seqs`` rows."""
    i = bisect.bisect_left(buckets, num_seqs)
    if i == len(buckets) or num_seqs < 1:
        raise ValueError(f"a decode batch of {num_seqs} has no graph bucket (buckets {buckets})")
    return buckets[i]


class StaticDecodeInputs:
    """The buffers captured graphs read: every input of a decode step, ``max_rows`` rows.

    :meth:`load` writes a step's rows and padding in place (addresses never change);
    :meth:`metadata` gives the metadata a graph of ``rows`` rows is captured with.
    """

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device | str):
        i32, i64 = torch.int32, torch.int64
        self.max_rows, self.max_blocks = max_rows, max_blocks
        self.input_ids = torch.zeros(max_rows, dtype=i64, device=device)
        self.positions = torch.zeros(max_rows, dtype=i64, device=device)
        self.slot_mapping = torch.full((max_rows,), -1, dtype=i64, device=device)
        self.seq_lens = torch.ones(max_rows, dtype=i32, device=device)
        self.context_lens = torch.zeros(max_rows, dtype=i32, device=device)
        self.query_start_loc = torch.arange(max_rows + 1, dtype=i32, device=device)
        self.block_tables = torch.zeros((max_rows, max_blocks), dtype=i32, device=device)

    def metadata(self, rows: int, max_seq_len: int) -> AttentionMetadata:
        """Decode metadata over the first ``rows`` rows (views of the buffers)."""
        return AttentionMetadata(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decode_tokens=rows,
            slot_mapping=self.slot_mapping[:rows],
            seq_lens=self.seq_lens[:rows],
            context_lens=self.context_lens[:rows],
            query_start_loc=self.query_start_loc[: rows + 1],
            block_tables=self.block_tables[:rows],
            max_query_len=1,
            max_seq_len=max_seq_len,
        )

    def load(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, rows: int
    ) -> None:
        """Rows ``[0, n)`` from a decode step of n sequences, ``[n, rows)`` padding."""
        n = md.num_decode_tokens
        width = md.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(md.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(md.seq_lens, non_blocking=True)
        self.context_lens[:n].copy_(md.context_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(md.block_tables, non_blocking=True)
        self.pad(n, rows)

    def pad(self, start: int, stop: int) -> None:
        """Make rows ``[start, stop)`` padding rows."""
        if start >= stop:
            return
        self.slot_mapping[start:stop].fill_(-1)
        self.seq_lens[start:stop].fill_(1)
        self.context_lens[start:stop].fill_(0)
        self.block_tables[start:stop, 0].fill_(0)


class CudaDecodeGraphs(DecodeGraphRunner):
    """Decode steps of one model over its KV caches, replayed from CUDA graphs."""

    def __init__(self, model: ModelForward, kv_caches: list[torch.Tensor], spec: DecodeGraphSpec):
        self._model = model
        self._caches = kv_caches
        self._max_seq_len = spec.max_model_len
        self.buckets = decode_buckets(spec.max_batch_size)
        device = kv_caches[0].device
        max_blocks = -(-spec.max_model_len // spec.block_size)
        self._inputs = StaticDecodeInputs(self.buckets[-1], max_blocks, device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.capture_seconds = 0.0
        """Total time spent capturing decode graphs (warm-up runs included)."""
        self.mixed: PiecewiseGraphs | None = None
        """Steps with prefills, replayed piecewise; None without attention sites."""
        if spec.attention_sites and spec.max_mixed_tokens > 0:
            self.mixed = PiecewiseGraphs(model, kv_caches, spec.attention_sites,
                                         spec.max_mixed_tokens)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        if metadata.num_prefills:
            return self.mixed is not None and self.mixed.can_run(metadata)
        return (
            0 < metadata.num_decode_tokens <= self.buckets[-1]
            and metadata.block_tables.shape[1] <= self._inputs.max_blocks
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        if metadata.num_prefills:
            return self.mixed.run(input_ids, positions, metadata)
        n = metadata.num_decode_tokens
        rows = bucket_for(n, self.buckets)
        self._inputs.load(input_ids, positions, metadata, rows)
        entry = self._graphs.get(rows) or self._capture(rows)
        entry[0].replay()
        return entry[1][:n]

    @torch.inference_mode()
    def capture_all(self) -> float:
        t0 = time.perf_counter()
        for rows in reversed(self.buckets):  # largest first: later ones fit in its memory
            if rows not in self._graphs:
                self._inputs.pad(0, rows)
                self._capture(rows)
        return time.perf_counter() - t0

    def _capture(self, rows: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        t0 = time.perf_counter()
        ids, pos = self._inputs.input_ids[:rows], self._inputs.positions[:rows]
        md = self._inputs.metadata(rows, self._max_seq_len)
        # Warm-up outside the capture, on a side stream as torch requires: first-use setup
        # (kernel loading, library handles and workspaces) must not happen while capturing.
        # It computes the same step the graph will replay (writes the same cache slots).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._model(ids, pos, self._caches, md)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._model(ids, pos, self._caches, md)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[rows] = (graph, out)
        took = time.perf_counter() - t0
        self.capture_seconds += took
        logger.info("captured the decode graph for batch size %d in %.0f ms", rows, took * 1e3)
        return graph, out
