"""Block manager: allocation, append, free, refcounts, exhaustion, fork/copy-on-write,
swap, prefix caching and LRU eviction (core/block_manager.py).

Expected numbers are worked out by hand in the comments (block_size 4 unless stated).
"""

from __future__ import annotations

import pytest

from core.block_manager import NULL_BLOCK, BlockManager, NoFreeBlocksError


def toks(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def compute(bm: BlockManager, seq_id: int, tokens: list[int], start: int, end: int) -> list:
    """What the scheduler + runner do for positions [start, end): slots, then cache."""
    pairs = bm.append_slots(seq_id, start, end)
    bm.cache_computed(seq_id, tokens, end)
    return pairs


def test_null_block_is_never_handed_out():
    bm = BlockManager(num_blocks=5, block_size=4)
    assert bm.num_usable_blocks == 4 and bm.num_free_blocks == 4
    bm.allocate(1, toks(16), 16)  # 16 tokens = 4 blocks = everything usable
    assert NULL_BLOCK not in bm.block_table(1)
    assert sorted(bm.block_table(1)) == [1, 2, 3, 4]
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    bm.check_invariants()


def test_allocate_append_free_and_refcounts():
    bm = BlockManager(num_blocks=11, block_size=4, enable_prefix_caching=False)
    assert bm.allocate(7, toks(6), 6) == 0  # 6 tokens -> 2 blocks
    assert len(bm.block_table(7)) == 2 and bm.num_free_blocks == 8
    # Positions 6..7 fit the second block: no new block.
    assert bm.num_blocks_to_append(7, 6, 8) == 0
    assert bm.append_slots(7, 6, 8) == [] and len(bm.block_table(7)) == 2
    # Position 8 opens a third block; 8..13 needs blocks 3 and 4.
    assert bm.num_blocks_to_append(7, 8, 14) == 2
    bm.append_slots(7, 8, 14)
    table = bm.block_table(7)
    assert len(table) == 4 and len(set(table)) == 4
    assert all(bm.ref_count(b) == 1 for b in table)
    assert bm.num_free_blocks == 6
    bm.check_invariants()
    bm.free(7)
    assert bm.num_free_blocks == 10 and all(bm.ref_count(b) == 0 for b in table)
    assert not bm.has_blocks(7)
    bm.check_invariants()
    with pytest.raises(KeyError, match="holds no blocks"):
        bm.free(7)
    with pytest.raises(KeyError, match="holds no blocks"):
        bm.block_table(7)


def test_exhaustion_errors_say_the_numbers_and_change_nothing():
    bm = BlockManager(num_blocks=5, block_size=4, enable_prefix_caching=False)
    with pytest.raises(
        NoFreeBlocksError, match=r"needs 5 KV blocks of 4 tokens but the cache has only 4"
    ):
        bm.allocate(1, toks(20), 20)
    assert not bm.has_blocks(1) and bm.num_free_blocks == 4
    bm.allocate(1, toks(12), 12)  # 3 blocks
    with pytest.raises(NoFreeBlocksError, match=r"needs 2 free KV blocks but only 1 of 4 are free"):
        bm.allocate(2, toks(8), 8)
    assert not bm.has_blocks(2) and bm.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError, match="needs 2 free"):
        bm.append_slots(1, 12, 20)
    assert len(bm.block_table(1)) == 3
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate(1, toks(4), 4)
    bm.check_invariants()
    with pytest.raises(ValueError, match="num_blocks=1 leaves no usable block"):
        BlockManager(num_blocks=1, block_size=4)


def test_fork_shares_blocks_and_copy_on_write_reports_pairs():
    bm = BlockManager(num_blocks=11, block_size=4, enable_prefix_caching=False)
    bm.allocate(1, toks(9), 9)  # positions 0..8: blocks A B C, C holds one token
    a, b, c = bm.block_table(1)
    bm.fork(1, 2)
    bm.fork(1, 3)
    assert bm.block_table(2) == bm.block_table(3) == (a, b, c)
    assert [bm.ref_count(x) for x in (a, b, c)] == [3, 3, 3]
    assert bm.num_free_blocks == 7
    bm.check_invariants()
    # Writing position 9 lands in the shared C: sequence 1 gets a copy.
    assert bm.num_blocks_to_append(1, 9, 10) == 1
    pairs = bm.append_slots(1, 9, 10)
    assert len(pairs) == 1 and pairs[0][0] == c
    c1 = pairs[0][1]
    assert bm.block_table(1) == (a, b, c1) and bm.ref_count(c) == 2
    # Sequence 2 too; then 3 is the last holder of C and writes in place.
    ((src, c2),) = bm.append_slots(2, 9, 10)
    assert src == c and bm.ref_count(c) == 1
    assert bm.append_slots(3, 9, 10) == [] and bm.block_table(3) == (a, b, c)
    assert [bm.ref_count(x) for x in (a, b)] == [3, 3]
    assert len({c, c1, c2}) == 3 and bm.num_free_blocks == 5  # 10 - (a, b, c, c1, c2)
    bm.check_invariants()
    for s in (1, 2, 3):
        bm.free(s)
    assert bm.num_free_blocks == 10
    bm.check_invariants()


