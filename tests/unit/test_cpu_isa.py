"""Every ISA path of the CPU kernels this machine can run, forced through the dispatch table,
against plain-torch references on fresh seeded random inputs.

The paths are those the loaded library reports (``torch.ops.core_cpu.cpu_isas()``: on an
AVX-512 machine ``avx512``, ``avx2`` and ``generic``). For each: the weight-quantized matmul
(``quant_linear``) against a float64 matmul of weights built here from random codes (packed
here, by the documented layout) and, in int8 mode, of activations rounded here by the
documented rule; and the paged decode / prompt attention against the float64 naive reference
(the cases of test_cpu_kernels.py). Paths the machine cannot run are compiled and run under
emulation in tests/compile/test_cpu_isa_compiles.py.
"""

from __future__ import annotations

import pytest
import torch

from platforms.cpu import isa as cpu_isa
from platforms.cpu.kernels import load_kernels
from platforms.cpu.linear import PANEL_PATHS, GroupedQuant, group_int4, group_int8, grouped_matmul
from platforms.cpu.ops import CpuOps, HeadPolicy
from tests.unit import test_cpu_kernels as kernel_cases

KERNELS = load_kernels()
PATHS = list(KERNELS.cpu_isas())


@pytest.fixture(params=PATHS)
def path(request):
    assert KERNELS.set_cpu_isa(request.param) == request.param
    assert cpu_isa.isa_in_force() == request.param
    yield request.param
    KERNELS.set_cpu_isa("auto")


