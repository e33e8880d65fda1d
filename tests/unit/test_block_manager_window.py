"""BlockManager with a sliding window: blocks that slid out of the window are released.

Block size 4, window 6: a token at position p attends to positions > p - 6, so once the
next position to compute is n, blocks wholly before ``n - 5`` are dead.
"""

from __future__ import annotations

import pytest

from core.block_manager import DROPPED, NULL_BLOCK, BlockManager


def grow(bm: BlockManager, seq: int, start: int, end: int, step: int = 1) -> None:
    """Compute positions [start, end) ``step`` tokens at a time, as the scheduler would."""
    for n in range(start, end, step):
        bm.append_slots(seq, n, min(end, n + step))
        bm.check_invariants()


def live(bm: BlockManager, seq: int) -> list[int]:
    return [b for b in bm.block_table(seq) if b != NULL_BLOCK]


def test_a_long_sequence_holds_a_bounded_number_of_blocks():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, sliding_window=6)
    bm.allocate(1, list(range(5)), 5)
    grow(bm, 1, 5, 200)  # 200 positions would need 50 blocks; the pool has 7
    table = bm.block_table(1)
    assert len(table) == 50
    # next position 200 sees back to 195: blocks 48 (192-195) and 49 (196-199) stay
    assert table[:48] == (NULL_BLOCK,) * 48 and NULL_BLOCK not in table[48:]
    assert bm.num_free_blocks == 7 - 2
    bm.free(1)
    bm.check_invariants()
    assert bm.num_free_blocks == 7


def test_without_a_window_nothing_is_dropped():
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    bm.allocate(1, list(range(5)), 5)
    grow(bm, 1, 5, 100)
    assert NULL_BLOCK not in bm.block_table(1)


def test_chunks_keep_the_window_before_their_first_token():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False, sliding_window=6)
    bm.allocate(1, list(range(8)), 8)
    bm.append_slots(1, 8, 20)  # position 8 sees back to 3: block 0 (0-3) still needed
    assert NULL_BLOCK not in bm.block_table(1)
    bm.append_slots(1, 20, 24)  # position 20 sees back to 15: blocks 0-2 dead
    assert bm.block_table(1)[:3] == (NULL_BLOCK,) * 3 and NULL_BLOCK not in bm.block_table(1)[3:]
    bm.check_invariants()


def test_fork_shares_live_blocks_and_dropping_in_one_keeps_the_others():
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=False, sliding_window=6)
    bm.allocate(1, list(range(10)), 10)
    grow(bm, 1, 10, 14)
    bm.fork(1, 2)
    before = live(bm, 1)
    grow(bm, 1, 14, 30)
    bm.check_invariants()
    # sequence 2 still holds every block it shared, whatever 1 released
    assert live(bm, 2) == before and all(bm.ref_count(b) >= 1 for b in before)
    grow(bm, 2, 14, 30)
    for seq in (1, 2):
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_swap_out_and_in_skip_dropped_blocks():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True,
                      num_host_blocks=4, sliding_window=6)
    tokens = list(range(40))
    bm.allocate(1, tokens, 5)
    grow(bm, 1, 5, 40)
    kept = live(bm, 1)
    assert len(kept) <= 3 and bm.can_swap_out(1)  # 10 table entries, only the live ones move
    out = bm.swap_out(1)
    assert [d for d, _ in out] == kept
    assert sum(b != DROPPED for b in bm._host_tables[1]) == len(kept)
    bm.check_invariants()
    assert bm.num_blocks_to_swap_in(1) == len(kept)
    back = bm.swap_in(1)
    table = bm.block_table(1)
    assert len(back) == len(kept) and [d for _, d in back] == live(bm, 1)
    assert table[: 10 - len(kept)] == (NULL_BLOCK,) * (10 - len(kept))
    bm.check_invariants()
    grow(bm, 1, 40, 48)  # dropping continues where it stopped
    bm.free(1)
    bm.check_invariants()
    assert bm.num_free_host_blocks == 4 and bm.num_free_blocks == bm.num_usable_blocks


def test_prefix_cache_hashes_chain_over_dropped_blocks():
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True, sliding_window=6)
    tokens = list(range(24))
    bm.allocate(1, tokens, 4)
    for n in range(4, 24, 4):
        bm.cache_computed(1, tokens, n)
        bm.append_slots(1, n, n + 4)
        bm.check_invariants()
    bm.cache_computed(1, tokens, 24)
    assert bm.num_hashed_blocks(1) == 6  # every full block hashed, dropped ones included
    bm.free(1)
    # dropped blocks went back to the LRU pool still registered: a new sequence reuses them
    assert bm.match_prefix(tokens + [99]) == 24


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="sliding_window must be >= 1 or None, got 0"):
        BlockManager(num_blocks=4, block_size=4, sliding_window=0)


