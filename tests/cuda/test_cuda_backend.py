"""CudaPagedAttention.forward for prefill, chunked prefill over cache, decode and mixed batches,
against core.attention.reference_attention; plus the platform's facts on a real GPU.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/cuda``.
"""

from __future__ import annotations

import pytest
import torch

from core.attention import AttentionSpec, build_metadata, reference_attention
from tests.cuda.kv_helpers import TOLERANCE, poisoned_cache, rel_error, slots_for, write_tokens

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def build_batch(spec, seqs, gen, num_blocks=400):
    """seqs: (context_len, new_tokens) per sequence, prefills (new > 1 or ctx == 0) first.

    Returns (query, key, value, cache, metadata, reference output); the context of each
    sequence is already in the NaN-poisoned cache, the new tokens are not.
    """
    hq, hkv, d, bs, dt = spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size, spec.dtype
    cache = poisoned_cache(num_blocks, bs, hkv, d, dt)
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seqs), max(-(-(c + n) // bs) for c, n in seqs), dtype=torch.int32)
    q, k_new, v_new, keys, values, slots = [], [], [], [], [], []
    for i, (ctx, new) in enumerate(seqs):
        nb = -(-(ctx + new) // bs)
        tables[i, :nb] = torch.tensor([pool.pop() for _ in range(nb)], dtype=torch.int32)
        k_all = torch.randn(ctx + new, hkv, d, generator=gen).to(dt)
        v_all = torch.randn(ctx + new, hkv, d, generator=gen).to(dt)
        write_tokens(cache, tables[i], 0, k_all[:ctx], v_all[:ctx])
        q.append(torch.randn(new, hq, d, generator=gen).to(dt))
        k_new.append(k_all[ctx:])
        v_new.append(v_all[ctx:])
        keys.append(k_all)
        values.append(v_all)
        slots.append(slots_for(tables[i], ctx, new, bs))
    num_prefills = sum(1 for c, n in seqs if n > 1 or c == 0)
    q_lens = [n for _, n in seqs]
    query = torch.cat(q)
    md = build_metadata(q_lens, [c for c, _ in seqs], tables.numpy(), bs,
                        num_prefills=num_prefills, device="cuda", slot_mapping=torch.cat(slots).numpy())
    ref = reference_attention(query, keys, values, q_lens, spec.softmax_scale, spec.sliding_window,
                              spec.logits_soft_cap)
    return query.cuda(), torch.cat(k_new).cuda(), torch.cat(v_new).cuda(), cache, md, ref


def make_backend(spec, **kw):
    from platforms.cuda.attention import CudaPagedAttention

    return CudaPagedAttention(spec, **kw)


BATCHES = {
    "prefill": [(0, 37), (0, 5)],
    "chunked_prefill": [(40, 23), (16, 16), (300, 3)],
    "decode": [(70, 1), (5, 1), (600, 1), (1, 1)],
    "mixed": [(0, 37), (40, 23), (70, 1), (5, 1), (1500, 1)],
    # runs of fresh prompts (one varlen flash call each in fp16/bf16) around chunks over cache
    "prompt_runs": [(0, 37), (0, 5), (40, 23), (0, 64), (0, 1), (16, 16), (0, 130), (9, 1)],
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize(
    "dtype,head,bs",
    [(torch.bfloat16, 128, 16), (torch.float16, 64, 32), (torch.float32, 128, 32)],
)
@pytest.mark.parametrize("partition", [None, 0, 64], ids=["auto", "v1", "v2"])
def test_forward_matches_reference(batch, dtype, head, bs, partition):
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=head, dtype=dtype, block_size=bs)
    query, key, value, cache, md, ref = build_batch(spec, BATCHES[batch], torch.Generator().manual_seed(7))
    out = make_backend(spec, decode_partition=partition).forward(query, key, value, cache, md)
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < TOLERANCE[dtype]


def test_forward_with_sliding_window():
    spec = AttentionSpec(num_heads=4, num_kv_heads=4, head_size=64, dtype=torch.float32,
                         block_size=16, sliding_window=24)
    query, key, value, cache, md, ref = build_batch(spec, BATCHES["mixed"], torch.Generator().manual_seed(8))
    out = make_backend(spec).forward(query, key, value, cache, md)
    assert rel_error(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prompt_runs_with_sliding_window(dtype):
    """The varlen flash call's window (bf16; fp32 takes the per-prompt SDPA path) counts the
    query's own position like the reference; GQA 8:2."""
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=128, dtype=dtype,
                         block_size=16, sliding_window=24)
    query, key, value, cache, md, ref = build_batch(spec, BATCHES["prompt_runs"], torch.Generator().manual_seed(9))
    backend = make_backend(spec)
    out = backend.forward(query, key, value, cache, md)
    assert backend._varlen is (dtype == torch.bfloat16)
    assert rel_error(out, ref) < TOLERANCE[dtype]


def test_prompts_from_a_fused_qkv_projection():
    """Query/key/value as the models hand them over: strided views of one fused projection
    (row stride (H + 2 Hkv) x D), not contiguous tensors."""
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, block_size=16)
    query, key, value, cache, md, ref = build_batch(spec, BATCHES["prompt_runs"], torch.Generator().manual_seed(10))
    fused = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)
    q, k, v = fused.split([8 * 64, 2 * 64, 2 * 64], dim=1)
    q, k, v = q.view(-1, 8, 64), k.view(-1, 2, 64), v.view(-1, 2, 64)
    assert not q.is_contiguous()
    out = make_backend(spec).forward(q, k, v, cache, md)
    assert rel_error(out, ref) < TOLERANCE[torch.bfloat16]


def test_backend_refuses_unsupported_layer():
    spec = AttentionSpec(num_heads=4, num_kv_heads=4, head_size=80, dtype=torch.bfloat16,
                         block_size=16)
    with pytest.raises(ValueError, match="head size 80"):
        make_backend(spec)


def test_backend_copy_and_swap():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                         block_size=16)
    backend = make_backend(spec)
    gen = torch.Generator().manual_seed(9)
    caches = [torch.randn(6, 2, 2, 16, 64, generator=gen).to(torch.bfloat16).cuda() for _ in range(2)]
    want = [c.clone() for c in caches]
    for w in want:
        w[4] = w[1]
    backend.copy_blocks(caches, torch.tensor([[1, 4]]))
    assert all(torch.equal(c, w) for c, w in zip(caches, want))
    host = backend.allocate_kv_cache(3, "cpu", pin_memory=True)
    backend.swap_blocks(caches[0], host, torch.tensor([[2, 1]]))
    torch.cuda.synchronize()
    assert torch.equal(host[1], caches[0][2].cpu())


def test_platform_on_gpu():
    import platforms.cuda as plugin
    from core.plugins import Plugins

    plugins = Plugins()
    plugins.register(plugin, "cuda")
    info = plugins.select("cuda")
    assert info.probe.score > 0, info.probe.reason
    platform = info.cls()
    free, total = platform.memory_info()
    assert 0 < free <= total
    assert platform.device_count() >= 1
    assert platform.get_extension("core_C") is torch.ops.core_C
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                         block_size=16)
    backend_cls = platform.attention_backend_class(spec)
    shape = backend_cls.kv_cache_shape(10, 16, 8, 128)
    assert torch.Size(shape).numel() == 2 * 10 * 16 * 8 * 128
