"""Pooling requests: one vector per prompt from the model's final hidden states (embeddings).

A pooling request is an ordinary request whose :class:`~core.sampling_params.SamplingParams`
carry ``pooling`` and ask for one greedy, undetokenized token: the scheduler runs its prompt
as a prefill (chunked like any other) and finishes it after that one token; nothing in the
scheduler knows about pooling except that a request needing every position skips the
prefix cache (its cached positions would never pass through the model). The model runner
pools the hidden states of the request's rows (:class:`PoolingState`) and returns the vector
beside the sampled token; the engine core attaches it to the request's delta.

The hidden states are the decoder's output after its final norm: what HF ``AutoModel``
returns as ``last_hidden_state``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

PoolingType = Literal["last", "mean"]
POOLING_TYPES: tuple[str, ...] = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """How to turn a prompt's hidden states into one vector."""

    type: PoolingType = "last"
    """'last': the last prompt token's hidden state (decoder embedding models: e5-mistral,
    gte-Qwen); 'mean': the average over every prompt token."""
    normalize: bool = True
    """Scale the vector to unit L2 norm (cosine similarity becomes a dot product)."""

    def __post_init__(self) -> None:
        if self.type not in POOLING_TYPES:
            raise ValueError(f"PoolingParams.type={self.type!r} is invalid: must be one of {list(POOLING_TYPES)}")

    @property
    def needs_every_position(self) -> bool:
        return self.type == "mean"


def skips_prefix_cache(params) -> bool:
    """A request whose pooling reads every prompt position must compute them all."""
    return params.pooling is not None and params.pooling.needs_every_position


STALE_STEPS = 100_000
"""A partial sum not extended for this many steps belongs to a request aborted mid-prompt (the
runner is not told of aborts) and is dropped; a sequence swapped out for longer that comes
back gets :data:`LOST` instead of a wrong mean."""

LOST: tuple[float, ...] = ()
"""The vector reported when a mean's earlier chunks were dropped (the API answers 503, retry)."""


class PoolingState:
    """The model runner's running sums for mean pooling across prefill chunks.

    Keyed by sequence id. A chunk at position 0 (a new prompt, or a recompute after
    preemption) starts the sum afresh; a chunk at position p > 0 extends a sum over exactly p
    positions (a sequence swapped out and back keeps its sum); the chunk that samples (the
    prompt's last) ends it.
    """

    def __init__(self) -> None:
        self._sums: dict[int, tuple[torch.Tensor, int, int]] = {}
        """seq id -> (sum of hidden states, positions summed, step it was last extended)."""
        self._step = 0

    def begin_step(self) -> None:
        """Count a step and drop sums no step extended for :data:`STALE_STEPS`."""
        self._step += 1
        if self._step % 1024 == 0:
            stale = [s for s, (_, _, at) in self._sums.items() if self._step - at > STALE_STEPS]
            for s in stale:
                del self._sums[s]

    def add_chunk(self, seq_id: int, start_pos: int, rows: torch.Tensor, params: PoolingParams,
                  final: bool) -> torch.Tensor | tuple[float, ...] | None:
        """Take one chunk's hidden states ``rows`` [tokens, hidden]; on the final chunk return
        the pooled vector (float32, [hidden]) or :data:`LOST`, else None."""
        if params.type == "last":
            return _finish(rows[-1].float(), params) if final else None
        total, count = rows.float().sum(0), rows.shape[0]
        if start_pos > 0:
            prev = self._sums.get(seq_id)
            if prev is None or prev[1] != start_pos:
                self._sums.pop(seq_id, None)
                return LOST if final else None
            total, count = total + prev[0], count + prev[1]
        if not final:
            self._sums[seq_id] = (total, count, self._step)
            return None
        self._sums.pop(seq_id, None)
        return _finish(total / count, params)


def _finish(vec: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    return torch.nn.functional.normalize(vec, dim=0) if params.normalize else vec


def attach_pooled(deltas: list, sched, pooled: dict[int, tuple[float, ...]]) -> list:
    """The engine core's deltas with each pooled vector (keyed by seq id in the runner's
    output) set on its request's delta. A pooling request samples one token on the step
    that pools, so the scheduler made a delta for it."""
    import msgspec

    by_request = {s.request_id: pooled[s.seq_id] for s in sched.scheduled if s.seq_id in pooled}
    return [msgspec.structs.replace(d, pooled=by_request[d.request_id]) if d.request_id in by_request else d
            for d in deltas]
