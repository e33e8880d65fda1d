"""Paged KV-cache bookkeeping: which physical blocks hold which sequence's tokens.

The block manager only moves integer block ids around; the KV tensors live in the model
runner. Its vocabulary:

* **Block table** (per ``seq_id``): the device block ids that hold positions
  ``[i * block_size, (i + 1) * block_size)`` of the sequence, in order. It covers every
  position the sequence has computed or is about to compute in the current step.
* **Null block**: block ``0`` is reserved and never handed out, so the runner can point
  padding entries of a block table (and padding slots on static-shape platforms) at it
  without touching live KV. ``num_blocks`` counts it; ``num_usable_blocks`` does not.
* **Reference count**: how many block tables hold a block. Forked sequences share blocks;
  a sequence about to write into a shared block gets its own copy first (copy-on-write,
  reported as ``(src, dst)`` pairs for the runner to copy).
* **Prefix cache** (``enable_prefix_caching``): a *full* block whose KV has been computed is
  registered under a chained hash ``h_i = sha256(h_{i-1} || token ids of block i)``, so a
  hash names the whole prefix up to and including that block. A new sequence reuses the
  registered blocks of its longest cached prefix. Unreferenced registered blocks stay in
  an LRU pool and are evicted (their hash forgotten) only when a fresh block is needed
  and no never-cached free block is left. Only the token ids enter the hash: one engine
  serves one model, so nothing else changes a block's content.
* **Host pool** (``num_host_blocks``): swapped-out sequences keep their KV there. Host
  blocks are never shared.
* **Sliding window** (``sliding_window``, set only when *every* attention layer of the model
  attends within that window): a block whose positions all lie before the window of the
  sequence's next token is never read again, so :meth:`append_slots` releases it and its
  table entry becomes the null block (``DROPPED`` in a host table). A long sequence then
  holds about ``window / block_size + 1`` blocks plus the step's new tokens
  (:func:`window_blocks_bound`), and admission counts only those: prefix-cache hits that lie
  before the window are not revived, and a swap-in needs only the live blocks. Models that
  mix windowed and full-attention layers (Gemma 2/3) get no window here: their full layers
  read every block, and all layers share one block table.

Every block except the null block is at any time either free (in exactly one of the two
free pools) or referenced by at least one block table, never both; see
:meth:`BlockManager.check_invariants`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence

NULL_BLOCK = 0
"""Reserved block id: never allocated, safe target for padding reads and writes."""
DROPPED = -1
"""Host-table entry of a block that slid out of the window before the swap-out."""


class NoFreeBlocksError(RuntimeError):
    """Raised when an operation needs more free blocks than the pool has right now."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Number of blocks needed to hold ``num_tokens`` positions."""
    return -(-num_tokens // block_size)


def window_blocks_bound(num_tokens: int, block_size: int, window: int | None, step_tokens: int) -> int:
    """Most blocks one sequence of up to ``num_tokens`` positions holds at once when it is
    computed at most ``step_tokens`` positions a step and blocks that slid out of ``window``
    are released (None: no window, every block is held).

    A step over ``[n, n + k)`` needs positions from ``n - window + 1`` on, so it holds the
    blocks of at most ``block_size - 1 + window - 1 + k`` positions (the first one may start
    mid-block).
    """
    full = blocks_for(num_tokens, block_size)
    if window is None:
        return full
    return min(full, blocks_for(block_size + window - 2 + max(1, step_tokens), block_size))


def _chain_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    # sha256 instead of Python's hash(): a collision would silently serve wrong KV.
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class BlockManager:
    """Allocates KV blocks to sequences, with prefix caching, fork/copy-on-write and swap.

    :param num_blocks: device blocks in the KV cache tensors, including the null block 0.
    :param block_size: tokens per block.
    :param enable_prefix_caching: reuse computed full blocks across sequences.
    :param num_host_blocks: size of the host pool for swapping (0 = swapping impossible).
    :param sliding_window: the window all attention layers share (None: some layer attends
        to everything, nothing is ever dropped).

    Prefix-cache counters are in **tokens**: ``prefix_cache_queries`` adds the number of
    tokens a sequence knows when it is allocated (prompt plus any outputs, on every
    admission including re-admission after preemption); ``prefix_cache_hits`` adds the
    tokens served from the cache.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        sliding_window: int | None = None,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks={num_blocks} leaves no usable block (block 0 is the reserved "
                "null block); give the KV cache at least 2 blocks"
            )
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self._dropped: dict[int, int] = {}
        """Per sequence: how many leading table entries slid out of the window (now null)."""
        self._ref = [0] * num_blocks
        self._fresh: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))
        """Free blocks without cached content (popped from the end: low ids first)."""
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Free blocks still registered in the prefix cache, least recently used first."""
        self._hash_to_block: dict[bytes, int] = {}
        self._block_hash: dict[int, bytes] = {}
        self._tables: dict[int, list[int]] = {}
        self._seq_hashes: dict[int, list[bytes]] = {}
        """Chained hashes of a sequence's leading computed full blocks (what was offered to
        the cache so far); survives swapping."""
        self._host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self._host_tables: dict[int, list[int]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._cache_version = 0
        """Bumped whenever a hash is registered or evicted (validates ``_last_match``)."""
        self._last_match: tuple[object, int, list[tuple[bytes, int]]] | None = None

    # ----------------------------------------------------------------- queries

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold KV (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, cached-but-unreferenced ones included."""
        return len(self._fresh) + len(self._evictable)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (referenced or not)."""
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by some sequence (0.0 .. 1.0)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def has_blocks(self, seq_id: int) -> bool:
        """Whether the sequence holds a table on the device or on the host."""
        return seq_id in self._tables or seq_id in self._host_tables

    def is_swapped(self, seq_id: int) -> bool:
        return seq_id in self._host_tables

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._table(seq_id))

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        """Whether the block is registered in the prefix cache."""
        return block in self._block_hash

    def num_hashed_blocks(self, seq_id: int) -> int:
        """How many leading full blocks of the sequence were offered to the prefix cache."""
        return len(self._seq_hashes.get(seq_id, ()))

    # -------------------------------------------------------- prefix matching

    def _match(self, token_ids: Sequence[int]) -> list[tuple[bytes, int]]:
        """(hash, block) of the longest cached prefix of full blocks.

        The last known token is never matched: it must be computed to get logits.
        """
        if not self.enable_prefix_caching or not token_ids:
            return []
        # The scheduler asks about the same tuple several times while admitting it.
        memo = self._last_match
        if memo is not None and memo[0] is token_ids and memo[1] == self._cache_version:
            return memo[2]
        bs = self.block_size
        found: list[tuple[bytes, int]] = []
        parent = b""
        for i in range((len(token_ids) - 1) // bs):
            h = _chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block = self._hash_to_block.get(h)
            if block is None:
                break
            found.append((h, block))
            parent = h
        if isinstance(token_ids, tuple):  # immutable, so identity is a safe memo key
            self._last_match = (token_ids, self._cache_version, found)
        return found

    def match_prefix(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` the cache could serve now (a multiple of block_size,
        at most ``len(token_ids) - 1``). Pure query: changes no state or counter."""
        return len(self._match(token_ids)) * self.block_size

    def num_blocks_to_allocate(self, token_ids: Sequence[int], num_tokens: int) -> int:
        """Free blocks :meth:`allocate` with these arguments would consume: fresh blocks
        plus cached blocks that must be taken back out of the free pool (under a sliding
        window only those the next position still attends to)."""
        match = self._match(token_ids)[: num_tokens // self.block_size]
        live = match[self._first_live(len(match) * self.block_size) :]
        revived = sum(1 for _, b in live if self._ref[b] == 0)
        return revived + self.blocks_for(num_tokens) - len(match)

    def max_blocks_held(self, num_tokens: int, step_tokens: int) -> int:
        """Most blocks a sequence of up to ``num_tokens`` positions, computed at most
        ``step_tokens`` a step, holds at once (see :func:`window_blocks_bound`)."""
        return window_blocks_bound(num_tokens, self.block_size, self.sliding_window, step_tokens)

    def _first_live(self, num_computed: int) -> int:
        """Index of the first block the position ``num_computed`` still attends to."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    # ------------------------------------------------------------- allocation

    def allocate(self, seq_id: int, token_ids: Sequence[int], num_tokens: int) -> int:
        """Create the block table of a sequence that holds none.

        The table covers the first ``num_tokens`` positions; its leading blocks are the
        cached prefix of ``token_ids`` (all tokens the sequence knows) as far as it reaches
        within ``num_tokens``.

        :return: how many leading tokens are already computed (cache hits); the caller sets
            the sequence's ``num_computed_tokens`` to it.
        :raises NoFreeBlocksError: if the free pool is short (check
            :meth:`num_blocks_to_allocate` first); nothing is changed then.
        """
        if self.has_blocks(seq_id):
            raise ValueError(f"sequence {seq_id} already holds blocks; free it before allocate")
        need = self.num_blocks_to_allocate(token_ids, num_tokens)
        self._check_free(need, f"allocating {num_tokens} tokens for sequence {seq_id}")
        match = self._match(token_ids)[: num_tokens // self.block_size]
        cached = len(match) * self.block_size
        # Hit blocks already outside the window of the first position to compute are never
        # read: the table starts with null entries there instead of reviving them.
        first_live = self._first_live(cached)
        table: list[int] = [NULL_BLOCK] * first_live
        for _, block in match[first_live:]:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
            table.append(block)
        while len(table) < self.blocks_for(num_tokens):
            table.append(self._take_fresh())
        self._tables[seq_id] = table
        if first_live:
            self._dropped[seq_id] = first_live
        self._seq_hashes[seq_id] = [h for h, _ in match]
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(token_ids)
            self.prefix_cache_hits += cached
        return cached

    def fits_in_own_block(self, seq_id: int, pos: int) -> bool:
        """``num_blocks_to_append(seq_id, pos, pos + 1) == 0`` (a decode step's question),
        without the general case's slice: position ``pos`` falls in a block the table
        already has and no other sequence shares."""
        table = self._tables[seq_id]
        i = pos // self.block_size
        return i < len(table) and self._ref[table[i]] <= 1

    def num_blocks_to_append(self, seq_id: int, num_computed: int, num_tokens: int) -> int:
        """Free blocks :meth:`append_slots` would consume (new blocks + copies).

        Gross of the blocks it first frees because they slid out of the window: callers
        treat 0 as "append_slots need not be called", which must stay true only when the
        table already covers ``num_tokens``.
        """
        table = self._tables[seq_id]
        end = blocks_for(num_tokens, self.block_size)
        shared = 0
        for b in table[num_computed // self.block_size : end]:  # one block in a decode step
            if self._ref[b] > 1:
                shared += 1
        return max(0, end - len(table)) + shared

    def append_slots(
        self, seq_id: int, num_computed: int, num_tokens: int
    ) -> list[tuple[int, int]]:
        """Make the table cover ``num_tokens`` positions before positions
        ``[num_computed, num_tokens)`` are written.

        A block in the written range that other tables share is replaced by a fresh copy.

        :return: ``(src, dst)`` copy-on-write pairs the runner must copy before the forward.
        :raises NoFreeBlocksError: if the free pool is short; nothing is changed then, except
            that blocks which slid out of the window are released (no position reads them).
        """
        self._drop_slid_out(seq_id, num_computed)
        need = self.num_blocks_to_append(seq_id, num_computed, num_tokens)
        self._check_free(need, f"appending to sequence {seq_id} up to {num_tokens} tokens")
        table = self._tables[seq_id]
        end = self.blocks_for(num_tokens)
        pairs = []
        for i in range(num_computed // self.block_size, min(end, len(table))):
            old = table[i]
            if self._ref[old] > 1:
                table[i] = self._take_fresh()
                self._ref[old] -= 1
                pairs.append((old, table[i]))
        while len(table) < end:
            table.append(self._take_fresh())
        return pairs

    def _drop_slid_out(self, seq_id: int, num_computed: int) -> None:
        """Release the leading blocks no position from ``num_computed`` on attends to (the
        earliest of those sees back to ``num_computed - window + 1``); their table entries
        become the null block."""
        if self.sliding_window is None:
            return
        table = self._tables[seq_id]
        first_live = min(len(table), self._first_live(num_computed))
        for i in range(self._dropped.get(seq_id, 0), first_live):
            if table[i] != NULL_BLOCK:
                self._release(table[i])
                table[i] = NULL_BLOCK
        self._dropped[seq_id] = max(self._dropped.get(seq_id, 0), first_live)

    def cache_computed(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the sequence's full blocks whose KV is computed (the first
        ``num_computed`` positions, already written by an executed step).

        ``token_ids`` must hold at least those positions. A block whose content is already
        cached in another block is not registered twice.
        """
        if not self.enable_prefix_caching or seq_id not in self._tables:
            return
        table = self._tables[seq_id]
        hashes = self._seq_hashes[seq_id]
        bs = self.block_size
        for i in range(len(hashes), min(num_computed // bs, len(table))):
            h = _chain_hash(hashes[-1] if hashes else b"", token_ids[i * bs : (i + 1) * bs])
            hashes.append(h)
            if table[i] != NULL_BLOCK:  # a dropped block's hash still extends the chain
                self._register(table[i], h)

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give ``child_id`` the parent's table; every block gains a reference."""
        if self.has_blocks(child_id):
            raise ValueError(f"cannot fork into sequence {child_id}: it already holds blocks")
        table = self._tables[parent_id]
        for block in table:
            if block != NULL_BLOCK:
                self._ref[block] += 1
        self._tables[child_id] = list(table)
        if parent_id in self._dropped:
            self._dropped[child_id] = self._dropped[parent_id]
        self._seq_hashes[child_id] = list(self._seq_hashes[parent_id])

    def free(self, seq_id: int) -> None:
        """Release the sequence's device or host table.

        Device blocks go back last-block-first, so the shared head of a prefix is the most
        recently used and is evicted last.
        """
        if seq_id in self._tables:
            for block in reversed(self._tables.pop(seq_id)):
                if block != NULL_BLOCK:
                    self._release(block)
        elif seq_id in self._host_tables:
            self._host_free.extend(b for b in reversed(self._host_tables.pop(seq_id)) if b != DROPPED)
        else:
            raise KeyError(f"sequence {seq_id} holds no blocks (double free?)")
        self._seq_hashes.pop(seq_id, None)
        self._dropped.pop(seq_id, None)

    # ------------------------------------------------------------------- swap

    def can_swap_out(self, seq_id: int) -> bool:
        return self._live(self._tables[seq_id]) <= len(self._host_free)

    @staticmethod
    def _live(table: list[int]) -> int:
        return sum(1 for b in table if b != NULL_BLOCK)

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Move the sequence's table to host blocks; its device blocks are released.

        :return: ``(device block, host block)`` pairs to copy before the device blocks are
            reused (the runner applies swap-outs first in a step).
        """
        table = self._tables[seq_id]
        live = self._live(table)
        if live > len(self._host_free):
            raise NoFreeBlocksError(
                f"swapping out sequence {seq_id} needs {live} host blocks but only "
                f"{len(self._host_free)} of {self.num_host_blocks} are free; raise --swap-space"
            )
        del self._tables[seq_id]
        host = [DROPPED if b == NULL_BLOCK else self._host_free.pop() for b in table]
        for block in reversed(table):
            if block != NULL_BLOCK:
                self._release(block)
        self._host_tables[seq_id] = host
        return [(d, h) for d, h in zip(table, host) if d != NULL_BLOCK]

    def num_blocks_to_swap_in(self, seq_id: int) -> int:
        return sum(1 for b in self._host_tables[seq_id] if b != DROPPED)

    def num_blocks_to_swap_in_and_append(self, seq_id: int, num_tokens: int) -> int:
        """Free blocks a swap-in followed by ``append_slots`` up to ``num_tokens`` positions
        consumes: the live host blocks plus the blocks past the end of the table (entries
        that slid out of the window cost nothing)."""
        host = self._host_tables[seq_id]
        return self.num_blocks_to_swap_in(seq_id) + max(0, self.blocks_for(num_tokens) - len(host))

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        """Bring a swapped sequence back into fresh device blocks; host blocks are released.

        Because the host blocks are free again at once, a caller must not swap anything
        out after a swap-in within the same step.

        :return: ``(host block, device block)`` pairs to copy before the forward.
        """
        host = self._host_tables[seq_id]
        self._check_free(self.num_blocks_to_swap_in(seq_id), f"swapping in sequence {seq_id}")
        del self._host_tables[seq_id]
        table = [NULL_BLOCK if b == DROPPED else self._take_fresh() for b in host]
        self._tables[seq_id] = table
        self._host_free.extend(b for b in reversed(host) if b != DROPPED)
        # The copies hold the same KV, so they may serve as cache entries again.
        for block, h in zip(table, self._seq_hashes[seq_id]):
            if block != NULL_BLOCK:
                self._register(block, h)
        return [(h, d) for h, d in zip(host, table) if h != DROPPED]

    # -------------------------------------------------------------- internals

    def _table(self, seq_id: int) -> list[int]:
        if seq_id not in self._tables:
            where = "is swapped out" if seq_id in self._host_tables else "holds no blocks"
            raise KeyError(f"sequence {seq_id} {where}; it has no device block table")
        return self._tables[seq_id]

    def _check_free(self, need: int, what: str) -> None:
        if need > self.num_usable_blocks:
            raise NoFreeBlocksError(
                f"{what} needs {need} KV blocks of {self.block_size} tokens but the cache has "
                f"only {self.num_usable_blocks}; raise the KV cache memory or lower "
                "max_model_len / max_tokens"
            )
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"{what} needs {need} free KV blocks but only {self.num_free_blocks} of "
                f"{self.num_usable_blocks} are free; free or preempt a sequence first"
            )

    def _take_fresh(self) -> int:
        """A free block with reference count 1; evicts the LRU cached block if needed."""
        if self._fresh:
            block = self._fresh.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._hash_to_block[self._block_hash.pop(block)]
            self._cache_version += 1
        self._ref[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if block in self._block_hash:
                self._evictable[block] = None
            else:
                self._fresh.append(block)

    def _register(self, block: int, h: bytes) -> None:
        if block in self._block_hash or h in self._hash_to_block:
            return
        self._block_hash[block] = h
        self._hash_to_block[h] = block
        self._cache_version += 1

    # ------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        held = Counter(b for t in self._tables.values() for b in t if b != NULL_BLOCK)
        fresh, lru = set(self._fresh), set(self._evictable)
        assert len(fresh) == len(self._fresh), "a block is twice in the fresh free list"
        assert not fresh & lru, f"blocks in both free pools: {sorted(fresh & lru)}"
        assert NULL_BLOCK not in held and NULL_BLOCK not in fresh | lru, "null block handed out"
        for block in range(1, self.num_blocks):
            assert self._ref[block] == held[block], (
                f"block {block}: refcount {self._ref[block]} != {held[block]} tables holding it"
            )
            assert (block in fresh or block in lru) != (held[block] > 0), (
                f"block {block} must be free xor referenced"
            )
        assert len(fresh) + len(lru) + len(held) == self.num_usable_blocks, "blocks lost"
        for seq_id, table in self._tables.items():
            live = [b for b in table if b != NULL_BLOCK]
            assert len(set(live)) == len(live), f"sequence {seq_id} holds a block twice"
            dropped = self._dropped.get(seq_id, 0)
            assert all(b == NULL_BLOCK for b in table[:dropped]), f"{seq_id}: dropped block held"
            assert NULL_BLOCK not in table[dropped:], f"{seq_id}: null block inside the window"
        assert all(b in self._block_hash for b in lru), "uncached block in the LRU pool"
        assert not fresh & set(self._block_hash), "cached block in the fresh pool"
        assert {v: k for k, v in self._hash_to_block.items()} == self._block_hash
        assert self.enable_prefix_caching or not self._block_hash
        host_held = [b for t in self._host_tables.values() for b in t if b != DROPPED]
        assert len(set(host_held)) == len(host_held), "a host block is in two tables"
        assert not set(host_held) & set(self._host_free), "host block free and held"
        assert len(set(self._host_free)) == len(self._host_free), "host block twice free"
        assert len(host_held) + len(self._host_free) == self.num_host_blocks, "host blocks lost"
        assert not self._tables.keys() & self._host_tables.keys(), "sequence on device and host"
        for seq_id, hashes in self._seq_hashes.items():
            table = self._tables.get(seq_id, self._host_tables.get(seq_id))
            assert table is not None and len(hashes) <= len(table), f"stale hashes {seq_id}"
