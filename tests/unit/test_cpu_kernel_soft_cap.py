"""Attention-logit soft-capping (Gemma 2) in the CPU csrc kernel, on every ISA path this
machine runs, against core.attention.reference_attention (float64) on fresh seeded inputs:
decode rows and prompts (the kernel serves both), with and without a window, head sizes of
the vector paths (64, 128) and the portable one (40). Scores ~ N(0, 1) against a cap of 1.0:
the cap changes the result, so a kernel ignoring it fails."""

from __future__ import annotations

import pytest
import torch

from core.attention import AttentionMetadata, AttentionSpec, reference_attention
from platforms.cpu.attention import CpuPagedAttentionBackend
from platforms.cpu.kernels import load_kernels
from tests.unit.test_cpu_kernels import _decode_case

KERNELS = load_kernels()
ATOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


@pytest.fixture(params=list(KERNELS.cpu_isas()))
def path(request):
    assert KERNELS.set_cpu_isa(request.param) == request.param
    yield request.param
    KERNELS.set_cpu_isa("auto")


@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 64), (4, 1, 128), (6, 2, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 21])
def test_decode_soft_cap_matches_reference(path, heads, kv_heads, d, dtype, window):
    bs, lens = 16, [1, 17, 64, 150]
    cache, tables, query, keys, values = _decode_case(23, heads, kv_heads, d, bs, lens, dtype)
    query = query * d**0.5 / 8  # scaled scores ~ N(0, 1/64 * d): a cap of 1.0 bites
    spec = AttentionSpec(heads, kv_heads, d, dtype, bs, sliding_window=window, logits_soft_cap=1.0)
    md = AttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decode_tokens=len(lens),
        slot_mapping=torch.full((len(lens),), -1), seq_lens=torch.tensor(lens, dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32) - 1,
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32), block_tables=tables,
        max_query_len=1, max_seq_len=max(lens),
    )
    out = torch.full_like(query, float("nan"))
    CpuPagedAttentionBackend(spec)._decode_into(out, query, cache, md)
    ones = [1] * len(lens)
    want = reference_attention(query, keys, values, ones, spec.softmax_scale, window, 1.0)
    torch.testing.assert_close(out.float(), want.float(), atol=ATOL[dtype], rtol=0)
    plain = reference_attention(query, keys, values, ones, spec.softmax_scale, window)
    assert (plain.float() - want.float()).abs().max() > 10 * ATOL[dtype]


@pytest.mark.parametrize("window", [None, 9])
def test_prompts_soft_capped_through_the_kernel(path, window):
    bs, heads, kv_heads, d = 16, 8, 2, 64
    lens, cached = [40, 70, 7], [0, 33, 0]
    cache, tables, _, keys, values = _decode_case(29, heads, kv_heads, d, bs, lens, torch.float32)
    new = [n - c for n, c in zip(lens, cached)]
    query = torch.randn(sum(new), heads, d, generator=torch.Generator().manual_seed(30))
    spec = AttentionSpec(heads, kv_heads, d, torch.float32, bs, sliding_window=window, logits_soft_cap=0.8)
    slots = torch.tensor(
        [int(tables[i, p // bs]) * bs + p % bs for i in range(len(lens)) for p in range(cached[i], lens[i])]
    )
    md = AttentionMetadata(
        num_prefills=len(lens), num_prefill_tokens=sum(new), num_decode_tokens=0,
        slot_mapping=slots, seq_lens=torch.tensor(lens, dtype=torch.int32),
        context_lens=torch.tensor(cached, dtype=torch.int32),
        query_start_loc=torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32),
        block_tables=tables, max_query_len=max(new), max_seq_len=max(lens),
    )
    out = torch.full_like(query, float("nan"))
    CpuPagedAttentionBackend(spec)._prefill(query, None, None, cache, md, out)
    want = reference_attention(query, keys, values, new, spec.softmax_scale, window, 0.8)
    torch.testing.assert_close(out, want.float(), atol=2e-5, rtol=0)


def test_a_negative_soft_cap_is_refused():
    cache, tables, query, _, _ = _decode_case(12, 4, 2, 64, 16, [20], torch.float32)
    with pytest.raises(RuntimeError, match="logits_soft_cap -1 must be 0"):
        KERNELS.paged_decode(torch.empty_like(query), query, cache, tables,
                             torch.tensor([20], dtype=torch.int32), 0.1, 0, None, -1.0)
