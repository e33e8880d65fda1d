"""The FP8 KV cache on the CPU platform: the flag, the refusals, the cache write and read of
both CPU backends against plain-torch references, and the per-layer checkpoint scales.

References are written here from the format's definition (docs/quantization.md, "FP8 KV
cache"): codes ``fp8_e4m3(clamp(x * float32(1 / scale), -448, 448))`` by torch's own
conversion, read back as ``codes.float() * scale``; attention over those dequantized values by
:func:`core.attention.reference_attention` (float64).
"""

from __future__ import annotations

import json

import pytest
import torch

from core.attention import AttentionBackend, AttentionSpec, build_metadata, reference_attention
from core.engine_args import EngineArgs
from core.quantization.kv_cache import (
    KVCacheFormat,
    checkpoint_kv_scales,
    normalize_kv_cache_dtype,
    resolve_kv_cache_dtype,
)
from platforms.cpu.attention import CpuAttentionBackend, CpuPagedAttentionBackend
from platforms.cpu.platform import CpuPlatform

FP8 = torch.float8_e4m3fn
BACKENDS = [CpuAttentionBackend, CpuPagedAttentionBackend]


def ref_codes(x: torch.Tensor, scale: float) -> torch.Tensor:
    inv = torch.tensor(1.0 / scale, dtype=torch.float32)
    return torch.clamp(x.float() * inv, -448.0, 448.0).to(FP8)


def fp8_spec(dtype=torch.float32, heads=4, kv_heads=2, head=64, block=16, k_scale=0.05, v_scale=0.02,
             window=None, cap=None) -> AttentionSpec:
    return AttentionSpec(heads, kv_heads, head, dtype, block, sliding_window=window, logits_soft_cap=cap,
                         kv_cache_dtype=FP8, k_scale=k_scale, v_scale=v_scale)


# ---- the flag and where it is refused --------------------------------------------------------


def test_flag_values():
    assert normalize_kv_cache_dtype("auto") == "auto"
    assert normalize_kv_cache_dtype("fp8") == "fp8_e4m3"
    assert normalize_kv_cache_dtype("fp8_e4m3") == "fp8_e4m3"
    with pytest.raises(ValueError, match=r"fp8_e5m2.*e5m2 format .* not implemented.*fp8 \(= fp8_e4m3"):
        normalize_kv_cache_dtype("fp8_e5m2")
    with pytest.raises(ValueError, match=r"--kv-cache-dtype.*'int8'"):
        EngineArgs(kv_cache_dtype="int8")


def _platform_classes():
    from platforms.cuda.platform import CudaPlatform
    from platforms.hpu.platform import HpuPlatform
    from platforms.rocm.platform import RocmPlatform
    from platforms.tpu.platform import TpuPlatform
    from platforms.xpu.platform import XpuPlatform

    return {c.name: c for c in (CpuPlatform, CudaPlatform, RocmPlatform, XpuPlatform, TpuPlatform, HpuPlatform)}


@pytest.mark.parametrize("name", ["rocm", "xpu", "tpu", "hpu"])
def test_platforms_without_fp8_kv_refuse_naming_those_with(name):
    classes = _platform_classes()
    with pytest.raises(ValueError, match=rf"fp8 is not supported by platform '{name}'.*\['cpu', 'cuda'\]"):
        resolve_kv_cache_dtype("fp8", classes[name], classes)
    assert resolve_kv_cache_dtype("auto", classes[name], classes) == "auto"


@pytest.mark.parametrize("name", ["cpu", "cuda"])
def test_platforms_with_fp8_kv_accept(name):
    assert resolve_kv_cache_dtype("fp8", _platform_classes()[name]) == "fp8_e4m3"


def test_backend_without_fp8_support_refuses_the_spec():
    class Plain(CpuAttentionBackend):
        name = "plain"
        supports_fp8_kv_cache = False

    with pytest.raises(ValueError, match=r"'plain' cannot keep a torch.float8_e4m3fn KV cache"):
        Plain(fp8_spec())
    assert issubclass(Plain, AttentionBackend)