# ---- window-aware admission ------------------------------------------------------------------


@pytest.mark.parametrize("bs,window,step,held", [
    (4, 6, 1, 3),     # a step at 196 needs 191..196: blocks 47 (188-191), 48, 49
    (4, 6, 4, 3),     # 4 new tokens from 196 need 191..199: still blocks 47..49
    (16, 16, 24, 4),  # the Mistral engine test's numbers: 15 + 24 positions from offset 15
    (16, 4096, 2048, 385),  # (15 + 4095 + 2048) / 16 rounded up
])
def test_window_blocks_bound_by_hand(bs, window, step, held):
    from core.block_manager import window_blocks_bound

    assert window_blocks_bound(10**6, bs, window, step) == held
    assert window_blocks_bound(5, bs, window, step) == -(-5 // bs)  # short: all its blocks
    assert window_blocks_bound(10**6, bs, None, step) == -(-(10**6) // bs)


@pytest.mark.parametrize("bs,window,step", [(4, 6, 1), (4, 6, 3), (4, 5, 7), (16, 16, 24), (8, 3, 2)])
def test_blocks_held_never_exceed_the_bound(bs, window, step):
    bm = BlockManager(num_blocks=64, block_size=bs, enable_prefix_caching=False, sliding_window=window)
    bound = bm.max_blocks_held(400, step)
    bm.allocate(1, list(range(step)), step)
    peak = len(live(bm, 1))
    for n in range(step, 400, step):
        bm.append_slots(1, n, min(400, n + step))
        peak = max(peak, len(live(bm, 1)))
    assert peak <= bound < -(-400 // bs)
    assert peak >= bound - 1  # and it is nearly reached, not a loose guess


def test_prefix_hits_before_the_window_are_not_revived():
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True, sliding_window=6)
    tokens = list(range(41))
    bm.allocate(1, tokens, 40)
    bm.cache_computed(1, tokens, 40)
    bm.free(1)  # 10 full blocks registered, all free in the LRU pool
    assert bm.match_prefix(tokens) == 40
    # position 40 sees back to 35: only blocks 8 (32-35) and 9 (36-39) are read again
    assert bm.num_blocks_to_allocate(tokens, 40) == 2
    free_before = bm.num_free_blocks
    assert bm.allocate(2, tokens, 40) == 40
    assert bm.block_table(2)[:8] == (NULL_BLOCK,) * 8 and NULL_BLOCK not in bm.block_table(2)[8:]
    assert bm.num_free_blocks == free_before - 2
    bm.check_invariants()
    bm.append_slots(2, 40, 41)
    bm.check_invariants()
    bm.free(2)
    bm.check_invariants()


def test_swap_in_needs_only_live_blocks_plus_the_step():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False,
                      num_host_blocks=8, sliding_window=6)
    bm.allocate(1, list(range(5)), 5)
    grow(bm, 1, 5, 100)  # 25 table entries, 2 live
    bm.swap_out(1)
    assert bm.num_blocks_to_swap_in(1) == 2
    assert bm.num_blocks_to_swap_in_and_append(1, 100) == 2
    assert bm.num_blocks_to_swap_in_and_append(1, 101) == 3  # position 100 opens block 25
    bm.swap_in(1)
    bm.append_slots(1, 100, 101)
    assert len(live(bm, 1)) <= 3
    bm.check_invariants()


def test_without_a_window_swap_in_and_append_is_the_whole_table():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False, num_host_blocks=16)
    bm.allocate(1, list(range(10)), 10)
    bm.swap_out(1)
    assert bm.num_blocks_to_swap_in_and_append(1, 11) == 3
    assert bm.num_blocks_to_swap_in_and_append(1, 13) == 4


def test_kv_plan_under_a_window_needs_window_plus_one_step():
    from core.kv_plan import plan_kv_cache

    # (16 - 1) + (256 - 1) + 512 positions from a block's last offset: ceil(782 / 16) = 49
    kw = dict(budget_bytes=0, bytes_per_block=1024, block_size=16, max_model_len=4096)
    plan = plan_kv_cache(**kw, num_blocks_override=50, sliding_window=256, max_step_tokens=512)
    assert plan.blocks_per_max_len_seq == 49 and plan.max_concurrent_at_max_len == 1
    assert "sliding window 256: such a sequence holds at most 49 blocks" in plan.describe()
    with pytest.raises(ValueError, match="needs 256 blocks of 16 tokens"):
        plan_kv_cache(**kw, num_blocks_override=50)  # no window: the whole 4096 tokens
    with pytest.raises(ValueError, match="needs 49 blocks .* or lower --max-num-batched-tokens"):
        plan_kv_cache(**kw, num_blocks_override=49, sliding_window=256, max_step_tokens=512)
