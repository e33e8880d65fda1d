"""Property-based test of the block manager (hypothesis stateful).

Random sequences of allocate / append / fork / free / swap / cache-hit / evict keep the
invariants (every block free xor referenced, refcount = tables holding it, free count
conserved, no block in two free lists) and, checked through a simulated KV cache in which
every "written" slot holds the token id computed there, every sequence reads back exactly
its own tokens at every computed position: copy-on-write, swapping, prefix hits and
eviction never hand a sequence somebody else's KV.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from core.block_manager import BlockManager, NoFreeBlocksError

BLOCK_SIZE = 4
TOKENS = st.integers(min_value=0, max_value=3)  # a tiny alphabet makes shared prefixes common


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(min_value=2, max_value=24),
        num_host_blocks=st.integers(min_value=0, max_value=12),
        caching=st.booleans(),
    )
    def setup(self, num_blocks: int, num_host_blocks: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, BLOCK_SIZE, caching, num_host_blocks)
        self.kv: dict[int, list[int | None]] = {b: [None] * BLOCK_SIZE for b in range(num_blocks)}
        self.host: dict[int, list[int | None]] = {
            b: [None] * BLOCK_SIZE for b in range(num_host_blocks)
        }
        self.tokens: dict[int, list[int]] = {}  # every token a live sequence knows
        self.computed: dict[int, int] = {}  # its num_computed_tokens
        self.swapped: set[int] = set()
        self.next_id = 0

    # ---------------------------------------------------------------- helpers

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _device_seqs(self) -> list[int]:
        return sorted(s for s in self.tokens if s not in self.swapped)

    def _compute(self, seq: int, k: int) -> None:
        """Scheduler + runner for k tokens: slots, copy-on-write, KV writes, caching."""
        start = self.computed[seq]
        pairs = self.bm.append_slots(seq, start, start + k)
        for src, dst in pairs:
            self.kv[dst] = list(self.kv[src])
        table = self.bm.block_table(seq)
        for pos in range(start, start + k):
            self.kv[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] = self.tokens[seq][pos]
        self.computed[seq] = start + k
        self.bm.cache_computed(seq, self.tokens[seq], start + k)

    def _try_allocate(self, seq: int, tokens: list[int], k_extra: int) -> int | None:
        """Admit a sequence: reuse its cached prefix, then compute up to k_extra more."""
        tokens = tuple(tokens)  # as the scheduler passes them (lookups are memoized)
        cached = self.bm.match_prefix(tokens)
        k = min(k_extra, len(tokens) - cached)
        free_before = self.bm.num_free_blocks
        if self.bm.num_blocks_to_allocate(tokens, cached + k) > free_before:
            try:
                self.bm.allocate(seq, tokens, cached + k)
            except NoFreeBlocksError:
                assert self.bm.num_free_blocks == free_before and not self.bm.has_blocks(seq)
                return None
            raise AssertionError("allocate succeeded although the cost exceeded the free pool")
        got = self.bm.allocate(seq, tokens, cached)
        # Whole blocks only, and never the last token: it must be computed for logits.
        assert got == cached and got % BLOCK_SIZE == 0 and got <= len(tokens) - 1
        self.tokens[seq], self.computed[seq] = list(tokens), got
        self._compute(seq, k)
        return got

    # ------------------------------------------------------------------ rules

    @rule(tokens=st.lists(TOKENS, min_size=1, max_size=30), k=st.integers(0, 30))
    def allocate(self, tokens: list[int], k: int) -> None:
        self._try_allocate(self._new_id(), tokens, k)

    @precondition(lambda self: self._device_seqs())
    @rule(data=st.data(), new=st.lists(TOKENS, max_size=3), k=st.integers(1, 8))
    def append(self, data, new: list[int], k: int) -> None:
        seq = data.draw(st.sampled_from(self._device_seqs()))
        self.tokens[seq] += new  # e.g. a sampled token the engine appended
        k = min(k, len(self.tokens[seq]) - self.computed[seq])
        if k == 0:
            return
        start = self.computed[seq]
        if self.bm.num_blocks_to_append(seq, start, start + k) > self.bm.num_free_blocks:
            table = self.bm.block_table(seq)
            try:
                self.bm.append_slots(seq, start, start + k)
            except NoFreeBlocksError:
                assert self.bm.block_table(seq) == table
                return
            raise AssertionError("append_slots succeeded although blocks were short")
        self._compute(seq, k)

    @precondition(lambda self: self._device_seqs())
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(self._device_seqs()))
        child = self._new_id()
        self.bm.fork(parent, child)
        # Like n > 1 sampling: the child shares what is computed and continues alone.
        self.tokens[child] = self.tokens[parent][: self.computed[parent]]
        self.computed[child] = self.computed[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq)
        del self.tokens[seq], self.computed[seq]
        self.swapped.discard(seq)

    @precondition(lambda self: self._device_seqs())
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        seq = data.draw(st.sampled_from(self._device_seqs()))
        if not self.bm.can_swap_out(seq):
            return
        for dev, host in self.bm.swap_out(seq):
            self.host[host] = list(self.kv[dev])
        self.swapped.add(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.swapped)))
        if self.bm.num_blocks_to_swap_in(seq) > self.bm.num_free_blocks:
            return
        for host, dev in self.bm.swap_in(seq):
            self.kv[dev] = list(self.host[host])
        self.swapped.discard(seq)

    @precondition(lambda self: self._device_seqs())
    @rule(data=st.data(), tail=st.lists(TOKENS, min_size=1, max_size=6))
    def cache_hit(self, data, tail: list[int]) -> None:
        """A new sequence repeating (part of) a live one's tokens, computed or not, must
        hit at least the leading blocks that live sequence holds registered (referenced
        blocks are never evicted)."""
        owner = data.draw(st.sampled_from(self._device_seqs()))
        table = self.bm.block_table(owner)
        full = self.computed[owner] // BLOCK_SIZE
        guaranteed = 0
        while guaranteed < full and self.bm.is_cached(table[guaranteed]):
            guaranteed += 1
        cut = data.draw(st.integers(guaranteed * BLOCK_SIZE, len(self.tokens[owner])))
        tokens = self.tokens[owner][:cut] + tail
        got = self._try_allocate(self._new_id(), tokens, 0)
        if got is not None:
            assert got >= guaranteed * BLOCK_SIZE

    @rule()
    def evict(self) -> None:
        """Take every free block: all unreferenced cached blocks must be evicted, and the
        cache may keep only blocks somebody holds."""
        seq, n = self._new_id(), self.bm.num_free_blocks
        if n == 0:
            return
        tokens = [1000 * seq + i for i in range(n * BLOCK_SIZE)]  # content nobody else has
        assert self.bm.allocate(seq, tokens, len(tokens)) == 0
        assert self.bm.num_free_blocks == 0
        held = {b for s in self._device_seqs() for b in self.bm.block_table(s)}
        assert all(self.bm.is_cached(b) <= (b in held) for b in range(1, self.bm.num_blocks))
        self.tokens[seq], self.computed[seq] = tokens, 0
        self._compute(seq, len(tokens))

    # ------------------------------------------------------------- invariants

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        self.bm.check_invariants()

    @invariant()
    def every_sequence_reads_its_own_tokens(self) -> None:
        for seq, toks in self.tokens.items():
            if seq in self.swapped:
                table, store = [h for _, h in self._host_table(seq)], self.host
            else:
                table, store = list(self.bm.block_table(seq)), self.kv
            assert len(table) >= -(-self.computed[seq] // BLOCK_SIZE)
            for pos in range(self.computed[seq]):
                got = store[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE]
                assert got == toks[pos], f"seq {seq} reads {got} at {pos}, expected {toks[pos]}"

    @invariant()
    def the_decode_shortcut_agrees_with_the_general_count(self) -> None:
        # The scheduler asks fits_in_own_block for a one-token step; it must say what
        # num_blocks_to_append == 0 says, around the computed end (shared, own, absent blocks).
        for seq in self._device_seqs():
            end = self.computed[seq]
            for pos in range(max(0, end - BLOCK_SIZE), end + BLOCK_SIZE + 1):
                want = self.bm.num_blocks_to_append(seq, pos, pos + 1) == 0
                assert self.bm.fits_in_own_block(seq, pos) == want, (seq, pos, self.bm.block_table(seq))

    def _host_table(self, seq: int) -> list[tuple[int, int]]:
        # The host table is private; a swapped sequence exposes it only through swap_in,
        # so read the bookkeeping directly (test-only).
        return [(i, h) for i, h in enumerate(self.bm._host_tables[seq])]

    @invariant()
    def all_blocks_free_when_nothing_is_held(self) -> None:
        if not self.tokens:
            assert self.bm.num_free_blocks == self.bm.num_usable_blocks
            assert self.bm.num_free_host_blocks == self.bm.num_host_blocks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerStateful = BlockManagerMachine.TestCase
