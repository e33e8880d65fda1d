"""Continuous-batching scheduler: which sequences run this step, and how many tokens each.

(The Scheduler class is below the output types.)
"""

from __future__ import annotations

from dataclasses import dataclass

from core.sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's work in a step."""

    seq_id: int
    request_id: str
    token_ids: tuple[int, ...]
    """The tokens to compute this step (their KV gets written)."""
    start_pos: int
    """Position of token_ids[0] = tokens already in the cache for this sequence."""
    block_table: tuple[int, ...]
    """Block ids covering positions [0, start_pos + len(token_ids)), in order."""
    sample: bool
    """Sample the next token from the last row (False for a non-final prefill chunk)."""
    params: SamplingParams
    output_index: int
    """How many tokens this sequence has generated so far (seeds per-token randomness)."""
    prompt_token_ids: tuple[int, ...] = ()
    """Set when the sampler needs history (penalties) or prompt logprobs are asked for."""
    output_token_ids: tuple[int, ...] = ()
    """Set when the sampler needs history (penalties)."""

    @property
    def is_prefill(self) -> bool:
        return len(self.token_ids) > 1 or not self.sample


@dataclass(frozen=True)
class SchedulerOutput:
    """The plan for one step, consumed by the model runner. Prefills come first."""

    scheduled: tuple[ScheduledSequence, ...]
    """Prefill (and chunked-prefill) sequences first, then decodes."""
    num_prefills: int
    """How many leading entries of ``scheduled`` are prefills."""
    num_batched_tokens: int
    """Sum of len(token_ids) over ``scheduled``."""
    blocks_to_copy: tuple[tuple[int, int], ...] = ()
    """(src, dst) copy-on-write pairs to run before the forward pass."""
    blocks_to_swap_in: tuple[tuple[int, int], ...] = ()
    """(host block, device block) pairs to copy in before the forward pass."""
    blocks_to_swap_out: tuple[tuple[int, int], ...] = ()
    """(device block, host block) pairs to copy out before the forward pass."""
    preempted: tuple[int, ...] = ()
    """seq ids preempted this step (for stats/logs)."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out
