"""The CUDA backend's soft-capped prompt path (platforms.cuda.attention.soft_capped_attention)
is plain torch: checked here on CPU against core.attention.reference_attention (float64) on
fresh random inputs, with score chunks small enough that every row range is exercised."""

from __future__ import annotations

import pytest
import torch

from core.attention import reference_attention
from platforms.cuda.attention import soft_capped_attention


@pytest.mark.parametrize("ctx,new", [(0, 23), (40, 9), (7, 1)])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("chunk_bytes", [4 * 3 * 64, 1 << 30], ids=["tiny-chunks", "one-chunk"])
def test_matches_reference(ctx, new, window, chunk_bytes):
    gen = torch.Generator().manual_seed(ctx * 31 + new)
    heads, kv_heads, d, cap, scale = 6, 2, 16, 1.2, 0.3
    total = ctx + new
    q = torch.randn(new, heads, d, generator=gen)
    k = torch.randn(total, kv_heads, d, generator=gen)
    v = torch.randn(total, kv_heads, d, generator=gen)
    rep = heads // kv_heads
    got = soft_capped_attention(
        q.transpose(0, 1),
        k.repeat_interleave(rep, dim=1).transpose(0, 1),
        v.repeat_interleave(rep, dim=1).transpose(0, 1),
        scale, cap, window, max_score_bytes=chunk_bytes,
    ).transpose(0, 1)
    want = reference_attention(q, [k], [v], [new], scale, window, cap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the cap bites at these scores: without it the result is far off
    plain = reference_attention(q, [k], [v], [new], scale, window)
    assert (plain - want).abs().max() > 1e-2


def test_bf16_inputs_give_bf16_close_to_reference():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(4, 10, 32, generator=gen)
    k = torch.randn(4, 30, 32, generator=gen)
    v = torch.randn(4, 30, 32, generator=gen)
    got = soft_capped_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.2, 2.0)
    assert got.dtype == torch.bfloat16
    want = reference_attention(
        q.transpose(0, 1), [k.transpose(0, 1)], [v.transpose(0, 1)], [10], 0.2, None, 2.0
    ).transpose(0, 1)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_the_cuda_backend_takes_gemma_head_size_256_in_16_bit_only():
    from core.attention import AttentionSpec
    from platforms.cuda.attention import check_spec

    for dtype in (torch.bfloat16, torch.float16):
        check_spec(AttentionSpec(8, 4, 256, dtype, 16, logits_soft_cap=50.0, sliding_window=4096))
    with pytest.raises(ValueError, match="head size 256 with a float32 cache"):
        check_spec(AttentionSpec(8, 4, 256, torch.float32, 16))
    with pytest.raises(ValueError, match=r"head size 192 \(supported: \(64, 128, 256\)\)"):
        check_spec(AttentionSpec(8, 4, 192, torch.bfloat16, 16))
