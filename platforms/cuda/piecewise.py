"""CUDA graphs for steps with prefills: everything but attention replayed, piece by piece.

A step that mixes prefills (prompts of any lengths, chunks over cached context) with
decodes cannot be one graph: prompt attention loops over the prompts on the host. Everything
else in the forward (embedding, projections, rotary, norms, MLPs) depends only on the number
of tokens. So a step of ``t`` tokens runs at the smallest token bucket ``T >= t`` (16, 32,
64, ... up to ``max_tokens``) as ``L + 1`` graphs for an ``L``-layer model: graph 0 runs up
to the first attention call, graph ``i`` from attention ``i - 1`` to attention ``i``. Between
graphs the runner calls the real attention backend eagerly on the first ``t`` rows of the
query/key/value the previous graph left in its static buffers, with the step's own
metadata, and copies the result into the static buffer the next graph reads.

Padding rows ``t..T-1``: token 0 at position 0; they never reach attention (its output rows
there keep whatever a previous step left, always finite) and the caller drops them.

Capture is lazy, per bucket, at the first step that needs it: that step runs eagerly
(warm-up; its result is the step's answer), then the pieces are captured by running the model
once more with every :class:`core.attention_sites.AttentionSite` split: the site ends the
graph being captured, records its inputs and returns a static output buffer, and starts the
next graph. Should a capture fail, the step keeps its eager result, a warning names the
error, and steps with prefills run eagerly from then on (``disabled``). Memory: the static query/key/value/output tensors of every layer stay allocated
for each captured bucket, which is why ``max_tokens`` is small (a few hundred tokens: where a
step is launch-bound rather than compute-bound, the only place graphs pay).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field

import torch

from core.attention import AttentionMetadata
from core.attention_sites import AttentionSite
from core.platform import ModelForward

logger = logging.getLogger(__name__)

SMALLEST_BUCKET = 16


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """Powers of two from 16; the last one covers ``max_tokens``."""
    if max_tokens < 1:
        raise ValueError(f"max_mixed_tokens must be at least 1 for piecewise graphs, got {max_tokens}")
    sizes = [SMALLEST_BUCKET]
    while sizes[-1] < max_tokens:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


def _zeros(site, query, key, value, kv_cache, md) -> torch.Tensor:
    return torch.zeros_like(query)


@dataclass
class _Call:
    """One attention call between two graphs: its static inputs and output."""

    site: AttentionSite
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    out: torch.Tensor


@dataclass
class _Pieces:
    """The captured graphs of one token bucket."""

    graphs: list = field(default_factory=list)
    calls: list[_Call] = field(default_factory=list)
    output: torch.Tensor | None = None

    def replay(self, md: AttentionMetadata, t: int) -> torch.Tensor:
        self.graphs[0].replay()
        for call, graph in zip(self.calls, self.graphs[1:], strict=True):
            out = call.site.backend.forward(call.query[:t], call.key[:t], call.value[:t],
                                            call.kv_cache, md)
            call.out[:t].copy_(out)
            graph.replay()
        return self.output[:t]


class PiecewiseGraphs:
    """Steps with prefills of up to ``max_tokens`` tokens, replayed piecewise (see module)."""

    def __init__(self, model: ModelForward, kv_caches: list[torch.Tensor],
                 sites: tuple[AttentionSite, ...], max_tokens: int):
        if len(sites) != len(kv_caches):
            raise ValueError(
                f"piecewise graphs need one attention site per KV cache; got {len(sites)} "
                f"sites for {len(kv_caches)} caches"
            )
        self._model, self._caches, self._sites = model, kv_caches, sites
        self.buckets = token_buckets(max_tokens)
        device = kv_caches[0].device
        self._ids = torch.zeros(self.buckets[-1], dtype=torch.int64, device=device)
        self._pos = torch.zeros(self.buckets[-1], dtype=torch.int64, device=device)
        self._entries: dict[int, _Pieces] = {}
        self._pool = None
        self._capturing: _Pieces | None = None
        self.capture_seconds = 0.0
        self.replays = 0
        """Steps served from captured pieces (tests and logs)."""
        self.disabled: str | None = None
        """Why capture failed (steps with prefills then run eagerly); None while it works."""

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._entries))

    def can_run(self, md: AttentionMetadata) -> bool:
        return self.disabled is None and md.num_prefills > 0 and 0 < md.num_tokens <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata):
        t = md.num_tokens
        rows = self.buckets[bisect.bisect_left(self.buckets, t)]
        self._ids[:t].copy_(input_ids, non_blocking=True)
        self._pos[:t].copy_(positions, non_blocking=True)
        self._ids[t:rows].zero_()
        self._pos[t:rows].zero_()
        entry = self._entries.get(rows)
        if entry is not None:
            self.replays += 1
            return entry.replay(md, t)
        return self._capture(rows, md)

    @torch.inference_mode()
    def _capture(self, rows: int, md: AttentionMetadata) -> torch.Tensor:
        """Run this step eagerly (its result is returned), then capture bucket ``rows``."""
        t0, t = time.perf_counter(), md.num_tokens
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            hidden = self._model(self._ids[:t], self._pos[:t], self._caches, md)
            # A dry run at the bucket's size, attention replaced by zeros: first-use setup
            # of every kernel at these shapes must not happen while capturing.
            for site in self._sites:
                site.split = _zeros
            try:
                self._model(self._ids[:rows], self._pos[:rows], self._caches, md)
            finally:
                for site in self._sites:
                    site.split = None
        hidden.record_stream(torch.cuda.current_stream())  # made on the side stream
        pieces = _Pieces()
        self._capturing = pieces
        for site in self._sites:
            site.split = self._split
        try:
            with torch.cuda.stream(side):
                self._begin()
                pieces.output = self._model(self._ids[:rows], self._pos[:rows], self._caches, md)
                pieces.graphs[-1].capture_end()
            if len(pieces.calls) != len(self._sites):
                raise RuntimeError(
                    f"piecewise capture saw {len(pieces.calls)} attention calls for "
                    f"{len(self._sites)} layers; a model must call each layer's attention once"
                )
        except Exception as exc:  # noqa: BLE001 - the step's eager result stands
            self._abandon(pieces)
            self.disabled = f"{type(exc).__name__}: {exc}"
            logger.warning("piecewise graph capture of %d tokens failed, so steps with "
                           "prefills run eagerly from now on: %s", rows, self.disabled)
            return hidden
        finally:
            for site in self._sites:
                site.split = None
            self._capturing = None
            torch.cuda.current_stream().wait_stream(side)
        self._entries[rows] = pieces
        took = time.perf_counter() - t0
        self.capture_seconds += took
        logger.info("captured %d graph pieces for steps with prefills of up to %d tokens in "
                    "%.0f ms", len(pieces.graphs), rows, took * 1e3)
        return hidden

    def _begin(self) -> None:
        if self._pool is None:  # one pool for every piece: they run one after another
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)
        self._capturing.graphs.append(graph)

    def _split(self, site, query, key, value, kv_cache, md) -> torch.Tensor:
        """An attention call during capture: close the current graph, note the call, hand
        the model a static output buffer and open the next graph."""
        pieces = self._capturing
        pieces.graphs[-1].capture_end()
        out = torch.zeros_like(query)  # outside any capture: a buffer of our own
        pieces.calls.append(_Call(site, query, key, value, kv_cache, out))
        self._begin()
        return out

    @staticmethod
    def _abandon(pieces: _Pieces) -> None:
        """End a capture interrupted by an error, so the stream is usable again."""
        if pieces.graphs:
            try:
                pieces.graphs[-1].capture_end()
            except RuntimeError:
                pass  # it was not capturing any more
