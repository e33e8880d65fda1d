"""The refusal of a KV budget too small for one sequence: it names the numbers and offers
only fixes that help (issue 17: the text once read "holds no sequence at all or raise")."""

from __future__ import annotations

import pytest

from core.kv_plan import plan_kv_cache


def test_some_blocks_offers_a_shorter_max_model_len_or_a_bigger_budget():
    # 5 blocks of 16 tokens: 4 usable (64 tokens) after the null block; 512 tokens need 32 + 1
    with pytest.raises(ValueError) as info:
        plan_kv_cache(budget_bytes=5 * 1024, bytes_per_block=1024, block_size=16, max_model_len=512)
    msg = str(info.value)
    assert "max_model_len 512 needs 32 blocks of 16 tokens" in msg and "holds 5 blocks" in msg
    assert "lower --max-model-len to at most 64 or raise --kv-cache-memory" in msg
    assert "to at least 33.00 KiB" in msg


def test_no_usable_block_offers_only_a_bigger_budget():
    with pytest.raises(ValueError) as info:
        plan_kv_cache(budget_bytes=512, bytes_per_block=1024, block_size=16, max_model_len=512)
    msg = str(info.value)
    assert "holds 0 blocks" in msg and "--max-model-len to" not in msg
    assert msg.endswith("To fix: raise --kv-cache-memory (or, on a GPU, --gpu-memory-utilization) to at least 33.00 KiB")