# ---- cache writes --------------------------------------------------------------------------


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_the_reference_codes(backend_cls, dtype):
    g = torch.Generator().manual_seed(3)
    spec = fp8_spec(dtype, k_scale=0.03, v_scale=0.7)
    backend = backend_cls(spec)
    cache = backend.allocate_kv_cache(6, "cpu")
    assert cache.dtype == FP8 and cache.shape == (2, 6, 16, 2, 64)
    n = 20
    # keys spanning fp8's normal and subnormal ranges and past 448 * scale (clamped)
    key = (torch.randn(n, 2, 64, generator=g) * torch.logspace(-5, 1.5, n).view(n, 1, 1)).to(dtype)
    value = (torch.randn(n, 2, 64, generator=g) * 300).to(dtype)
    slots = torch.randperm(6 * 16, generator=g)[:n]
    slots[[4, 11]] = -1  # padding rows: never written
    backend.write_kv(key, value, cache, slots)
    flat = cache.view(torch.uint8).view(2, -1, 2, 64)
    keep = slots >= 0
    assert torch.equal(flat[0, slots[keep]], ref_codes(key[keep], 0.03).view(torch.uint8))
    assert torch.equal(flat[1, slots[keep]], ref_codes(value[keep], 0.7).view(torch.uint8))
    untouched = torch.ones(96, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert int(flat[:, untouched].count_nonzero()) == 0


def test_kernel_write_rounds_like_torch_on_ties_and_subnormals():
    """Every fp8 grid midpoint (a tie, rounded to even) and points just beside it."""
    codes = torch.arange(256, dtype=torch.uint8)
    grid = codes.view(FP8).float()
    grid = torch.sort(grid[torch.isfinite(grid)]).values.unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([mids, torch.nextafter(mids, grid[1:]), torch.nextafter(mids, grid[:-1]), grid])
    x = torch.cat([x, torch.tensor([1e4, -1e4, 449.0, -500.0])])
    rows = -(-x.numel() // 64)
    x = torch.nn.functional.pad(x, (0, rows * 64 - x.numel())).view(rows, 1, 64)
    backend = CpuPagedAttentionBackend(fp8_spec(kv_heads=1, heads=1, k_scale=1.0, v_scale=1.0))
    cache = backend.allocate_kv_cache(rows, "cpu")
    backend.write_kv(x, x, cache, torch.arange(rows) * 16)
    got = cache.view(torch.uint8)[0, :, 0, 0]
    assert torch.equal(got, ref_codes(x[:, 0], 1.0).view(torch.uint8))


# ---- attention over an fp8 cache ------------------------------------------------------------


def _cached_logical(cache, table, length, spec):
    """Dequantized keys/values of positions [0, length) as the reference reads them."""
    bs = spec.block_size
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(length)])
    flat = cache.view(2, -1, spec.num_kv_heads, spec.head_size)
    k = flat[0, slots].float() * spec.k_scale
    v = flat[1, slots].float() * spec.v_scale
    return k, v


def _isas():
    from platforms.cpu.kernels import kernels_or_none

    kernels = kernels_or_none()
    return list(kernels.cpu_isas()) if kernels is not None else ["none"]


@pytest.fixture(params=_isas())
def isa(request):
    """Each instruction-set path of the CPU kernels this machine runs, in turn."""
    if request.param == "none":
        yield None
        return
    from platforms.cpu.kernels import load_kernels

    assert load_kernels().set_cpu_isa(request.param) == request.param
    yield request.param
    load_kernels().set_cpu_isa("auto")


CASES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
WINDOWS = pytest.mark.parametrize("window,cap", [(None, None), (21, None), (None, 30.0)])
HEADS = pytest.mark.parametrize("head,group", [(64, 4), (128, 2), (48, 3)])


@CASES
@WINDOWS
@HEADS
def test_kernel_backend_mixed_batch_matches_reference(dtype, window, cap, head, group, isa):
    """On every ISA path this CPU runs (head 48 has no vector path: the portable one runs)."""
    _check_mixed_batch(CpuPagedAttentionBackend, dtype, window, cap, head, group)


@CASES
@WINDOWS
@HEADS
def test_torch_backend_mixed_batch_matches_reference(dtype, window, cap, head, group):
    _check_mixed_batch(CpuAttentionBackend, dtype, window, cap, head, group)


