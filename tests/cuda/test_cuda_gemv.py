"""csrc/gemv.cu (the decode-sized dense GEMM: docs/benchmarks/cuda_gemv.md) and the CUDA platform's dense
linear method over it (platforms/cuda/gemv.py)
against a float64 product on fresh random inputs.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/cuda/test_cuda_gemv.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

# Tolerances: float32 accumulation of k products, then one rounding to the storage dtype.
_TOL = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = x.double() @ w.double().T
    tol = _TOL[x.dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_warp,split", [(1, 1), (1, 4), (2, 1), (2, 4), (4, 1)])
@pytest.mark.parametrize("m", range(1, 9))
def test_gemv_matches_float64(dtype, per_warp, split, m):
    from platforms.cuda.gemv import gemv, gemv_fits

    g = torch.Generator(device="cuda").manual_seed(1000 * m + 10 * per_warp + split)
    # n not a multiple of the rows per warp or CTA; k not a multiple of one warp's stride.
    n, k = 1027, 4096 + 8 * 37
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    assert gemv_fits(x, w)
    _check(gemv(x, w, per_warp, split), x, w)


def test_gemv_strided_rows_and_llama_shapes():
    from platforms.cuda.gemv import gemv, gemv_fits

    g = torch.Generator(device="cuda").manual_seed(7)
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        big = torch.randn(4, k + 64, device="cuda", generator=g).bfloat16()
        x = big[:, :k]  # rows strided by k + 64 elements
        w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
        assert gemv_fits(x, w)
        _check(gemv(x, w), x, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_warp", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_gemv_split_across_warps_matches_float64(dtype, per_warp, m):
    """split_k 4: a CTA's four warps share each row's inputs (the long down projection's
    layout); k not a multiple of the four warps' stride, n not a multiple of a CTA's rows."""
    from platforms.cuda.gemv import GEMV_SPLIT_K, gemv

    g = torch.Generator(device="cuda").manual_seed(31 * m + per_warp)
    n, k = 1027, 14336 + 8 * 37
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    got = gemv(x, w, per_warp, GEMV_SPLIT_K)
    _check(got, x, w)
    assert got.shape == (m, n)


def _gate_up(m, d, k, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(2 * d, k, device="cuda", generator=g) * (3 / k**0.5)).to(dtype)  # gates of a few units
    return x, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_gemv_silu_and_mul_is_the_kernel_then_silu_and_mul(dtype, split, m):
    """SiLU-and-mul in the epilogue gives, bit for bit, the kernel's [gate | up] product
    followed by the CUDA platform's silu_and_mul (same sums, same roundings), and agrees with
    the float64 silu(x g^T) * (x u^T)."""
    from platforms.cuda.build import load_ops
    from platforms.cuda.gemv import gemv
    from platforms.cuda.ops import silu_and_mul

    d, k = 1032, 4096 + 8 * 37
    x, w = _gate_up(m, d, k, dtype, 100 * m + split)
    fused = torch.empty(m, d, device="cuda", dtype=dtype)
    load_ops().gemv(fused, x, w, 2, split, True)
    assert torch.equal(fused, silu_and_mul(gemv(x, w, 2, split)))
    xd, wd = x.double(), w.double()
    want = torch.nn.functional.silu(xd @ wd[:d].T) * (xd @ wd[d:].T)
    tol = 3 * _TOL[dtype]
    torch.testing.assert_close(fused.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_gemv_silu_and_mul_partial_last_cta_and_strided_out():
    """d not a multiple of a CTA's four gate/up pairs, output rows strided: against float64."""
    from platforms.cuda.build import load_ops

    m, d, k = 2, 1030, 2048
    x, w = _gate_up(m, d, k, torch.bfloat16, 5)
    big = torch.full((m, d + 6), 7.0, device="cuda", dtype=torch.bfloat16)
    load_ops().gemv(big[:, :d], x, w, 2, 1, True)
    xd, wd = x.double(), w.double()
    want = torch.nn.functional.silu(xd @ wd[:d].T) * (xd @ wd[d:].T)
    tol = 3 * _TOL[torch.bfloat16]
    torch.testing.assert_close(big[:, :d].double(), want, rtol=tol, atol=tol * want.abs().max().item())
    assert (big[:, d:] == 7.0).all()  # nothing written past each output row