def test_no_copy_when_writing_starts_a_new_block():
    bm = BlockManager(num_blocks=11, block_size=4, enable_prefix_caching=False)
    bm.allocate(1, toks(8), 8)  # two full blocks
    bm.fork(1, 2)
    assert bm.append_slots(2, 8, 9) == []  # position 8 is in a new third block
    assert bm.block_table(2)[:2] == bm.block_table(1)
    bm.check_invariants()


def test_swap_out_and_in_report_pairs_and_move_ownership():
    bm = BlockManager(num_blocks=9, block_size=4, enable_prefix_caching=False, num_host_blocks=3)
    bm.allocate(1, toks(10), 10)  # 3 blocks
    dev = bm.block_table(1)
    assert bm.can_swap_out(1)
    out = bm.swap_out(1)
    assert [d for d, _ in out] == list(dev)
    host = [h for _, h in out]
    assert sorted(host) == [0, 1, 2] and bm.num_free_host_blocks == 0
    assert bm.is_swapped(1) and bm.has_blocks(1) and bm.num_free_blocks == 8
    with pytest.raises(KeyError, match="is swapped out"):
        bm.block_table(1)
    bm.check_invariants()
    bm.allocate(2, toks(4), 4)
    assert not bm.can_swap_out(2)  # the host pool is full
    with pytest.raises(NoFreeBlocksError, match="needs 1 host blocks but only 0 of 3"):
        bm.swap_out(2)
    assert bm.num_blocks_to_swap_in(1) == 3
    back = bm.swap_in(1)
    assert [h for h, _ in back] == host
    assert tuple(d for _, d in back) == bm.block_table(1)
    assert bm.num_free_host_blocks == 3 and not bm.is_swapped(1)
    bm.check_invariants()
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_prefix_hit_arithmetic_and_never_the_whole_prompt():
    bm = BlockManager(num_blocks=33, block_size=4)
    p = toks(14)  # blocks [0..3] [4..7] [8..11] + 2 tokens
    assert bm.allocate(1, p, 14) == 0
    bm.cache_computed(1, p, 14)
    assert bm.num_cached_blocks == 3  # the partial 4th block is never cached
    # Same 12-token prefix, different tail: 3 blocks = 12 tokens hit.
    q = p[:12] + [7, 7, 7]
    assert bm.match_prefix(q) == 12
    assert bm.num_blocks_to_allocate(q, 15) == 1  # 4 blocks, 3 shared and referenced
    assert bm.allocate(2, q, 15) == 12
    assert bm.block_table(2)[:3] == bm.block_table(1)[:3]
    assert [bm.ref_count(b) for b in bm.block_table(1)[:3]] == [2, 2, 2]
    # A prompt that is exactly the 3 cached blocks: the last token must be computed,
    # so only 2 blocks are served (its own third block is fresh).
    assert bm.match_prefix(p[:12]) == 8
    assert bm.allocate(3, p[:12], 12) == 8
    assert bm.block_table(3)[2] != bm.block_table(1)[2]
    # The hash is chained: the same block content after a different prefix misses.
    r = [9, 9, 9, 9] + p[4:8] + [1]
    assert bm.match_prefix(r) == 0
    assert bm.prefix_cache_queries == 14 + 15 + 12
    assert bm.prefix_cache_hits == 0 + 12 + 8
    bm.check_invariants()


def test_blocks_are_registered_only_once_computed():
    bm = BlockManager(num_blocks=17, block_size=4)
    p = tuple(toks(13))  # one tuple throughout: lookups of it are memoized, must refresh
    bm.allocate(1, p, 13)  # slots for 13 tokens, nothing computed yet
    bm.cache_computed(1, p, 0)
    assert bm.match_prefix(p) == 0
    bm.cache_computed(1, p, 7)  # one full block computed
    assert bm.match_prefix(p) == 4 and bm.num_hashed_blocks(1) == 1
    bm.cache_computed(1, p, 13)
    assert bm.match_prefix(p) == 12
    bm.check_invariants()