def _check_mixed_batch(backend_cls, dtype, window, cap, head, group):
    """A fresh prompt, a chunk over cached context and two decodes in one step; the cache's
    untouched parts hold random codes of every magnitude (subnormals included)."""
    g = torch.Generator().manual_seed(11)
    spec = fp8_spec(dtype, heads=2 * group, kv_heads=2, head=head, block=16, k_scale=0.004, v_scale=0.01,
                    window=window, cap=cap)
    backend = backend_cls(spec)
    cache = backend.allocate_kv_cache(24, "cpu")
    raw = torch.randint(0, 256, cache.shape, generator=g, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x11  # no NaN codes: a cache written from finite values has none
    cache.view(torch.uint8).copy_(raw)
    tables = [[5, 9, 1], [2, 7, 14, 3], [20, 4], [8, 17, 11]]
    query_lens, context = [19, 13, 1, 1], [0, 30, 27, 40]
    md = build_metadata(query_lens, context, tables, 16, num_prefills=2)
    t = sum(query_lens)
    query = torch.randn(t, 2 * group, head, generator=g).to(dtype)
    key = torch.randn(t, 2, head, generator=g).to(dtype)
    value = torch.randn(t, 2, head, generator=g).to(dtype)
    out = backend.forward(query, key, value, cache, md)
    keys, values = zip(*(_cached_logical(cache, tb, c + q, spec) for tb, c, q in zip(tables, context, query_lens)))
    expected = reference_attention(query.double(), list(keys), list(values), query_lens, spec.softmax_scale,
                                   window, cap)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    # and the step's own keys went in as the reference codes
    assert torch.equal(cache.view(torch.uint8)[0].view(-1, 2, head)[md.slot_mapping],
                       ref_codes(key, spec.k_scale).view(torch.uint8))


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_block_moves_on_an_fp8_cache(backend_cls):
    backend = backend_cls(fp8_spec())
    g = torch.Generator().manual_seed(5)
    a = backend.allocate_kv_cache(5, "cpu")
    a.view(torch.uint8).copy_(torch.randint(0, 127, a.shape, generator=g, dtype=torch.uint8))
    before = a.view(torch.uint8).clone()
    backend.copy_blocks([a], torch.tensor([[1, 3], [4, 0]]))
    assert torch.equal(a.view(torch.uint8)[:, 3], before[:, 1])
    assert torch.equal(a.view(torch.uint8)[:, 0], before[:, 4])
    host = backend.allocate_kv_cache(2, "cpu")
    backend.swap_blocks(a, host, torch.tensor([[2, 1]]))
    assert torch.equal(host.view(torch.uint8)[:, 1], before[:, 2])


def test_kv_format_sets_per_layer_scales_on_specs():
    fmt = KVCacheFormat(FP8, {1: (0.5, 0.25)})
    base = AttentionSpec(4, 2, 64, torch.bfloat16, 16)
    s0, s1 = fmt.spec_for(base, 0), fmt.spec_for(base, 1)
    assert (s0.cache_dtype, s0.k_scale, s0.v_scale) == (FP8, 1.0, 1.0)
    assert (s1.k_scale, s1.v_scale) == (0.5, 0.25)
    assert KVCacheFormat().spec_for(base, 1) is base
    with pytest.raises(ValueError, match=r"scales for layers \[1\].*1 attention layers"):
        fmt.check_layers(1)


# ---- scales from a checkpoint ---------------------------------------------------------------


class _Cfg:
    def __init__(self, path, qconfig=None):
        self.model, self.gguf_file, self.load_format = str(path), None, "safetensors"
        self.hf_config = type("C", (), {"quantization_config": qconfig})()


def _write(path, tensors, index=False):
    from safetensors.torch import save_file

    path.mkdir(exist_ok=True)
    save_file(tensors, path / "model-00001-of-00001.safetensors")
    if index:
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": dict.fromkeys(tensors, "model-00001-of-00001.safetensors")}))


@pytest.mark.parametrize("index", [False, True])
def test_checkpoint_scales_in_each_published_naming(tmp_path, index):
    t = torch.tensor
    _write(tmp_path / "m", {
        "model.layers.0.self_attn.k_scale": t(0.5), "model.layers.0.self_attn.v_scale": t([0.25]),
        "model.layers.1.self_attn.k_proj.output_scale": t([2.0]),
        "model.layers.1.self_attn.v_proj.output_scale": t([4.0], dtype=torch.bfloat16),
        "model.layers.2.self_attn.k_proj.k_scale": t(0.125), "model.layers.2.self_attn.v_proj.v_scale": t(8.0),
        "model.layers.3.self_attn.kv_scale": t([0.75]),
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2),
    }, index)
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    scales = checkpoint_kv_scales(_Cfg(tmp_path / "m", {"quant_method": "compressed-tensors",
                                                       "kv_cache_scheme": scheme}))
    assert scales == {0: (0.5, 0.25), 1: (2.0, 4.0), 2: (0.125, 8.0), 3: (0.75, 0.75)}


