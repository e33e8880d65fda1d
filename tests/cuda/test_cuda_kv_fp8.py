"""The FP8 (e4m3) KV cache on CUDA against the CPU references, on fresh random inputs.

* ``reshape_and_cache`` into a float8_e4m3fn cache writes exactly the codes of
  ``core.quantization.kv_cache.quantize_kv`` computed on the CPU (bytes compared), and only
  at real slots;
* ``paged_decode`` (v1 and v2, every head size, groups of 1 to 8 query heads, bf16/fp16/fp32
  queries) over a cache of random codes of every magnitude matches
  ``core.attention.reference_attention`` (float64, CPU) on the dequantized keys and values;
* the whole backend (write, decode, fresh prompts and chunks over context) matches the CPU
  platform's torch backend over the same fp8 cache.

Head size 128 with fp16/bf16 queries takes the tensor-core kernel (csrc/attention/
paged_decode_fp8_mma.cuh) on sm_80+, every other case the CUDA-core one; both are covered.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/cuda/test_cuda_kv_fp8.py``
(the first test JIT-builds csrc/ unless the prebuilt extension is installed).
"""

from __future__ import annotations

import pytest
import torch

from core.attention import AttentionSpec, build_metadata, reference_attention
from core.quantization.kv_cache import quantize_kv
from tests.cuda.kv_helpers import TOLERANCE, rel_error

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

FP8 = torch.float8_e4m3fn
NAN_CODE = 0x7F  # poison: a code the write op never produces from finite inputs
LENS = [1, 15, 17, 100, 513, 1100]


@pytest.fixture(scope="module")
def ops():
    from platforms.cuda.build import load_ops

    return load_ops()


def poisoned_fp8_cache(num_blocks, bs, hkv, head):
    return torch.full((num_blocks, 2, hkv, bs, head), NAN_CODE, dtype=torch.uint8, device="cuda").view(FP8)


def random_codes(shape, gen):
    """Random e4m3 codes of every magnitude, subnormals included, NaN codes excluded."""
    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x21
    return raw


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head", [64, 128, 256])
@pytest.mark.parametrize("misalign", [0, 1], ids=["aligned", "misaligned"])
def test_reshape_and_cache_writes_the_reference_codes(ops, dtype, head, misalign):
    gen = torch.Generator().manual_seed(21)
    tokens, hq, hkv, bs, num_blocks = 45, 4, 2, 16, 7
    width = (hq + 2 * hkv) * head
    # magnitudes from fp8's subnormals past its range (clamped), in one fused qkv buffer
    mag = torch.logspace(-6, 3, tokens).view(tokens, 1)
    flat = (torch.randn(tokens, width + misalign, generator=gen) * mag).to(dtype)
    qkv = flat[:, misalign:]
    key = qkv[:, hq * head : (hq + hkv) * head].view(tokens, hkv, head)
    value = qkv[:, (hq + hkv) * head :].view(tokens, hkv, head)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:tokens]
    slots[torch.randperm(tokens, generator=gen)[:7]] = -1
    cache = poisoned_fp8_cache(num_blocks, bs, hkv, head)
    k_scale, v_scale = 0.37, 2.5
    ops.reshape_and_cache(key.cuda(), value.cuda(), cache, slots.cuda(), k_scale, v_scale)
    got = cache.view(torch.uint8).cpu()
    real = slots >= 0
    s = slots[real]
    blocks, offs = s // bs, s % bs
    assert torch.equal(got[blocks, 0, :, offs, :], quantize_kv(key[real], k_scale).view(torch.uint8))
    assert torch.equal(got[blocks, 1, :, offs, :], quantize_kv(value[real], v_scale).view(torch.uint8))
    assert int((got == NAN_CODE).sum()) == got.numel() - int(real.sum()) * 2 * hkv * head


