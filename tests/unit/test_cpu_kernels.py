"""The csrc/cpu kernels against independent references on fresh seeded random inputs.

Element-wise ops are checked against core.ops (plain torch, the documented roundings): bf16
results must be bit-identical, fp32/fp16 within a few ulps. Paged decode is checked against
the float64 naive reference in core.attention over shuffled block tables, GQA groups, head
sizes that take the AVX-512 path (64, 128) and the portable one (40, 96), and sliding windows.
The fp32-output matmul is checked against a float64 matmul.
"""

from __future__ import annotations

import pytest
import torch

from core import ops as reference
from core.attention import AttentionSpec, build_metadata, reference_attention
from platforms.cpu.attention import CpuAttentionBackend, CpuPagedAttentionBackend
from platforms.cpu.kernels import load_kernels
from platforms.cpu.ops import CpuOps

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Same values as the reference up to float32 summation order (and, for fp16, one rounding).
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (0, 0), torch.float16: (2e-3, 2e-3)}


@pytest.fixture(scope="module")
def ops() -> CpuOps:
    return CpuOps(load_kernels())


def rand(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_match_reference(ops: CpuOps, dtype: torch.dtype) -> None:
    x, res, w = rand(5, 3, 96, seed=1, dtype=dtype), rand(5, 3, 96, seed=2, dtype=dtype), rand(96, seed=3, dtype=dtype)
    close(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), dtype)
    strided = rand(7, 200, seed=4, dtype=dtype)[:, 8:104]  # rows of a wider tensor
    close(ops.rms_norm(strided, w, 1e-5), reference.rms_norm(strided, w, 1e-5), dtype)
    out, new_res = ops.fused_add_rms_norm(x, res, w, 1e-5)
    want_out, want_res = reference.fused_add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(new_res, want_res, atol=0, rtol=0)  # one rounding of x + res
    close(out, want_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(ops: CpuOps, dtype: torch.dtype) -> None:
    # Wide range: silu's exp must hold from deep negatives (-> 0) to large positives.
    x = rand(9, 2 * 200, seed=5, dtype=dtype, scale=12.0)
    close(ops.silu_and_mul(x), reference.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_matches_reference_on_qkv_views(ops: CpuOps, dtype: torch.dtype, rotary_dim: int) -> None:
    tokens, heads, kv_heads, d = 6, 4, 2, 64
    qkv = rand(tokens, (heads + 2 * kv_heads) * d, seed=6, dtype=dtype)
    q = qkv[:, : heads * d].view(tokens, heads, d)  # strided views, as the model passes them
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d)
    positions = torch.randint(0, 500, (tokens,), generator=torch.Generator().manual_seed(7))
    inv = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    angles = torch.arange(512).float()[:, None] * inv
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    got = ops.rotary_embedding(positions, q, k, cache, rotary_dim)
    want = reference.rotary_embedding(positions, q, k, cache, rotary_dim)
    for g, w in zip(got, want):
        close(g, w, dtype)


def test_rotary_rejects_positions_outside_the_table(ops: CpuOps) -> None:
    q, k = rand(2, 2, 8, seed=8), rand(2, 1, 8, seed=9)
    cache = rand(16, 8, seed=10)
    with pytest.raises(RuntimeError, match="position 16 is outside the rotary table"):
        ops.rotary_embedding(torch.tensor([3, 16]), q, k, cache, 8)


# ---- paged decode ------------------------------------------------------------------------


def _decode_case(seed: int, heads: int, kv_heads: int, d: int, bs: int, lens: list[int], dtype):
    """A cache of shuffled blocks holding random keys/values for each sequence."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // bs) for n in lens]
    num_blocks = sum(per_seq) + 3
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 unused
    cache = torch.randn(2, num_blocks, bs, kv_heads, d, generator=g).to(dtype)
    tables = torch.zeros(len(lens), max(per_seq) + 1, dtype=torch.int32)  # a spare column
    keys, values = [], []
    for i, n in enumerate(lens):
        blocks = [order.pop() for _ in range(per_seq[i])]
        tables[i, : len(blocks)] = torch.tensor(blocks)
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)])
        flat = cache.view(2, -1, kv_heads, d)
        keys.append(flat[0, slots])
        values.append(flat[1, slots])
    query = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    return cache, tables, query, keys, values


@pytest.mark.parametrize(
    "heads,kv_heads,d",
    [(9, 3, 64), (8, 1, 128), (4, 4, 64), (6, 2, 40), (16, 2, 96), (12, 1, 64)],
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 21])
def test_paged_decode_matches_naive_reference(heads, kv_heads, d, dtype, window) -> None:
    bs, lens = 16, [1, 17, 64, 150, 5]
    cache, tables, query, keys, values = _decode_case(11, heads, kv_heads, d, bs, lens, dtype)
    spec = AttentionSpec(heads, kv_heads, d, dtype, bs, sliding_window=window)
    md = build_metadata([1] * len(lens), [n - 1 for n in lens], tables.numpy(), bs, num_prefills=0,
                        slot_mapping=[-1] * len(lens))  # the keys are in the cache already
    out = torch.empty_like(query)
    CpuPagedAttentionBackend(spec)._decode_into(out, query, cache, md)
    want = reference_attention(query, keys, values, [1] * len(lens), spec.softmax_scale, window)
    # Computed in fp32 from the stored values: off the float64 reference by the output rounding.
    atol = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 1, 128), (6, 2, 40)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 21])
def test_prompts_through_the_kernel_match_naive_reference(heads, kv_heads, d, dtype, window) -> None:
    """CpuPagedAttentionBackend._prefill: prompts with and without cached context, each
    token attending causally to its prefix (table_rows maps token rows to table rows)."""
    bs = 16
    lens, cached = [40, 150, 7, 64], [0, 100, 0, 33]  # total lengths, positions already cached
    cache, tables, _, keys, values = _decode_case(17, heads, kv_heads, d, bs, lens, dtype)
    new = [n - c for n, c in zip(lens, cached)]
    query = torch.randn(sum(new), heads, d, generator=torch.Generator().manual_seed(18)).to(dtype)
    spec = AttentionSpec(heads, kv_heads, d, dtype, bs, sliding_window=window)
    # slots: where each new token's key already sits (forward writes first)
    md = build_metadata(new, cached, tables.numpy(), bs, num_prefills=len(lens))
    out = torch.full_like(query, float("nan"))
    CpuPagedAttentionBackend(spec)._prefill(query, None, None, cache, md, out)
    want = reference_attention(query, keys, values, new, spec.softmax_scale, window)
    atol = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=0)


def test_trailing_padding_rows_of_a_prompt_stay_in_bounds() -> None:
    """Padding rows (negative slots) after a prompt's tokens, positioned past its block
    table: their output is unspecified, but they must not fail or disturb the real rows."""
    bs, n, pad = 16, 32, 17
    cache, tables, _, keys, values = _decode_case(19, 4, 2, 64, bs, [n], torch.float32)
    query = torch.randn(n + pad, 4, 64, generator=torch.Generator().manual_seed(20))
    slots = torch.tensor([int(tables[0, p // bs]) * bs + p % bs for p in range(n)] + [-1] * pad)
    md = build_metadata([n + pad], [0], tables.numpy(), bs, num_prefills=1, slot_mapping=slots)
    out = torch.full_like(query, float("nan"))
    CpuPagedAttentionBackend(AttentionSpec(4, 2, 64, torch.float32, bs))._prefill(query, None, None, cache, md, out)
    want = reference_attention(query[:n], keys, values, [n], 1 / 8)
    torch.testing.assert_close(out[:n], want, atol=2e-5, rtol=0)


def test_paged_decode_rejects_a_table_row_outside_the_tables() -> None:
    cache, tables, query, _, _ = _decode_case(12, 4, 2, 64, 16, [20, 9], torch.float32)
    out = torch.empty_like(query)
    lens, rows = torch.tensor([20, 9], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="table row 2 of query row 1 is outside"):
        load_kernels().paged_decode(out, query, cache, tables, lens, 0.1, 0, rows)


def test_paged_decode_rejects_a_block_outside_the_cache() -> None:
    cache, tables, query, _, _ = _decode_case(12, 4, 2, 64, 16, [20], torch.float32)
    tables[0, 1] = cache.shape[1]
    out = torch.empty_like(query)
    with pytest.raises(RuntimeError, match=f"block {cache.shape[1]} of table row 0 is outside"):
        load_kernels().paged_decode(out, query, cache, tables, torch.tensor([20], dtype=torch.int32), 0.1, 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_stores_rows_and_skips_padding(dtype: torch.dtype) -> None:
    spec = AttentionSpec(4, 2, 64, dtype, 16)
    paged, plain = CpuPagedAttentionBackend(spec), CpuAttentionBackend(spec)
    caches = [b.allocate_kv_cache(6, "cpu").fill_(-3.0) for b in (paged, plain)]
    kv = rand(5, 2 * 2 * 64 + 64, seed=13, dtype=dtype)  # key/value as strided views of one row
    key, value = kv[:, :128].view(5, 2, 64), kv[:, 128:256].view(5, 2, 64)
    slots = torch.tensor([17, -1, 3, 95, -5])
    for backend, cache in zip((paged, plain), caches):
        backend.write_kv(key, value, cache, slots)
    torch.testing.assert_close(caches[0], caches[1], atol=0, rtol=0)
    assert int((caches[0] != -3.0).sum()) == 3 * 2 * 2 * 64  # three real rows, keys and values


# ---- fp32-output matmul (the LM head) --------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("k", [64, 72])  # 72: not a multiple of 32, the portable path
def test_lm_head_is_float32_exact(ops: CpuOps, dtype: torch.dtype, rows: int, k: int) -> None:
    hidden, weight = rand(rows, k, seed=14, dtype=dtype), rand(1030, k, seed=15, dtype=dtype)
    got = ops.lm_head(hidden, weight)
    want = hidden.double() @ weight.double().T
    assert got.dtype == torch.float32 and got.shape == (rows, 1030)
    # Products of 16-bit values are exact in fp32; only fp32 accumulation error remains, far
    # below the bf16 rounding (~0.03 here) that the reference's bf16 matmul would add.
    torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-5)


def test_lm_head_keeps_the_reference_for_float32(ops: CpuOps) -> None:
    hidden, weight = rand(3, 64, seed=16), rand(50, 64, seed=17)
    torch.testing.assert_close(ops.lm_head(hidden, weight), reference.lm_head(hidden, weight), atol=0, rtol=0)


def test_platform_picks_the_kernels_and_still_offers_plain_torch() -> None:
    from platforms.cpu.platform import CpuPlatform

    platform, spec = CpuPlatform(), AttentionSpec(4, 2, 64, torch.bfloat16, 16)
    assert platform.attention_backend_class(spec) is CpuPagedAttentionBackend
    assert platform.attention_backend_class(spec, "cpu_sdpa") is CpuAttentionBackend
    with pytest.raises(ValueError, match=r"it has \['cpu_paged', 'cpu_sdpa'\]"):
        platform.attention_backend_class(spec, "flash")
    assert set(platform.ops()) == {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "lm_head"}
