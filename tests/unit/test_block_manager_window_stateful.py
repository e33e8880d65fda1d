"""The stateful block-manager test (test_block_manager_stateful.py) with a sliding window.

Same random allocate / append / fork / free / swap / cache-hit / evict programs, on a block
manager that drops blocks which slid out of the window. What must hold instead of "every
computed position reads back": every position the next token still attends to (the last
``window`` computed ones) is in a live block and reads back the sequence's own token, and no
sequence ever holds more blocks than ``max_blocks_held`` allows for its steps.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from core.block_manager import DROPPED, NULL_BLOCK, BlockManager, NoFreeBlocksError
from tests.unit.test_block_manager_stateful import BLOCK_SIZE, BlockManagerMachine


class WindowedMachine(BlockManagerMachine):
    @initialize(
        num_blocks=st.integers(min_value=2, max_value=24),
        num_host_blocks=st.integers(min_value=0, max_value=12),
        caching=st.booleans(),
        window=st.integers(min_value=1, max_value=9),
    )
    def setup(self, num_blocks: int, num_host_blocks: int, caching: bool, window: int) -> None:
        super().setup(num_blocks, num_host_blocks, caching)
        self.window = window
        self.bm = BlockManager(num_blocks, BLOCK_SIZE, caching, num_host_blocks, sliding_window=window)
        self.max_step: dict[int, int] = {}  # per sequence: the most tokens one step computed

    def _compute(self, seq: int, k: int) -> None:
        super()._compute(seq, k)
        self.max_step[seq] = max(self.max_step.get(seq, 1), k)

    def fork(self, data) -> None:
        before = set(self.tokens)
        super().fork(data)
        for child in set(self.tokens) - before:  # it holds what its parent's steps left
            self.max_step[child] = max(self.max_step.values(), default=1)

    @precondition(lambda self: self._device_seqs())
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), max_size=3), k=st.integers(1, 8))
    def append(self, data, new: list[int], k: int) -> None:
        """As the base rule, except that ``num_blocks_to_append`` counts gross of the blocks
        append_slots first releases (slid out of the window), so it may succeed beyond it;
        a failure may still have released such dead blocks, nothing else."""
        seq = data.draw(st.sampled_from(self._device_seqs()))
        self.tokens[seq] += new
        k = min(k, len(self.tokens[seq]) - self.computed[seq])
        if k == 0:
            return
        start = self.computed[seq]
        live = [b for b in self.bm.block_table(seq) if b != NULL_BLOCK]
        try:
            self._compute(seq, k)
        except NoFreeBlocksError:
            after = [b for b in self.bm.block_table(seq) if b != NULL_BLOCK]
            assert after == live[len(live) - len(after):] and self.computed[seq] == start

    @invariant()
    def every_sequence_reads_its_own_tokens(self) -> None:
        for seq, toks in self.tokens.items():
            if seq in self.swapped:
                table, store, dead = self.bm._host_tables[seq], self.host, DROPPED
            else:
                table, store, dead = list(self.bm.block_table(seq)), self.kv, NULL_BLOCK
            done = self.computed[seq]
            for pos in range(max(0, done - self.window + 1), done):
                block = table[pos // BLOCK_SIZE]
                assert block != dead, f"seq {seq}: position {pos} is in the window but dropped"
                got = store[block][pos % BLOCK_SIZE]
                assert got == toks[pos], f"seq {seq} reads {got} at {pos}, expected {toks[pos]}"

    @invariant()
    def no_sequence_holds_more_than_the_bound(self) -> None:
        for seq in self._device_seqs():
            bound = self.bm.max_blocks_held(10**6, self.max_step.get(seq, 1))
            held = sum(b != NULL_BLOCK for b in self.bm.block_table(seq))
            assert held <= bound, f"seq {seq} holds {held} blocks, bound {bound}"


WindowedMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestWindowedBlockManagerStateful = WindowedMachine.TestCase