def test_checkpoint_scale_problems_are_refused(tmp_path):
    t = torch.tensor
    _write(tmp_path / "a", {"model.layers.0.self_attn.k_scale": t(0.5)})
    with pytest.raises(ValueError, match=r"layer 0's keys but none for its values"):
        checkpoint_kv_scales(_Cfg(tmp_path / "a"))
    _write(tmp_path / "b", {"model.layers.0.self_attn.k_scale": t([0.5, 0.2]),
                            "model.layers.0.self_attn.v_scale": t(1.0)})
    with pytest.raises(ValueError, match=r"has 2 values.*per-head scales are not supported"):
        checkpoint_kv_scales(_Cfg(tmp_path / "b"))
    _write(tmp_path / "c", {"model.layers.0.self_attn.k_scale": t(0.0), "model.layers.0.self_attn.v_scale": t(1.0)})
    with pytest.raises(ValueError, match=r"is 0.0; a scale must be a positive finite number"):
        checkpoint_kv_scales(_Cfg(tmp_path / "c"))
    per_head = {"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False}
    with pytest.raises(ValueError, match=r"\{'strategy': 'attn_head'\}.*static per-tensor"):
        checkpoint_kv_scales(_Cfg(tmp_path / "c", {"kv_cache_scheme": per_head}))
    assert checkpoint_kv_scales(_Cfg(tmp_path / "nothing-here")) == {}


def test_cuda_decode_tiles_over_an_fp8_cache():
    """An fp8 cache serves groups above 4 in tiles of 4 query heads (csrc paged_decode.cuh)."""
    from platforms.cuda.attention import check_spec, head_tiles

    assert [head_tiles(2 * g, 2, fp8_cache=True) for g in (1, 4, 6, 8)] == [1, 1, 2, 2]
    assert [head_tiles(2 * g, 2) for g in (1, 4, 6, 8)] == [1, 1, 1, 1]
    check_spec(fp8_spec(torch.bfloat16, head=256))  # head 256 over fp8: accepted
    with pytest.raises(ValueError, match=r"KV cache dtype torch.float8_e5m2"):
        check_spec(AttentionSpec(4, 2, 64, torch.bfloat16, 16, kv_cache_dtype=torch.float8_e5m2))


class _TorchCacheOps:
    """The CUDA layout's reshape_and_cache written here in plain torch, so the CUDA backend's
    prompt path (gather, dequantize, SDPA) runs on the CPU."""

    @staticmethod
    def reshape_and_cache(key, value, cache, slots, k_scale=1.0, v_scale=1.0):
        bs = cache.shape[3]
        keep = slots >= 0
        blocks, offs = slots[keep] // bs, slots[keep] % bs
        raw = cache.view(torch.uint8)
        raw[blocks, 0, :, offs, :] = ref_codes(key[keep], k_scale).view(torch.uint8)
        raw[blocks, 1, :, offs, :] = ref_codes(value[keep], v_scale).view(torch.uint8)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window,cap", [(None, None), (19, None), (None, 20.0)])
def test_cuda_backend_prompts_over_fp8_match_the_cpu_backend(group, window, cap):
    """The CUDA backend's prompt rows (a fresh prompt and a chunk over cached context) read
    the fp8 cache as the CPU backend does; decode rows need the GPU (tests/cuda)."""
    from platforms.cuda.attention import CudaPagedAttention

    g = torch.Generator().manual_seed(17)
    spec = fp8_spec(torch.float32, heads=2 * group, kv_heads=2, head=64, k_scale=0.01, v_scale=0.03,
                    window=window, cap=cap)
    cuda, cpu = CudaPagedAttention(spec, ops=_TorchCacheOps()), CpuAttentionBackend(spec)
    cuda_cache, cpu_cache = cuda.allocate_kv_cache(20, "cpu"), cpu.allocate_kv_cache(20, "cpu")
    codes = torch.randint(0, 256, cuda_cache.shape, generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x30
    cuda_cache.view(torch.uint8).copy_(codes)
    cpu_cache.view(torch.uint8).copy_(codes.permute(1, 0, 3, 2, 4))  # -> [2, blocks, bs, kvh, d]
    md = build_metadata([37, 12], [0, 20], [[3, 9, 1], [2, 7]], 16, num_prefills=2)
    q = torch.randn(49, 2 * group, 64, generator=g)
    k, v = torch.randn(49, 2, 64, generator=g), torch.randn(49, 2, 64, generator=g)
    want = cpu.forward(q, k, v, cpu_cache, md)
    got = cuda.forward(q, k, v, cuda_cache, md)
    assert torch.equal(cuda_cache.view(torch.uint8).permute(1, 0, 3, 2, 4), cpu_cache.view(torch.uint8))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_core_platforms_lists_the_kv_cache_dtypes(capsys):
    import argparse

    from core.entrypoints.cli import cmd_platforms

    assert cmd_platforms(argparse.Namespace(platform=None)) == 0
    out = " ".join(capsys.readouterr().out.split())  # table cells wrap
    assert out.count("[kv cache: auto, fp8_e4m3]") == 2  # cpu and cuda
    assert "[kv cache: auto]" in out  # every other platform
