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
@pytest.mark.parametrize("per_warp", [1, 2, 4])
@pytest.mark.parametrize("m", range(1, 9))
def test_gemv_matches_float64(dtype, per_warp, m):
    from platforms.cuda.gemv import gemv, gemv_fits

    g = torch.Generator(device="cuda").manual_seed(1000 * m + per_warp)
    # n not a multiple of the rows per warp or CTA; k not a multiple of one warp's stride.
    n, k = 1027, 4096 + 8 * 37
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    assert gemv_fits(x, w)
    _check(gemv(x, w, per_warp), x, w)


def test_gemv_strided_rows_and_llama_shapes():
    from platforms.cuda.gemv import gemv, gemv_fits

    g = torch.Generator(device="cuda").manual_seed(7)
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        big = torch.randn(4, k + 64, device="cuda", generator=g).bfloat16()
        x = big[:, :k]  # rows strided by k + 64 elements
        w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
        assert gemv_fits(x, w)
        _check(gemv(x, w), x, w)


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


def _layer(n, k, dtype, gen):
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter((torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype))
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 4096), (2, 8192), (3, 4096), (1, 14336)])
def test_the_dense_method_takes_the_kernel_for_one_or_two_rows(dtype, m, k):
    """CudaDenseLinear: 1-2 rows of fp16 / bf16 over up to 8,192 inputs without a bias give
    exactly the kernel's result on a Hopper or newer GPU; more rows, longer inputs, fp32, a
    bias (cuBLAS rounds product and bias once) and older GPUs give exactly cuBLAS's; both agree
    with the float64 product; leading dims kept."""
    from platforms.cuda.gemv import CUDA_DENSE, gemv

    g = torch.Generator(device="cuda").manual_seed(m * k + len(str(dtype)))
    layer = _layer(1000, k, dtype, g)
    x = torch.randn(m, 1, k, device="cuda", generator=g).to(dtype)
    bias = torch.randn(1000, device="cuda", generator=g).to(dtype)
    got = CUDA_DENSE.apply(layer, x, None)
    assert got.shape == (m, 1, 1000)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    kernel = dtype != torch.float32 and m <= 2 and k <= 8192 and hopper
    want = gemv(x.reshape(m, k), layer.weight) if kernel else torch.nn.functional.linear(x, layer.weight)
    assert torch.equal(got.reshape(m, 1000), want.reshape(m, 1000))
    _check(got.reshape(m, 1000), x.reshape(m, k), layer.weight)
    with_bias = CUDA_DENSE.apply(layer, x, bias)
    assert torch.equal(with_bias, torch.nn.functional.linear(x, layer.weight, bias))


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
