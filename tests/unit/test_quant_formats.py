"""Quantized weight formats against their specifications, without a model.

* the int32 nibble packings of AWQ and GPTQ against words written out by hand from the
  formats' definitions (AutoAWQ ``WQLinear_GEMM``: nibble i holds output ``8c + (0, 2, 4,
  6, 1, 3, 5, 7)[i]``; GPTQ: nibble i of qweight row r holds input ``8r + i``);
* GGUF Q4_0 / Q4_1 / Q4_K / Q8_0 blocks of random bytes: our IntWeight dequantizes to the
  ``gguf`` package's dequantization bit for bit;
* the canonical forms shard, reorder and join like the dense weights they stand for;
* method selection: detection, ``--quantization``, and the refusals (unknown method,
  mismatch, a platform that does not run it), and a plugin's method.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from core.quantization.fp8 import block_scales_to_groups, tensor_or_channel_scales
from core.quantization.gguf import KEPT_TYPES, gguf_int_weight
from core.quantization.int4 import AWQ_ORDER, unpack_int32
from core.quantization.registry import resolve_quantization
from core.quantization.tensors import Fp8Weight, IntWeight, cat_rows, quantize_fp8_rows
from core.quantization.writers import pack_int32


def test_awq_packing_matches_the_format_definition():
    codes = torch.arange(8, dtype=torch.uint8)[None]  # output c holds code c
    word = pack_int32(codes, 1, AWQ_ORDER)
    # nibble i holds output AWQ_ORDER[i] = 0, 2, 4, 6, 1, 3, 5, 7 (lowest nibble first)
    assert word.item() == 0x75316420
    assert torch.equal(unpack_int32(word, 1, AWQ_ORDER), codes)


def test_gptq_packing_matches_the_format_definition():
    codes = torch.tensor([[9], [1], [2], [3], [4], [5], [6], [15]], dtype=torch.uint8)  # [K=8, N=1]
    word = pack_int32(codes, 0)
    assert word.item() == np.int32(np.uint32(0xF6543219)).item()  # input 8r + i in nibble i
    assert torch.equal(unpack_int32(word, 0), codes)


def test_gptq_8_bit_packing_matches_the_format_definition():
    """GPTQ bits 8: byte i of qweight row r holds input 4r + i (lowest byte first), qzeros four
    outputs a word likewise; a symmetric checkpoint (every zero point 128, stored as 127 in v1)
    loads as int8 codes q - 128 without mins, an asymmetric one with mins (128 - z) * s: the
    format's (q - z) * s, bit for bit."""
    from core.quantization.int4 import GptqMethod

    codes = torch.tensor([[0x11], [0x22], [0x33], [0xF4]], dtype=torch.uint8)  # [K=4, N=1]
    word = pack_int32(codes, 0, bits=8)
    assert word.item() == np.int32(np.uint32(0xF4332211)).item()
    assert torch.equal(unpack_int32(word, 0, bits=8), codes)
    gen = torch.Generator().manual_seed(8)
    k, n, g = 256, 8, 128
    q = torch.randint(0, 256, (k, n), generator=gen, dtype=torch.uint8)
    s = (torch.rand(k // g, n, generator=gen) * 0.01 + 0.001).half()
    method = GptqMethod.from_config({"quant_method": "gptq", "bits": 8, "group_size": g, "desc_act": False})
    assert method.describe().startswith("gptq (8-bit")
    for z in (torch.full((k // g, n), 128, dtype=torch.uint8), torch.randint(1, 256, (k // g, n), generator=gen,
                                                                             dtype=torch.uint8)):
        parts = {"qweight": pack_int32(q, 0, bits=8), "qzeros": pack_int32(z - 1, 1, bits=8), "scales": s}
        (_, w), = list(method.checkpoint_weights(iter((f"l.{key}", v) for key, v in parts.items())))
        want = ((q.float() - z.float().repeat_interleave(g, 0)) * s.float().repeat_interleave(g, 0)).t()
        assert w.bits == 8 and w.codes.dtype == torch.int8 and (w.mins is None) == bool((z == 128).all())
        assert torch.equal(w.dequantize(), want)
    with pytest.raises(ValueError, match="3-bit weights is not supported; supported: 4-bit, 8-bit"):
        GptqMethod.from_config({"quant_method": "gptq", "bits": 3, "group_size": g})


def _random_blocks(qtype: int, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random GGUF blocks with finite fp16 scales at the format's offsets."""
    from gguf.constants import GGML_QUANT_SIZES

    block, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    n_halves = 2 if qtype in (3, 12) else 1  # Q4_1: d, m; Q4_K: d, dmin
    halves = (rng.standard_normal((rows, cols // block, n_halves)) * 0.01).astype(np.float16)
    raw[..., : 2 * n_halves] = halves.view(np.uint8).reshape(rows, cols // block, 2 * n_halves)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", sorted(KEPT_TYPES), ids=lambda q: KEPT_TYPES[q])
def test_gguf_blocks_dequantize_like_the_gguf_package(qtype):
    from gguf.quants import dequantize

    rows, cols = 6, 512
    raw = _random_blocks(qtype, rows, cols, seed=qtype)
    ours = gguf_int_weight(raw, qtype, (rows, cols))
    want = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    assert ours.shape == (rows, cols) and ours.group == 32
    assert torch.equal(ours.dequantize(), want)


def _int_weight(rows=32, cols=256, group=64, perm=False, seed=0) -> IntWeight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    scales = torch.rand(rows, cols // group, generator=g) + 0.1
    mins = torch.randn(rows, cols // group, generator=g)
    p = torch.randperm(cols, generator=g) if perm else None
    return IntWeight(4, codes, scales, mins, group, p)


def test_int_weight_shards_and_joins_like_its_dense_weight():
    w = _int_weight()
    dense = w.dequantize()
    assert torch.equal(w.narrow(0, 8, 16).dequantize(), dense[8:24])
    assert torch.equal(w.narrow(1, 64, 128).dequantize(), dense[:, 64:192])
    rows = torch.randperm(32)
    assert torch.equal(w.index_rows(rows).dequantize(), dense[rows])
    other = _int_weight(rows=16, seed=1)
    assert torch.equal(cat_rows([w, other], "test").dequantize(), torch.cat([dense, other.dequantize()]))
    with pytest.raises(ValueError, match="multiple of 64"):
        w.narrow(1, 32, 64)


def test_act_order_weight_undoes_its_permutation_and_refuses_an_input_split():
    w = _int_weight(perm=True)
    plain = IntWeight(4, w.codes, w.scales, w.mins, w.group)
    # column j of the codes is input perm[j]
    assert torch.equal(w.dequantize()[:, w.perm], plain.dequantize())
    x = torch.randn(3, 256)
    assert torch.allclose(x @ w.dequantize().T, x[:, w.perm] @ plain.dequantize().T, atol=1e-4)
    with pytest.raises(ValueError, match="tensor-parallel-size 1"):
        w.narrow(1, 0, 128)
    with pytest.raises(ValueError, match="act-order"):
        cat_rows([w, _int_weight(perm=True, seed=5)], "qkv")


def test_fp8_scale_layouts_dequantize_by_definition():
    g = torch.Generator().manual_seed(0)
    codes = (torch.randn(200, 300, generator=g) * 50).to(torch.float8_e4m3fn)
    blocks = torch.rand(2, 3, generator=g) + 0.5  # [ceil(200/128), ceil(300/128)]
    w = block_scales_to_groups(codes, blocks, (128, 128), "x")
    want = codes.float() * blocks.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert torch.equal(w.dequantize(), want)
    assert torch.equal(w.narrow(1, 128, 128).dequantize(), want[:, 128:256])
    per_channel = tensor_or_channel_scales(codes, blocks.new_ones(200, 1) * 3, "x")
    assert torch.equal(per_channel.dequantize(), codes.float() * 3)
    joined = cat_rows([w, per_channel], "fused")  # per-row scales repeat into 128-input groups
    assert torch.equal(joined.dequantize(), torch.cat([want, codes.float() * 3]))
    with pytest.raises(ValueError, match="block scales have shape"):
        block_scales_to_groups(codes, blocks[:1], (128, 128), "x")


def test_on_load_fp8_quantization_is_per_channel():
    w = torch.randn(64, 128) * torch.linspace(0.01, 10, 64)[:, None]  # rows of very different range
    q = quantize_fp8_rows(w)
    assert isinstance(q, Fp8Weight) and q.scales.shape == (64, 1)
    assert q.codes.float().abs().amax(dim=1).allclose(torch.full((64,), 448.0))
    rel = ((q.dequantize() - w).abs().amax(dim=1) / w.abs().amax(dim=1))
    assert float(rel.max()) <= 2**-4  # e4m3 keeps 3 mantissa bits: half an ulp is 1/16


# ---- choosing a method --------------------------------------------------------------------------


class _Config:
    def __init__(self, quantization_config=None):
        if quantization_config is not None:
            self.quantization_config = quantization_config


class _HostOnly:
    """A platform answering like the default Platform.quantization_methods (GGUF only)."""

    name = "host-only"

    @classmethod
    def quantization_methods(cls):
        return {"gguf": None}


class _Everything:
    name = "everything"

    @classmethod
    def quantization_methods(cls):
        return dict.fromkeys(("fp8", "compressed-tensors", "awq", "gptq", "gguf"))


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}


def test_detected_from_config_and_from_the_flag():
    assert resolve_quantization(None, _Config(), None, _Everything) is None
    assert resolve_quantization(None, _Config(AWQ), None, _Everything).name == "awq"
    assert resolve_quantization("awq_marlin", _Config(AWQ), None, _Everything).name == "awq"
    assert resolve_quantization(None, _Config(), "/x.gguf", _HostOnly).name == "gguf"
    on_load = resolve_quantization("fp8", _Config(), None, _Everything)
    assert on_load.name == "fp8" and on_load.on_load


def test_unsupported_quant_method_is_refused_with_what_is_supported():
    with pytest.raises(ValueError) as e:
        resolve_quantization(None, _Config({"quant_method": "bitsandbytes"}), None, _Everything)
    msg = str(e.value)
    assert "'bitsandbytes'" in msg and "awq" in msg and "fp8" in msg and "gptq" in msg


def test_flag_contradicting_the_checkpoint_or_needing_one_is_refused():
    with pytest.raises(ValueError, match="does not match the checkpoint, which is quantized with awq"):
        resolve_quantization("fp8", _Config(AWQ), None, _Everything)
    with pytest.raises(ValueError, match="needs a checkpoint quantized as awq"):
        resolve_quantization("awq", _Config(), None, _Everything)
    with pytest.raises(ValueError, match="needs a .gguf file"):
        resolve_quantization("gguf", _Config(), None, _Everything)
    with pytest.raises(ValueError, match="unknown"):
        resolve_quantization("int3", _Config(), None, _Everything)
    with pytest.raises(ValueError, match="8-bit"):
        resolve_quantization(None, _Config({**AWQ, "bits": 8}), None, _Everything)


def _ct(weights: dict, fmt: str = "pack-quantized", **group) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, **group}}}


W4A16 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}


@pytest.mark.parametrize("weights,match", [
    ({**W4A16, "actorder": "columns"}, "activation ordering"),
    ({**W4A16, "strategy": "channel", "actorder": "group"}, "needs the group weight strategy"),
    ({**W4A16, "num_bits": 3}, r"supported: 4-bit int \(W4A16\) or 8-bit int \(W8A16\)"),
    ({**W4A16, "group_size": 48}, "group_size 48"),
    ({**W4A16, "strategy": "tensor"}, "int weight strategy 'tensor'"),
])
def test_compressed_tensors_int_settings_not_read_are_refused(weights, match):
    with pytest.raises(ValueError, match=match):
        resolve_quantization(None, _Config(_ct(weights)), None, _Everything)


def test_compressed_tensors_w4a16_is_read_and_formats_may_not_mix():
    method = resolve_quantization(None, _Config(_ct(W4A16)), None, _Everything)
    assert "pack-quantized int4, symmetric" in method.describe()
    asym = resolve_quantization(None, _Config(_ct({**W4A16, "symmetric": False})), None, _Everything)
    assert "pack-quantized int4, asymmetric" in asym.describe()
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
    mixed = _ct(W4A16)
    mixed["config_groups"]["group_1"] = {"targets": ["Linear"], "weights": fp8, "format": "float-quantized"}
    with pytest.raises(ValueError, match="several formats"):
        resolve_quantization(None, _Config(mixed), None, _Everything)
    two = _ct(W4A16)  # e.g. attention in groups of 128, the MLP per channel: one setting is read
    two["config_groups"]["group_1"] = {"targets": ["Linear"], "weights": {**W4A16, "strategy": "channel"}}
    with pytest.raises(ValueError, match="different weight settings"):
        resolve_quantization(None, _Config(two), None, _Everything)
    with pytest.raises(ValueError, match="'naive-quantized'"):
        resolve_quantization(None, _Config(_ct(W4A16, fmt="naive-quantized")), None, _Everything)


@pytest.mark.parametrize("actorder", ["group", "weight", None])
def test_compressed_tensors_w4a16_act_order_reads_exactly(actorder):
    """W4A16 by the format's layout (core.quantization.writers): with group act-order (inputs
    in random groups named by weight_g_idx) the weight is restated in group order with the
    permutation and dequantizes exactly to the writer's floats; "weight" act-order is stored
    like none; a group act-order layer without weight_g_idx is refused, naming it."""
    from core.quantization.writers import ct_w4a16_tensors

    gen = torch.Generator().manual_seed(17)
    w = torch.randn(24, 384, generator=gen)
    perm = torch.randperm(384, generator=gen) if actorder == "group" else None
    parts, ref = ct_w4a16_tensors(w, 128, perm)
    assert ("weight_g_idx" in parts) == (actorder == "group")
    method = resolve_quantization(None, _Config(_ct({**W4A16, "actorder": actorder})), None, _Everything)
    assert ("group act-order" in method.describe()) == (actorder == "group")
    (name, weight), = list(method.checkpoint_weights(iter((f"l.{k}", v) for k, v in parts.items())))
    assert name == "l.weight" and isinstance(weight, IntWeight)
    assert torch.equal(weight.dequantize(), ref)
    assert (weight.perm is not None) == (actorder == "group")
    assert rel_close(weight.dequantize(), w)
    assert weight.bits == 4  # fp16 scales: the 4-bit form is exact
    if actorder == "group":
        x = torch.randn(3, 384, generator=gen)  # the layer's product: x permuted like the codes
        dense = (weight.codes.float() * weight.scales.repeat_interleave(128, 1)
                 + weight.mins.repeat_interleave(128, 1))
        torch.testing.assert_close(x[:, weight.perm] @ dense.t(), x @ ref.t(), rtol=1e-5, atol=1e-5)
        no_idx = [(f"l.{k}", v) for k, v in parts.items() if k != "weight_g_idx"]
        with pytest.raises(ValueError, match="weight_g_idx"):
            list(method.checkpoint_weights(iter(no_idx)))
        bad = dict(parts, weight_g_idx=torch.zeros(384, dtype=torch.int32))  # one group of 384
        with pytest.raises(ValueError, match="does not put exactly 128 inputs"):
            list(method.checkpoint_weights(iter((f"l.{k}", v) for k, v in bad.items())))
        unset = dict(parts, weight_g_idx=torch.full((384,), -1, dtype=torch.int32))  # never calibrated
        with pytest.raises(ValueError, match="holds -1; group indices must be >= 0"):
            list(method.checkpoint_weights(iter((f"l.{k}", v) for k, v in unset.items())))


def test_compressed_tensors_group_act_order_by_the_formats_definition():
    """A layer written out by hand from the format's definition, independently of our writer:
    inputs alternate between two groups (g_idx = c % 2), signed codes q stored as q + 8 in
    nibble i of word c // 8 for input 8 (c // 8) + i; w[r, c] = q[r, c] * scale[r, g_idx[c]]."""
    rows, cols = 3, 256
    gen = torch.Generator().manual_seed(23)
    q = torch.randint(-8, 8, (rows, cols), generator=gen)
    scale = torch.rand(rows, 2, generator=gen).half() + 0.5
    g_idx = (torch.arange(cols) % 2).to(torch.int32)
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for c in range(cols):
        words[:, c // 8] |= (q[:, c] + 8) << (4 * (c % 8))
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    want = torch.tensor([[float(q[r, c]) * float(scale[r, g_idx[c]]) for c in range(cols)] for r in range(rows)])
    method = resolve_quantization(None, _Config(_ct({**W4A16, "actorder": "group"})), None, _Everything)
    parts = {"weight_packed": words, "weight_scale": scale, "weight_shape": torch.tensor([rows, cols]),
             "weight_g_idx": g_idx}
    (_, weight), = list(method.checkpoint_weights(iter((f"l.{k}", v) for k, v in parts.items())))
    assert torch.equal(weight.dequantize(), want)


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_w4a16_is_4_bit_exactly_where_its_scales_allow(symmetric):
    """A layer by the format's definition (signed codes q stored as q + 8 in nibble i of word
    c // 8; zero points the same way along the outputs): with scales of 20 significant bits it
    loads as 4-bit codes with mins, with float32 scales of 24 bits as 8-bit codes q - z; both
    dequantize to (q - z) * scale rounded once. The check is needed: on these 24-bit scales
    the 4-bit form (code * scale + min, two roundings) would differ."""
    from core.quantization.fp8 import four_bit_is_exact
    from core.quantization.writers import pack_int32

    rows, cols, group = 16, 256, 128
    gen = torch.Generator().manual_seed(29)
    q = torch.randint(-8, 8, (rows, cols), generator=gen)
    z = torch.randint(-8, 8, (rows, cols // group), generator=gen) if not symmetric else torch.zeros(rows, 2).long()
    full = torch.rand(rows, cols // group, generator=gen) + 0.5
    full = (full.view(torch.int32) | 1).view(torch.float32)  # 24 significant bits
    short = (full.view(torch.int32) & ~0xF).view(torch.float32)  # 20
    assert four_bit_is_exact(short) and not four_bit_is_exact(full)
    one = torch.ones(1)
    for bits in (0b0010, 0b0100, 0b1000, 0b1110):  # any of the low 4 mantissa bits set: 21+ bits
        assert not four_bit_is_exact((one.view(torch.int32) | bits).view(torch.float32))
    assert four_bit_is_exact(torch.tensor([2.0**123, 0.0, -3.5, 2.0**-140]))  # large, zero, negative, subnormal
    assert not four_bit_is_exact(torch.tensor([2.0**124]))  # 16 x 2^124 overflows: no room for the products
    config = {**W4A16, "symmetric": symmetric}
    method = resolve_quantization(None, _Config(_ct(config)), None, _Everything)
    for scale, bits in ((short, 4), (full, 8)):
        parts = {"weight_packed": pack_int32((q + 8).to(torch.uint8), 1), "weight_scale": scale,
                 "weight_shape": torch.tensor([rows, cols])}
        if not symmetric:
            parts["weight_zero_point"] = pack_int32((z + 8).to(torch.uint8), 0)
        (_, weight), = list(method.checkpoint_weights(iter((f"l.{k}", v) for k, v in parts.items())))
        s = scale.repeat_interleave(group, 1)
        want = (q - z.repeat_interleave(group, 1)).float() * s
        assert weight.bits == bits and torch.equal(weight.dequantize(), want)
        two_roundings = (q + 8).float() * s + (-((z + 8).float() * scale)).repeat_interleave(group, 1)
        assert torch.equal(two_roundings, want) == (bits == 4)


def test_a_fused_w4a16_layer_whose_parts_differ_in_width_joins_as_8_bit_codes():
    """compressed-tensors W4A16 picks its form per module: a q projection with float32 scales
    (8-bit codes) fused with a k projection whose scales fit 20 bits (4-bit codes) joins as
    8-bit codes with the same floats; a 4-bit part whose mins are not integer multiples of its
    scales (GGUF Q4_1's free mins) cannot, and is refused naming the layer."""
    from core.quantization.tensors import cat_rows
    from core.quantization.writers import pack_int32

    gen = torch.Generator().manual_seed(31)
    method = resolve_quantization(None, _Config(_ct({**W4A16, "symmetric": False})), None, _Everything)

    def layer(scale):
        q = torch.randint(-8, 8, (8, 256), generator=gen)
        z = torch.randint(-8, 8, (8, 2), generator=gen)
        parts = {"weight_packed": pack_int32((q + 8).to(torch.uint8), 1), "weight_scale": scale,
                 "weight_shape": torch.tensor([8, 256]), "weight_zero_point": pack_int32((z + 8).to(torch.uint8), 0)}
        (_, w), = list(method.checkpoint_weights(iter((f"l.{k}", v) for k, v in parts.items())))
        return w

    full = ((torch.rand(8, 2, generator=gen) + 0.5).view(torch.int32) | 1).view(torch.float32)
    q_proj, k_proj = layer(full), layer(torch.rand(8, 2, generator=gen).half().float() + 0.5)
    assert (q_proj.bits, k_proj.bits) == (8, 4)
    for parts in ([q_proj, k_proj], [k_proj, q_proj]):
        joined = cat_rows(parts, "qkv_proj")
        assert joined.bits == 8 and joined.mins is None
        assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in parts]))
    free = IntWeight(4, k_proj.codes, k_proj.scales, k_proj.mins + 1e-3, k_proj.group)
    assert free.as_signed_int8() is None
    with pytest.raises(ValueError, match="qkv_proj: the fused projections use different bit widths"):
        cat_rows([q_proj, free], "qkv_proj")


def test_a_fused_gguf_layer_of_mixed_block_types_runs_densely(caplog):
    """GGUF files mix block types inside what core fuses (q and k as Q4_K, v as Q8_0): the
    parts cannot be joined exactly, so the kept-quantized method runs that layer densely - the
    same products as the checkpoint's dequantized weights - and says so in the log, instead of
    failing the load. A layer whose parts share a form stays quantized."""
    from core.models.layers import QKVParallelLinear
    from core.quantization.gguf import Q4_K, Q8_0, GgufMethod
    from core.quantization.linear import ReferenceQuantizedLinear
    from tests.helpers import cpu_context

    def qkv(types):
        ctx = dataclasses.replace(cpu_context(), linear_method=ReferenceQuantizedLinear(GgufMethod(None), torch.float32))
        layer = QKVParallelLinear(256, 32, 4, 2, ctx)
        parts = {s: gguf_int_weight(_random_blocks(t, rows, 256, seed=i), t, (rows, 256))
                 for i, (s, t, rows) in enumerate(zip("qkv", types, (128, 64, 64)))}
        for s, w in parts.items():
            layer.load_weight("weight", w, shard=s)
        return layer, torch.cat([parts[s].dequantize() for s in "qkv"])

    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    with caplog.at_level("WARNING", logger="core.quantization.linear"):
        mixed, dense = qkv((Q4_K, Q4_K, Q8_0))
        out = mixed(x)
    assert mixed.packed_weight == "dense" and torch.equal(mixed.weight, dense)
    torch.testing.assert_close(out, x @ dense.T)
    assert "different bit widths" in caplog.text and "runs densely in torch.float32" in caplog.text
    same, _ = qkv((Q4_K, Q4_K, Q4_K))
    same(x)
    assert isinstance(same.packed_weight.weight, IntWeight) and same.weight.numel() == 0


def test_compressed_tensors_w8a16_loads_the_library_floats_in_the_form_each_scale_allows():
    """8-bit pack-quantized (W8A16): four codes a word (byte i of word c is input 4c + i, stored
    as q + 128; zero points likewise along the outputs). Symmetric: int8 codes q, no mins.
    Asymmetric with bf16 scales: int8 codes and mins -z * s (every product exact). Asymmetric
    with scales of more than 16 significant bits: the dense weight. Each dequantizes to
    (q - z) * s rounded once, the library's definition, bit for bit."""
    from core.quantization.writers import pack_int32

    gen = torch.Generator().manual_seed(12)
    rows, cols, g = 8, 256, 128
    q = torch.randint(-128, 128, (rows, cols), generator=gen)
    z = torch.randint(-128, 128, (rows, cols // g), generator=gen)
    word = pack_int32(torch.tensor([[1, 2, 3, 250]], dtype=torch.uint8), 1, bits=8)
    assert word.item() == np.int32(np.uint32(0xFA030201)).item()

    def load(symmetric, scale):
        method = resolve_quantization(None, _Config(_ct({**W4A16, "num_bits": 8, "symmetric": symmetric})), None,
                                      _Everything)
        parts = {"weight_packed": pack_int32((q + 128).to(torch.uint8), 1, bits=8), "weight_scale": scale,
                 "weight_shape": torch.tensor([rows, cols])}
        if not symmetric:
            parts["weight_zero_point"] = pack_int32((z + 128).to(torch.uint8), 0, bits=8)
        assert "pack-quantized int8" in method.describe()
        (_, w), = list(method.checkpoint_weights(iter((f"l.{k}", v) for k, v in parts.items())))
        return w

    def library(scale, zeros):
        return (q - zeros.repeat_interleave(g, 1)).float() * scale.repeat_interleave(g, 1)

    bf16 = (torch.rand(rows, cols // g, generator=gen) * 0.01 + 0.001).bfloat16().float()
    full = ((torch.rand(rows, cols // g, generator=gen) + 0.5).view(torch.int32) | 1).view(torch.float32)
    sym = load(True, bf16)
    assert sym.bits == 8 and sym.mins is None and torch.equal(sym.dequantize(), library(bf16, torch.zeros_like(z)))
    asym = load(False, bf16)
    assert asym.bits == 8 and asym.mins is not None and torch.equal(asym.dequantize(), library(bf16, z))
    dense = load(False, full)
    assert isinstance(dense, torch.Tensor) and torch.equal(dense, library(full, z))


def rel_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """int4 round-to-nearest keeps a Gaussian weight within ~15 % (relative L2)."""
    return float((a - b).norm() / b.norm()) < 0.15


def test_platform_without_the_method_is_refused_naming_those_that_run_it():
    with pytest.raises(ValueError) as e:
        resolve_quantization(None, _Config(AWQ), None, _HostOnly,
                             platforms={"host-only": _HostOnly, "everything": _Everything})
    msg = str(e.value)
    assert "'awq' is not supported by platform 'host-only'" in msg and "['everything']" in msg


def test_a_plugin_adds_a_method():
    import core
    from core.plugins import Plugins
    from core.quantization.base import QuantizationMethod
    from core.quantization.registry import quantization_for

    class Int3Method(QuantizationMethod):
        name = "int3"

    class Plugin:
        CORE_PLUGIN_API = ">=1.0,<2"

        @core.hookimpl
        def core_quantization_methods(self):
            return [Int3Method]

    class Vendor(_HostOnly):
        name = "vendor"

        @classmethod
        def quantization_methods(cls):
            return {"int3": None}

    plugins = Plugins()
    plugins.register(Plugin(), "int3-plugin")
    assert plugins.quantization_methods() == {"int3": Int3Method}
    method = quantization_for(None, _Config({"quant_method": "int3"}), None, Vendor, plugins)
    assert isinstance(method, Int3Method)
    with pytest.raises(ValueError, match="not supported by platform 'host-only'"):
        quantization_for(None, _Config({"quant_method": "int3"}), None, _HostOnly, plugins)


# ---- the CUDA kernels' decoding, emulated on the host ------------------------------------------


def test_cuda_int4_packing_is_what_the_kernel_decodes():
    """csrc/quant reads 32-bit words: nibble i of word w is input 8w + i (quant_gemm.h)."""
    from platforms.cuda.quant import pack_int4_rows

    codes = torch.randint(0, 16, (4, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    words = pack_int4_rows(codes).view(torch.int32)  # [4, 8] little-endian words
    decoded = torch.stack([(words >> (4 * i)) & 15 for i in range(8)], dim=-1).flatten(1)
    assert torch.equal(decoded.to(torch.uint8), codes)


def test_cuda_fp8_decoding_trick_is_exact_for_every_finite_code():
    """The kernel's e4m3 decode: magnitude bits << 20 read as a float32, times 2^120."""
    codes = torch.arange(256, dtype=torch.int32)
    finite = (codes & 0x7F) != 0x7F  # 0x7f / 0xff are NaN in e4m3fn
    magnitude = ((codes & 0x7F) << 20).view(torch.float32) * 2.0**120
    decoded = torch.where(codes >= 0x80, -magnitude, magnitude)
    want = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(decoded[finite], want[finite])


def _byte_perm(a: int, b: int, selector: int) -> int:
    """PRMT: byte i of the result is byte (selector >> 4 i) & 7 of the 8 bytes b:a."""
    both = (b << 32) | a
    return sum(((both >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


@pytest.mark.parametrize("dtype,magic", [(torch.float16, 0x6400), (torch.bfloat16, 0x4300)])
def test_cuda_int4_tensor_core_decoding_is_exact(dtype, magic):
    """csrc/quant's int4 tensor-core GEMV: a code q in the low bits of the magic number M
    reads as M + q, the offset -(M + z) is M's bits plus z with the sign set, and one fma
    (x 1 - (M + z)) in the activations' type gives q - z exactly for every code and every
    zero point the packing admits (0..ZERO_LIMIT)."""
    from platforms.cuda.quant import ZERO_LIMIT

    base = torch.tensor([magic], dtype=torch.int16).view(dtype).item()
    q = torch.arange(16)
    as_code = (q | magic).to(torch.int16).view(dtype).double()
    assert torch.equal(as_code, base + q.double())
    for z in range(ZERO_LIMIT + 1):
        # the kernel's offset: M's bits plus z with the sign bit set
        offset = torch.tensor([(magic | 0x8000) + z], dtype=torch.int32).to(torch.int16).view(dtype)
        assert offset.double().item() == -(base + z)
        got = (as_code + offset.double()).to(dtype)  # a * 1 + c, rounded once
        assert torch.equal(got.double(), (q - z).double()), z


def test_cuda_int4_tensor_core_pairs_meet_their_own_activations():
    """The kernel's A pairs (a word shifted by 4 j, nibbles j and j + 4) and its B pairs (PRMT
    0x5410 / 0x7632 of the activation words) must hold the same inputs: their dot product,
    taken pair by pair as the mma does, is the plain one."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (8,), generator=gen)
    x = torch.randint(1, 1000, (8,), generator=gen)  # distinct 16-bit "activations"
    word = sum(int(c) << (4 * i) for i, c in enumerate(codes))
    xw = [int(x[2 * i]) | (int(x[2 * i + 1]) << 16) for i in range(4)]  # (x0, x1) ... (x6, x7)
    b = [_byte_perm(xw[0], xw[2], 0x5410), _byte_perm(xw[0], xw[2], 0x7632),
         _byte_perm(xw[1], xw[3], 0x5410), _byte_perm(xw[1], xw[3], 0x7632)]
    total = 0
    for j in range(4):
        a = (word >> (4 * j)) & 0x000F000F
        total += (a & 0xFFFF) * (b[j] & 0xFFFF) + (a >> 16) * (b[j] >> 16)
    assert total == int((codes * x).sum())


def test_cuda_int4_zero_points_are_found_only_where_they_restate_the_mins():
    from core.quantization.int4 import _int_weight
    from platforms.cuda.quant import integer_zeros

    gen = torch.Generator().manual_seed(4)
    z = torch.randint(0, 16, (8, 64), generator=gen)  # AWQ / GPTQ: [K / G, N]
    s = (torch.rand(8, 64, generator=gen) * 0.01).half()
    w = _int_weight(torch.randint(0, 16, (1024, 64), generator=gen, dtype=torch.uint8), z, s, 128)
    assert torch.equal(integer_zeros(w.scales, w.mins), z.t().to(torch.uint8))
    d = torch.randn(64, 32, generator=gen).half().float()  # GGUF Q4_0: d of either sign, min -8 d
    assert torch.equal(integer_zeros(d, -8 * d), torch.full((64, 32), 8, dtype=torch.uint8))
    assert integer_zeros(w.scales, w.mins + 1e-3) is None  # free mins (Q4_1, Q4_K)
    assert integer_zeros(d, -200 * d) is None  # beyond ZERO_LIMIT
    assert integer_zeros(d, 3 * d) is None  # negative zero point
    zero = d.clone()
    zero[0, 0] = 0.0  # a group of zeros (its scale 0): any zero point, the kernel gets 0
    want = torch.full((64, 32), 8, dtype=torch.uint8)
    want[0, 0] = 0
    assert torch.equal(integer_zeros(zero, -8 * zero), want)
    free = -8 * zero
    free[0, 0] = 0.5
    assert integer_zeros(zero, free) is None  # a zero scale with a nonzero min


def test_cuda_packing_keeps_zero_points_only_where_the_tensor_cores_use_them():
    """platforms/cuda/quant.py::_pack (run on the host here): zero points for int4 weights
    whose mins restate them, in groups of 128+ and rows of a multiple of 256 inputs; none for
    free mins, no mins, GGUF Q4_0's groups of 32 or other row lengths."""
    from platforms.cuda.quant import _pack

    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(6)

    def weight(cols, group, free=False, mins=True):
        codes = torch.randint(0, 16, (32, cols), generator=gen, dtype=torch.uint8)
        s = torch.rand(32, cols // group, generator=gen) * 0.01 + 1e-3
        z = torch.randint(0, 16, (32, cols // group), generator=gen).float()
        m = (torch.randn(32, cols // group, generator=gen) if free else -(z * s)) if mins else None
        return IntWeight(4, codes, s, m, group), z

    w, z = weight(512, 128)
    assert torch.equal(_pack(w, cpu).zeros, z.to(torch.uint8))
    assert _pack(weight(512, 256)[0], cpu).zeros is not None
    assert _pack(weight(512, 128, free=True)[0], cpu).zeros is None  # Q4_1 / Q4_K-like
    assert _pack(weight(512, 128, mins=False)[0], cpu).zeros is None  # z = 0 without them
    assert _pack(weight(512, 32)[0], cpu).zeros is None  # Q4_0's groups of 32
    assert _pack(weight(640, 128)[0], cpu).zeros is None  # 640 inputs: not whole 256-input trips
