"""Sizing the KV cache: from a byte budget to a number of blocks, with errors that say why."""

from __future__ import annotations

from dataclasses import dataclass

from core.block_manager import window_blocks_bound
from core.config import GiB


@dataclass(frozen=True)
class KVPlan:
    block_size: int
    bytes_per_block: int
    """All layers, keys and values, for one block of block_size tokens."""
    num_blocks: int
    num_host_blocks: int
    max_model_len: int
    sliding_window: int | None = None
    """The window every attention layer shares (see core.attention.shared_sliding_window):
    the block manager frees blocks that slid out of it. None: no such window."""
    max_step_tokens: int | None = None
    """Most positions one sequence computes in a step (the scheduler's token budget); with a
    window it bounds the blocks a sequence holds. None: a whole max_model_len prompt."""

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_per_max_len_seq(self) -> int:
        """Blocks one max_model_len sequence holds at once (fewer under a window)."""
        step = self.max_step_tokens if self.max_step_tokens is not None else self.max_model_len
        return window_blocks_bound(self.max_model_len, self.block_size, self.sliding_window, step)

    @property
    def max_concurrent_at_max_len(self) -> int:
        return (self.num_blocks - 1) // self.blocks_per_max_len_seq  # minus the null block

    def describe(self) -> str:
        window = (
            f" (sliding window {self.sliding_window}: such a sequence holds at most "
            f"{self.blocks_per_max_len_seq} blocks)" if self.sliding_window is not None else ""
        )
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.tokens} tokens "
            f"({format_bytes(self.num_blocks * self.bytes_per_block)}, "
            f"{format_bytes(self.bytes_per_block)} per block); holds {self.max_concurrent_at_max_len} sequence(s) of max_model_len "
            f"{self.max_model_len}{window}; host swap pool {self.num_host_blocks} blocks"
        )


def plan_kv_cache(
    budget_bytes: int,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    swap_bytes: int = 0,
    num_blocks_override: int | None = None,
    sliding_window: int | None = None,
    max_step_tokens: int | None = None,
) -> KVPlan:
    """Blocks that fit ``budget_bytes``; refuse if one max_model_len sequence cannot fit
    (under a sliding window: its window plus one step's tokens, see KVPlan.max_step_tokens)."""
    num_blocks = num_blocks_override if num_blocks_override is not None else budget_bytes // bytes_per_block
    plan = KVPlan(
        block_size, bytes_per_block, num_blocks, swap_bytes // bytes_per_block, max_model_len,
        sliding_window, max_step_tokens,
    )
    need = plan.blocks_per_max_len_seq + 1  # block 0 is the reserved null block
    if num_blocks < need:
        need_bytes = need * bytes_per_block
        fits = max(0, num_blocks - 1) * block_size
        raise_it = (
            f"raise --kv-cache-memory (or, on a GPU, --gpu-memory-utilization) to at least "
            f"{format_bytes(need_bytes)}"
        )
        # with no usable block, lowering max_model_len cannot help: offer only the budget
        fix = f"lower --max-model-len to at most {fits} or {raise_it}" if fits else raise_it
        if sliding_window is not None:  # the window plus one step's tokens is what must fit
            fix += f", or lower --max-num-batched-tokens (a step's tokens sit beside the {sliding_window}-token window)"
        raise ValueError(
            f"max_model_len {max_model_len} needs {need - 1} blocks of {block_size} tokens (plus "
            f"1 reserved block; {format_bytes(bytes_per_block)} per block, {format_bytes(need_bytes)} "
            f"in all); the KV budget of {format_bytes(budget_bytes)} holds {num_blocks} blocks. "
            f"To fix: {fix}"
        )
    return plan


def format_bytes(n: int) -> str:
    """Human-readable size with enough precision to be useful for small test caches."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"