def random_codes(bits: int, n: int, k: int, seed: int, scale_dtype=torch.float32):
    """(GroupedQuant packed here, float64 weight the codes stand for); scales and mins stored
    as ``scale_dtype``."""
    g = torch.Generator().manual_seed(seed)
    groups = k // 32
    scales = (torch.rand(n, groups, generator=g) * 0.05 + 1e-3).to(scale_dtype)
    if bits == 4:
        codes = torch.randint(0, 16, (n, groups, 32), generator=g)
        mins = (torch.rand(n, groups, generator=g) * 0.4 - 0.2).to(scale_dtype)
        dense = codes.double() * scales.double()[..., None] + mins.double()[..., None]
        packed = (codes[..., :16] | (codes[..., 16:] << 4)).to(torch.uint8).flatten(1)  # byte j: j | j+16
        return GroupedQuant(4, packed, scales, mins), dense.flatten(1)
    codes = torch.randint(-127, 128, (n, groups, 32), generator=g)
    dense = codes.double() * scales.double()[..., None]
    return GroupedQuant(8, codes.to(torch.int8).flatten(1), scales, None), dense.flatten(1)


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 mode sees it: per 32 inputs, scale max|x| / 127, round half to even."""
    xg = x.unflatten(1, (-1, 32))
    scale = xg.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (torch.round(xg * inv).double() * scale.double()).flatten(1)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mode", [0, 1])
# Rows and columns around the x86 kernels' blocks: 4-row tiles and panels (and the switch
# between them at 4 / 5 rows), 8-column panels with every remainder, 64 x 64 thread blocks.
@pytest.mark.parametrize("rows,n,k", [(1, 96, 576), (3, 40, 64), (7, 13, 1536), (70, 130, 96), (4, 8, 64),
                                      (5, 17, 96), (33, 71, 160), (130, 9, 64)])
def test_quant_linear_matches_float64(path: str, bits: int, mode: int, rows: int, n: int, k: int,
                                      scale_dtype) -> None:
    packed, dense = random_codes(bits, n, k, seed=rows * 1000 + n + bits, scale_dtype=scale_dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k + rows))
    x[0, :32] = 0.0  # an all-zero group: scale 0, codes 0
    got = grouped_matmul(KERNELS, x, packed, mode)
    xs = int8_activations(x) if mode == 1 else x.double()
    want = xs @ dense.T
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, atol=2e-4 * want.abs().max().item(), rtol=0)


def test_quant_linear_takes_strided_rows_and_refuses_bad_shapes(path: str) -> None:
    packed, dense = random_codes(4, 32, 64, seed=3)
    wide = torch.randn(5, 100, generator=torch.Generator().manual_seed(4))
    x = wide[:, 10:74]  # rows of a wider tensor
    torch.testing.assert_close(grouped_matmul(KERNELS, x, packed, 0).double(), x.double() @ dense.T,
                               atol=1e-4, rtol=0)
    with pytest.raises(RuntimeError, match="not a multiple of the group size 32"):
        KERNELS.quant_linear(torch.empty(1, 32), torch.randn(1, 48), packed.codes, packed.scales, packed.mins, 4, 1)
    with pytest.raises(RuntimeError, match="act_mode must be 0"):
        KERNELS.quant_linear(torch.empty(1, 32), torch.randn(1, 64), packed.codes, packed.scales, packed.mins, 4, 2)


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 1, 128), (16, 2, 96), (6, 2, 40)])
@pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
def test_paged_decode_on_every_path(path: str, heads, kv_heads, d, dtype) -> None:
    kernel_cases.test_paged_decode_matches_naive_reference(heads, kv_heads, d, dtype, None)
    kernel_cases.test_paged_decode_matches_naive_reference(heads, kv_heads, d, dtype, 21)


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 1, 128)])
@pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
def test_prompt_attention_on_every_path(path: str, heads, kv_heads, d, dtype) -> None:
    kernel_cases.test_prompts_through_the_kernel_match_naive_reference(heads, kv_heads, d, dtype, None)


def test_bf16_lm_head_on_every_path(path: str) -> None:
    kernel_cases.test_lm_head_is_float32_exact(CpuOps(KERNELS), torch.bfloat16, 5, 576)


def test_forcing_a_path_the_cpu_lacks_names_what_it_runs() -> None:
    missing = next(p for p in ("neon_dot", "avx2", "avx512") if p not in PATHS)
    with pytest.raises(ValueError, match=f"'{missing}' cannot run on this CPU.*it runs: {', '.join(PATHS)}"):
        KERNELS.set_cpu_isa(missing)
    assert cpu_isa.isa_in_force() == PATHS[0]  # unchanged


def test_python_detection_names_the_path_the_library_took() -> None:
    assert cpu_isa.detected_isa() == PATHS[0]
    assert cpu_isa.detected_isa(frozenset({"avx2", "fma", "f16c", "sse2"}), "x86_64") == "avx2"
    assert cpu_isa.detected_isa(frozenset({"avx2", "fma"}), "x86_64") == "generic"  # no F16C
    assert cpu_isa.detected_isa(frozenset({"avx512f", "avx512bw", "avx512vl", "avx2"}), "x86_64") == "avx512"
    assert cpu_isa.detected_isa(frozenset({"asimd", "asimddp"}), "aarch64") == "neon_dot"
    assert cpu_isa.detected_isa(frozenset({"asimd"}), "aarch64") == "generic"


def q_grid(bits: int, n: int, k: int, seed: int) -> torch.Tensor:
    """A float32 weight on a GGUF grid: Q4_1 (codes 0..15, both ends used) or Q8_0 (codes
    -127..127 with 127 reached), fp16 scales as GGUF stores them."""
    g = torch.Generator().manual_seed(seed)
    scale = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    if bits == 4:
        codes = torch.randint(0, 16, (n, k // 32, 32), generator=g)
        codes[..., 0], codes[..., 1] = 0, 15
        low = -(torch.rand(n, k // 32, 1, generator=g) * 0.1).half().float()
        return (codes * scale + low).flatten(1)
    codes = torch.randint(-127, 128, (n, k // 32, 32), generator=g)
    codes[..., 0] = 127
    return (codes * scale).flatten(1)


def test_grouping_recovers_gguf_codes() -> None:
    w8 = q_grid(8, 64, 128, seed=5)
    packed8 = group_int8(w8)
    assert packed8.reproduces(w8)  # Q8_0: exactly the same values
    w4 = q_grid(4, 64, 128, seed=6)
    packed4 = group_int4(w4)
    torch.testing.assert_close(packed4.dequantize(), w4, atol=1e-6, rtol=0)  # Q4_1: to fp32 rounding
    assert not group_int8(torch.randn(16, 64)).reproduces(torch.randn(16, 64))


def test_float32_lm_head_uses_exact_int8_codes_only_under_a_quantized_format() -> None:
    weight, hidden = q_grid(8, 300, 576, seed=7), torch.randn(4, 576, generator=torch.Generator().manual_seed(8))
    policy = HeadPolicy()
    ops = CpuOps(KERNELS, policy)
    dense = torch.nn.functional.linear(hidden, weight)
    assert torch.equal(ops.lm_head(hidden, weight), dense)  # dense format: torch's matmul
    policy.quantized = True
    got = ops.lm_head(hidden, weight)
    want = int8_activations(hidden) @ weight.double().T  # exact weights, int8-rounded activations
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)
    assert not torch.equal(got, dense)
    off_grid = torch.randn(300, 576)
    assert torch.equal(ops.lm_head(hidden, off_grid), torch.nn.functional.linear(hidden, off_grid))
    weight.mul_(1.5)  # an in-place change is seen: no stale codes
    torch.testing.assert_close(ops.lm_head(hidden, weight).double(), int8_activations(hidden) @ weight.double().T,
                               atol=1e-4, rtol=0)


def test_default_formats_follow_the_cpu(monkeypatch) -> None:
    from platforms.cpu import platform as cpu_platform

    p = cpu_platform.CpuPlatform()
    monkeypatch.setattr(cpu_platform, "has_native_bf16", lambda: True)
    assert p.default_formats(torch.bfloat16, "q4") == (torch.bfloat16, "int4")
    monkeypatch.setattr(cpu_platform, "has_native_bf16", lambda: False)
    assert p.default_formats(torch.bfloat16, "q4") == (torch.float32, "int4")
    assert p.default_formats(torch.bfloat16, None) == (torch.float32, "dense")
    monkeypatch.setattr(cpu_platform, "kernels_status", lambda: (False, "no compiler"))
    assert p.default_formats(torch.bfloat16, "q4") == (torch.float32, "dense")


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_float32_layers_take_grouped_codes_for_small_steps(path: str, fmt: str) -> None:
    import dataclasses

    from core.models.layers import ColumnParallelLinear
    from platforms.cpu.linear import GROUPED_MAX_ROWS, linear_method
    from tests.helpers import cpu_context

    ctx = dataclasses.replace(cpu_context(dtype=torch.float32), weight_format=fmt, linear_method=linear_method(fmt))
    w = q_grid(4 if fmt == "int4" else 8, 96, 64, seed=9)
    b = torch.randn(96, generator=torch.Generator().manual_seed(10))
    layer = ColumnParallelLinear(64, 96, ctx, bias=True)
    layer.load_weight("weight", w)
    layer.load_weight("bias", b)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(11))
    got = layer(x)
    assert isinstance(layer.packed_weight, GroupedQuant) and layer.packed_weight.bits == (4 if fmt == "int4" else 8)
    want = (int8_activations(x.reshape(6, 64)) @ w.double().T + b.double()).view(2, 3, 96)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)
    big = torch.randn(GROUPED_MAX_ROWS + 1, 64, generator=torch.Generator().manual_seed(12))
    if path in PANEL_PATHS and fmt == "int4":  # the many-row kernel: prompts take int4 codes too
        want = (int8_activations(big) @ w.double().T + b.double())
        torch.testing.assert_close(layer(big).double(), want, atol=1e-4, rtol=0)
    else:
        assert torch.equal(layer(big), torch.nn.functional.linear(big, w, b))  # dense weight, bit-equal


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mode", [0, 1])
def test_float16_scales_give_the_float32_results_bit_for_bit(path: str, bits: int, mode: int) -> None:
    # The same scale values in half the bytes: every product, so every output, is unchanged.
    half, _ = random_codes(bits, 75, 320, seed=31, scale_dtype=torch.float16)
    full = GroupedQuant(bits, half.codes, half.scales.float(), None if half.mins is None else half.mins.float())
    for rows in (1, 5):
        x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(grouped_matmul(KERNELS, x, half, mode), grouped_matmul(KERNELS, x, full, mode))


def test_grouping_keeps_float16_scales_only_when_exact() -> None:
    for bits in (4, 8):
        packed = (group_int4 if bits == 4 else group_int8)(q_grid(bits, 64, 128, seed=9))
        assert packed.scales.dtype == torch.float16  # a GGUF grid: its scales are float16 values
        assert packed.mins is None or packed.mins.dtype == torch.float16
    lossy = group_int4(torch.randn(16, 64, generator=torch.Generator().manual_seed(2)))
    assert lossy.scales.dtype == lossy.mins.dtype == torch.float32  # rounding them would change weights


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_kernel_is_the_torch_formula_bit_for_bit(bits: int, scale_dtype) -> None:
    packed, dense = random_codes(bits, 70, 96, seed=21, scale_dtype=scale_dtype)
    out = torch.empty(70, 96)
    KERNELS.quant_dequantize(out, packed.codes, packed.scales, packed.mins, bits)
    assert torch.equal(out, packed.dequantize())  # no fused multiply-add: the same roundings
    torch.testing.assert_close(out.double(), dense, atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError, match="out has 69 rows, the codes 70"):
        KERNELS.quant_dequantize(torch.empty(69, 96), packed.codes, packed.scales, packed.mins, bits)


def test_float32_layers_with_exact_codes_drop_the_dense_weight_and_prompts_stay_exact(path: str) -> None:
    # Prompts multiply by int4 codes where the path has the many-row kernel; otherwise (int8
    # codes, other paths) by the exact weight, dequantized again for a released layer, through
    # the dense GEMM: bit-equal to the dense layer.
    import dataclasses

    from core.models.layers import ColumnParallelLinear
    from platforms.cpu.linear import GROUPED_MAX_ROWS, is_released, linear_method
    from tests.helpers import cpu_context

    def layer_for(fmt: str, w: torch.Tensor, b: torch.Tensor) -> ColumnParallelLinear:
        ctx = dataclasses.replace(cpu_context(dtype=torch.float32), weight_format=fmt, linear_method=linear_method(fmt))
        layer = ColumnParallelLinear(w.shape[1], w.shape[0], ctx, bias=True)
        layer.load_weight("weight", w)
        layer.load_weight("bias", b)
        return layer

    g = torch.Generator().manual_seed(22)
    exact, lossy = q_grid(8, 96, 128, seed=23), torch.randn(96, 128, generator=g)  # Q8_0 grid / none
    exact4 = q_grid(4, 96, 128, seed=24)  # Q4_1 grid: the embedded model's layers
    b = torch.randn(96, generator=g)
    big = torch.randn(GROUPED_MAX_ROWS + 37, 128, generator=g)
    small = torch.randn(3, 128, generator=g)
    for fmt, w, released in (("int8", exact, True), ("int4", lossy, False), ("int4", exact4, True)):
        layer = layer_for(fmt, w, b)
        decode = layer(small)  # prepares the layer on first use
        assert is_released(layer) is released and (layer.weight.numel() == 0) is released
        prompt = layer(big)
        if path in PANEL_PATHS and fmt == "int4":
            assert torch.equal(prompt, grouped_matmul(KERNELS, big, layer.packed_weight) + b), fmt
        else:
            assert torch.equal(prompt, torch.nn.functional.linear(big, w, b)), fmt  # exact weight, same GEMM
        layer.load_weight("bias", b)  # resets packed_weight: the codes come back, not a repack
        assert torch.equal(layer(small), decode) and torch.equal(layer(big), prompt)
    released_layer = layer_for("int8", exact, b)
    released_layer(small)
    with pytest.raises(ValueError, match="the model expects"):  # a released layer takes no new weight
        released_layer.load_weight("weight", exact)