def test_freed_cached_blocks_are_reused_then_evicted_in_lru_order():
    bm = BlockManager(num_blocks=10, block_size=4)  # 9 usable
    docs = {s: tuple(toks(9, start=1000 * s)) for s in (1, 2, 3)}  # 2 full blocks + 1 token
    for s, d in docs.items():
        bm.allocate(s, d, 9)
        bm.cache_computed(s, d, 9)
    bm.free(1)
    bm.free(2)
    # Each freed table gave 2 cached blocks to the LRU pool and 1 partial block to the
    # never-cached pool.
    assert bm.num_cached_blocks == 6 and bm.num_free_blocks == 6
    bm.check_invariants()
    # A freed cached prefix is reused: its 2 blocks come back out of the free pool.
    assert bm.num_blocks_to_allocate(docs[2], 9) == 3  # 2 revived + 1 fresh
    assert bm.allocate(4, docs[2], 9) == 8
    bm.free(4)  # doc2's blocks are now more recently used than doc1's
    bm.free(3)  # and doc3's the most recent
    # LRU order: doc1 block 1, doc1 block 0, doc2 block 1, doc2 block 0, doc3 block 1,
    # doc3 block 0 (a table is released last block first, so a prefix head outlives its
    # tail). The 3 never-cached free blocks are used before anything is evicted.
    for s in (5, 6, 7):
        bm.allocate(s, toks(4, start=1000 * s), 4)
    assert bm.num_cached_blocks == 6
    bm.allocate(8, toks(4, start=8000), 4)
    assert bm.match_prefix(docs[1]) == 4 and bm.match_prefix(docs[2]) == 8
    bm.allocate(9, toks(4, start=9000), 4)
    assert bm.match_prefix(docs[1]) == 0 and bm.match_prefix(docs[2]) == 8
    bm.allocate(10, toks(4, start=10000), 4)
    assert bm.match_prefix(docs[2]) == 4 and bm.match_prefix(docs[3]) == 8
    assert bm.num_cached_blocks == 3
    bm.check_invariants()


def test_duplicate_content_is_registered_once_and_freed_cleanly():
    bm = BlockManager(num_blocks=9, block_size=4)
    p = toks(9)
    bm.allocate(1, p, 9)
    bm.allocate(2, p, 9)  # same prompt before anything was computed: no hit
    assert bm.block_table(1)[0] != bm.block_table(2)[0]
    bm.cache_computed(1, p, 9)
    bm.cache_computed(2, p, 9)
    assert bm.num_cached_blocks == 2
    assert not bm.is_cached(bm.block_table(2)[0])
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_prefix_caching_off_counts_nothing():
    bm = BlockManager(num_blocks=9, block_size=4, enable_prefix_caching=False)
    p = toks(9)
    bm.allocate(1, p, 9)
    bm.cache_computed(1, p, 9)
    assert bm.match_prefix(p) == 0 and bm.num_cached_blocks == 0
    bm.free(1)
    assert bm.allocate(2, p, 9) == 0
    assert bm.prefix_cache_queries == 0 and bm.prefix_cache_hits == 0
    bm.check_invariants()


def test_swapped_in_blocks_serve_as_cache_again():
    bm = BlockManager(num_blocks=4, block_size=4, num_host_blocks=3)  # 3 usable
    p = toks(9)
    bm.allocate(1, p, 9)
    bm.cache_computed(1, p, 9)
    bm.swap_out(1)
    bm.allocate(2, toks(12, start=500), 12)  # takes all 3 blocks: the cached ones evicted
    assert bm.match_prefix(p) == 0
    bm.free(2)
    bm.swap_in(1)  # 2 full computed blocks come back with their content
    assert bm.match_prefix(p) == 8
    bm.check_invariants()


def test_check_invariants_catches_corruption():
    bm = BlockManager(num_blocks=5, block_size=4)
    bm.allocate(1, toks(8), 8)
    bm._ref[bm.block_table(1)[0]] += 1  # a reference no table holds
    with pytest.raises(AssertionError, match="refcount 2 != 1"):
        bm.check_invariants()
    bm = BlockManager(num_blocks=5, block_size=4)
    bm._fresh.append(bm._fresh[0])  # a block twice in the free list
    with pytest.raises(AssertionError, match="twice"):
        bm.check_invariants()