def test_gemv_refuses_what_it_cannot_read():
    from platforms.cuda.build import load_ops

    ops = load_ops()
    x = torch.randn(9, 64, device="cuda")
    w = torch.randn(32, 64, device="cuda")
    with pytest.raises(RuntimeError, match="1 to 8"):
        ops.gemv(torch.empty(9, 32, device="cuda"), x, w, 1)
    with pytest.raises(RuntimeError, match="multiple of 4"):
        ops.gemv(torch.empty(1, 32, device="cuda"), torch.randn(1, 62, device="cuda"),
                 torch.randn(32, 62, device="cuda"), 1)
    one = torch.randn(1, 64, device="cuda")
    with pytest.raises(RuntimeError, match="split_k 3 must be 1 or 4"):
        ops.gemv(torch.empty(1, 32, device="cuda"), one, w, 1, 3)
    with pytest.raises(RuntimeError, match="only with 1 or 2 rows per warp"):
        ops.gemv(torch.empty(1, 32, device="cuda"), one, w, 4, 4)
    with pytest.raises(RuntimeError, match="even number of rows"):
        ops.gemv(torch.empty(1, 15, device="cuda"), one, torch.randn(31, 64, device="cuda"), 2, 1, True)
    with pytest.raises(RuntimeError, match="rows_per_warp 2"):
        ops.gemv(torch.empty(1, 16, device="cuda"), one, w, 1, 1, True)
    with pytest.raises(RuntimeError, match=r"want out \[m, n / 2\]"):
        ops.gemv(torch.empty(1, 32, device="cuda"), one, w, 2, 1, True)


def _layer(n, k, dtype, gen):
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter((torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype))
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 4096), (2, 8192), (3, 4096), (1, 14336), (2, 16392)])
def test_the_dense_method_takes_the_kernel_for_one_or_two_rows(dtype, m, k):
    """CudaDenseLinear: 1-2 rows of fp16 / bf16 over up to 16,384 inputs without a bias give
    exactly the kernel's result on a Hopper or newer GPU; more rows, longer inputs, fp32, a
    bias (cuBLAS rounds product and bias once) and older GPUs give exactly cuBLAS's; both agree
    with the float64 product; leading dims kept."""
    from platforms.cuda.gemv import CUDA_DENSE, DENSE_GEMV_MAX_K, gemv

    g = torch.Generator(device="cuda").manual_seed(m * k + len(str(dtype)))
    layer = _layer(1000, k, dtype, g)
    x = torch.randn(m, 1, k, device="cuda", generator=g).to(dtype)
    bias = torch.randn(1000, device="cuda", generator=g).to(dtype)
    got = CUDA_DENSE.apply(layer, x, None)
    assert got.shape == (m, 1, 1000)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    kernel = dtype != torch.float32 and m <= 2 and k <= DENSE_GEMV_MAX_K and hopper
    want = gemv(x.reshape(m, k), layer.weight) if kernel else torch.nn.functional.linear(x, layer.weight)
    assert torch.equal(got.reshape(m, 1000), want.reshape(m, 1000))
    _check(got.reshape(m, 1000), x.reshape(m, k), layer.weight)
    with_bias = CUDA_DENSE.apply(layer, x, bias)
    assert torch.equal(with_bias, torch.nn.functional.linear(x, layer.weight, bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 3])
