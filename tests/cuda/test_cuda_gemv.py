"""csrc/gemv.cu (the decode-sized dense GEMM, a benchmark candidate: docs/benchmarks/cuda_gemv.md)
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
