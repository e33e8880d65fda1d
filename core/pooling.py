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


class PoolingState:
    """The model runner's running sums for mean pooling across prefill chunks.

    Keyed by sequence id; a chunk starting at position 0 (a new prompt, or a recompute after
    preemption) starts the sum afresh, the chunk that samples (the prompt's last) ends it.
    """

    def __init__(self) -> None:
        self._sums: dict[int, tuple[torch.Tensor, int]] = {}

    def add_chunk(self, seq_id: int, start_pos: int, rows: torch.Tensor, params: PoolingParams,
                  final: bool) -> torch.Tensor | None:
        """Take one chunk's hidden states ``rows`` [tokens, hidden]; on the final chunk return
        the pooled vector (float32, [hidden]), else None."""
        if params.type == "last":
            return _finish(rows[-1].float(), params) if final else None
        total = rows.float().sum(0)
        count = rows.shape[0]
        if start_pos > 0 and seq_id in self._sums:
            prev, prev_count = self._sums[seq_id]
            total, count = total + prev, count + prev_count
        if not final:
            self._sums[seq_id] = (total, count)
            return None
        self._sums.pop(seq_id, None)
        return _finish(total / count, params)

    def drop(self, seq_ids) -> None:
        """Forget sequences that will not finish their prompt here (preempted, aborted)."""
        for s in seq_ids:
            self._sums.pop(s, None)


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