def test_the_dense_method_fuses_silu_and_mul_where_it_takes_the_kernel(monkeypatch, dtype, m):
    """CudaDenseLinear.apply_silu_and_mul through a model's merged gate/up layer: where the
    method takes the kernel (1-2 bf16 rows on Hopper or newer) and it is given the platform's
    own silu_and_mul, the fused epilogue; else cuBLAS or the kernel, then the op it is given
    (a plugin's override is called, never bypassed). Either way exactly its apply() followed
    by the platform's silu_and_mul, leading dims kept; a bias goes to cuBLAS."""
    import platforms.cuda.gemv as gemv_mod
    from platforms.cuda.gemv import CUDA_DENSE
    from platforms.cuda.ops import silu_and_mul

    fused_calls = []
    real = gemv_mod.gemv_silu_and_mul
    monkeypatch.setattr(gemv_mod, "gemv_silu_and_mul", lambda *a: fused_calls.append(1) or real(*a))
    g = torch.Generator(device="cuda").manual_seed(11 * m)
    d, k = 1024, 4096
    layer = _layer(2 * d, k, dtype, g)
    x = torch.randn(m, 1, k, device="cuda", generator=g).to(dtype)
    unfused = silu_and_mul(CUDA_DENSE.apply(layer, x, None))
    got = CUDA_DENSE.apply_silu_and_mul(layer, x, None, silu_and_mul)
    assert got.shape == (m, 1, d)
    assert torch.equal(got, unfused)
    fused = dtype == torch.bfloat16 and m <= 2 and torch.cuda.get_device_capability()[0] >= 9
    assert fused_calls == ([1] if fused else [])
    override = []  # a plugin's silu_and_mul: called, not fused away
    got = CUDA_DENSE.apply_silu_and_mul(layer, x, None, lambda y: override.append(1) or silu_and_mul(y))
    assert override == [1] and fused_calls == ([1] if fused else []) and torch.equal(got, unfused)
    override.clear()
    bias = torch.randn(2 * d, device="cuda", generator=g).to(dtype)
    with_bias = CUDA_DENSE.apply_silu_and_mul(layer, x, bias, lambda y: override.append(1) or silu_and_mul(y))
    assert override == [1]
    assert torch.equal(with_bias, silu_and_mul(torch.nn.functional.linear(x, layer.weight, bias)))


@pytest.mark.parametrize("m", [1, 2])
def test_gemv_waits_for_the_kernel_that_writes_x(m):
    """The kernel is launched to overlap the kernel before it and reads x only after waiting
    for it: captured in a CUDA graph right after core_C's RMSNorm (which lets its dependents
    start early), every replay with new inputs gives that replay's product."""
    from platforms.cuda.gemv import gemv
    from platforms.cuda.ops import rms_norm

    g = torch.Generator(device="cuda").manual_seed(7 + m)
    n, k, dtype = 2048, 4096, torch.bfloat16
    layer = _layer(n, k, dtype, g)
    norm_w = (torch.rand(k, device="cuda", generator=g) + 0.5).to(dtype)
    x_in = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gemv(rms_norm(x_in, norm_w, 1e-6), layer.weight)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv(rms_norm(x_in, norm_w, 1e-6), layer.weight)
    for _ in range(20):
        x_in.copy_(torch.randn(m, k, device="cuda", generator=g).to(dtype))
        graph.replay()
        xf = x_in.float()
        xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.float()).to(dtype)
        _check(y, xn, layer.weight)


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_the_lm_head_op_takes_the_kernel_when_switched_on(monkeypatch, rows):
    """platforms.cuda.ops' lm_head: float32 logits; with LM_HEAD_GEMV on, 1-2 bf16 rows are
    exactly the kernel's product (on Hopper or newer), 3 rows exactly cuBLAS's; off, cuBLAS's
    for every row count.
    Both agree with the float64 product."""
    import platforms.cuda.gemv as gemv_mod
    from platforms.cuda.ops import cuda_ops

    lm_head = cuda_ops()["lm_head"]
    g = torch.Generator(device="cuda").manual_seed(rows)
    hidden = torch.randn(rows, 4096, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(32000 + 8, 4096, device="cuda", generator=g) / 64).bfloat16()
    cublas = torch.nn.functional.linear(hidden, weight).float()
    monkeypatch.setattr(gemv_mod, "LM_HEAD_GEMV", False)
    assert torch.equal(lm_head(hidden, weight), cublas)
    monkeypatch.setattr(gemv_mod, "LM_HEAD_GEMV", True)
    got = lm_head(hidden, weight)
    assert got.dtype == torch.float32 and got.shape == (rows, 32008)
    kernel = rows <= 2 and torch.cuda.get_device_capability()[0] >= 9
    assert torch.equal(got, gemv_mod.gemv(hidden, weight).float() if kernel else cublas)
    _check(got.bfloat16(), hidden, weight)