def run_fp8_decode(ops, dtype, head, bs, group, partition, lens=LENS, seed=0, window=None, cap=None,
                   poison_tail=False):
    """poison_tail: the unused rows of each sequence's last block hold NaN codes (an unwritten
    cache may), which must not reach the output."""
    gen = torch.Generator().manual_seed(seed)
    hkv, hq = 2, 2 * group
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + 5
    raw = random_codes((num_blocks, 2, hkv, bs, head), gen)
    pool = torch.randperm(num_blocks - 1, generator=gen)[: sum(need)] + 1
    if poison_tail:
        at = 0
        for n, k in zip(lens, need):
            raw[pool[at + k - 1], :, :, n - (k - 1) * bs :, :] = NAN_CODE
            at += k
    cache = raw.cuda().view(FP8)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    k_scale, v_scale = 2.0 ** -8, 0.01
    keys, values, used = [], [], 0
    deq = raw.view(FP8).double()
    for i, n in enumerate(lens):
        tables[i, : need[i]] = pool[used : used + need[i]].int()
        used += need[i]
        pos = torch.arange(n)
        blk, off = tables[i].long()[pos // bs], pos % bs
        keys.append(deq[blk, 0, :, off, :] * k_scale)  # [n, hkv, head]
        values.append(deq[blk, 1, :, off, :] * v_scale)
    query = torch.randn(len(lens), hq, head, generator=gen).to(dtype)
    out = torch.full_like(query, float("nan"), device="cuda")
    scale = head**-0.5
    ops.paged_decode(out, query.cuda(), cache, tables.cuda(), torch.tensor(lens, dtype=torch.int32).cuda(),
                     scale, max(lens), partition, window or 0, cap or 0.0, k_scale, v_scale)
    torch.cuda.synchronize()
    ref = reference_attention(query.double(), keys, values, [1] * len(lens), scale, window, cap)
    return out.cpu(), ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head", [64, 128, 256])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 6, 8])
@pytest.mark.parametrize("partition", [0, 32, 512], ids=["v1", "v2p32", "v2p512"])
def test_fp8_decode_matches_reference(ops, dtype, head, bs, group, partition):
    out, ref = run_fp8_decode(ops, dtype, head, bs, group, partition)
    assert torch.isfinite(out).all(), "unwritten or NaN output rows"
    err = rel_error(out, ref)
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("window,cap", [(100, None), (None, 30.0)])
def test_fp8_decode_window_and_soft_cap(ops, window, cap):
    for partition in (0, 64):
        out, ref = run_fp8_decode(ops, torch.float32, 128, 16, 4, partition, window=window, cap=cap, seed=3)
        assert rel_error(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,cap", [(None, None), (100, None), (None, 30.0), (37, 20.0)])
@pytest.mark.parametrize("group", [4, 8, 12])
def test_fp8_tensor_core_decode_edges(ops, dtype, window, cap, group):
    """Head 128 with 16-bit queries runs the tensor-core kernel (csrc/attention/
    paged_decode_fp8_mma.cuh, on sm_80+): windows and soft caps, groups beyond one 8-head tile,
    and NaN codes in the rows past each sequence's end (they must be zeroed, not multiplied)."""
    for partition in (0, 32, 512):
        out, ref = run_fp8_decode(ops, dtype, 128, 16, group, partition, window=window, cap=cap, seed=5,
                                  poison_tail=True)
        assert torch.isfinite(out).all(), f"NaN output (partition {partition})"
        err = rel_error(out, ref)
        assert err < TOLERANCE[dtype], f"partition {partition}: relative error {err:.2e}"


def test_fp8_scales_change_the_output(ops):
    """Guard against scales that are ignored: the value scale multiplies the output."""
    a, _ = run_fp8_decode(ops, torch.float32, 64, 16, 4, 0, seed=1)
    b, _ = run_fp8_decode(ops, torch.float32, 64, 16, 4, 0, seed=2)
    assert rel_error(a, b) > 0.1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_backend_matches_the_cpu_backend_over_the_same_fp8_cache(dtype, group):
    from platforms.cpu.attention import CpuAttentionBackend
    from platforms.cuda.attention import CudaPagedAttention

    gen = torch.Generator().manual_seed(8)
    spec = AttentionSpec(2 * group, 2, 128, dtype, 16, kv_cache_dtype=FP8, k_scale=0.01, v_scale=0.05)
    cuda, cpu = CudaPagedAttention(spec), CpuAttentionBackend(spec)
    cuda_cache, cpu_cache = cuda.allocate_kv_cache(40, "cuda"), cpu.allocate_kv_cache(40, "cpu")
    codes = random_codes(cuda_cache.shape, gen)
    cuda_cache.view(torch.uint8).copy_(codes)
    cpu_cache.view(torch.uint8).copy_(codes.permute(1, 0, 3, 2, 4))  # [2, blocks, bs, kvh, d]
    tables = [[3, 9, 1, 30], [2, 7, 14], [20, 4, 33], [8, 17]]
    query_lens, context = [37, 12, 1, 1], [0, 20, 40, 31]
    t = sum(query_lens)
    q = torch.randn(t, 2 * group, 128, generator=gen).to(dtype)
    k = torch.randn(t, 2, 128, generator=gen).to(dtype)
    v = torch.randn(t, 2, 128, generator=gen).to(dtype)
    md_cpu = build_metadata(query_lens, context, tables, 16, num_prefills=2)
    md_cuda = build_metadata(query_lens, context, tables, 16, num_prefills=2, device="cuda")
    want = cpu.forward(q, k, v, cpu_cache, md_cpu)
    got = cuda.forward(q.cuda(), k.cuda(), v.cuda(), cuda_cache, md_cuda).cpu()
    assert torch.equal(cuda_cache.view(torch.uint8).cpu().permute(1, 0, 3, 2, 4), cpu_cache.view(torch.uint8))
    assert rel_error(got, want) < 2 * TOLERANCE[dtype]


def test_tiny_llama_on_cuda_with_fp8_kv_agrees_with_the_cpu_fp8_cache(tmp_path):
    """The engine end to end (cache write, graphs, prompts, decode) in fp32 over an fp8 cache on
    both platforms: teacher-forced top-1 agreement, printed; both read the same fp8 values up
    to the rounding of the keys and values that produced them."""
    from core import LLM
    from tests.helpers import tiny_llama_dir
    from tests.integration.test_engine_hf import random_prompts
    from tests.integration.test_kv_fp8_engine import _greedy, _top1

    path = tiny_llama_dir(tmp_path, seed=4, hidden_size=256, intermediate_size=512,
                          num_attention_heads=4, num_key_value_heads=2)  # head 64: the kernels' size
    prompts = random_prompts(8, 512, seed=9, lo=5, hi=60)
    common = dict(model=str(path), dtype="float32", block_size=16, kv_cache_memory="64MiB",
                  kv_cache_dtype="fp8")
    cpu = LLM(platform="cpu", **common)
    seqs = [p + g for p, g in zip(prompts, _greedy(cpu, prompts))]
    want = torch.tensor(sum(_top1(cpu, seqs), []))
    gpu = LLM(platform="cuda", **common)
    assert {c.dtype for c in gpu.engine.executor.runner.kv_caches} == {FP8}
    got = torch.tensor(sum(_top1(gpu, seqs), []))
    rate = float((got == want).float().mean())
    print(f"\nfp8 KV, cuda vs cpu: teacher-forced top-1 agreement {rate:.3f} over {want.numel()} positions")
    assert rate >= 0.9
