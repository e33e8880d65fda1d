"""csrc/gemv.cu (the decode-sized dense GEMM: docs/benchmarks/cuda_gemv.md) and the CUDA platform's dense
linear method over it (platforms/cuda/gemv.py)
against a float64 product on fresh random inputs.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/cuda/test_cuda_gemv.py``.
"""

from __future__ import annotations

import types

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
    monkeypatch.setattr(gemv_mod, "gemv_silu_and_mul", lambda *a, **k: fused_calls.append(1) or real(*a, **k))
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


def _qkv_case(m, heads, kv_heads, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, k = (heads + 2 * kv_heads) * d, 2048
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    positions = torch.randint(0, 4096, (m,), device="cuda", generator=g)
    return x, w, positions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rot", [128, 64])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("split", [1, 4])
def test_gemv_rope_is_the_kernel_then_rotary_embedding(dtype, rot, m, split):
    """The fused QKV GEMV rotating its query and key heads in the epilogue: values heads and
    unrotated features exactly the plain kernel's; rotated features the CUDA rotary_embedding
    op's on the plain kernel's output (same inputs, same formula: equal but for the
    compiler's FMA contraction, so to one rounding step); and the float64 rotation of the
    float64 product to the dtype's rounding."""
    from core.models.rope import cos_sin_table
    from platforms.cuda.gemv import gemv, gemv_rope
    from platforms.cuda.ops import rotary_embedding

    heads, kv_heads, d = 4, 2, 128
    x, w, positions = _qkv_case(m, heads, kv_heads, d, dtype, 10 * m + rot)
    from platforms.cuda.build import load_ops

    cs = cos_sin_table(rot, {"rope_type": "default", "rope_theta": 500000.0}, 4096).cuda()
    got = torch.empty(m, w.shape[0], device="cuda", dtype=dtype)
    load_ops().gemv_rope(got, x, w, split, positions, cs, heads + kv_heads, d, rot)
    if split == 4:
        assert torch.equal(got, gemv_rope(x, w, positions, cs, heads + kv_heads, d, rot))  # the default
    plain = gemv(x, w, 2, split)
    q_size, kv_size = heads * d, kv_heads * d
    q, k, v = plain.split([q_size, kv_size, kv_size], dim=-1)
    q_rot, k_rot = rotary_embedding(positions, q.reshape(m, heads, d), k.reshape(m, kv_heads, d), cs, rot)
    want = torch.cat([q_rot.reshape(m, -1), k_rot.reshape(m, -1), v], dim=-1)
    assert torch.equal(got[:, q_size + kv_size:], v)
    heads_got = got[:, : q_size + kv_size].reshape(m, heads + kv_heads, d)
    heads_want = want[:, : q_size + kv_size].reshape(m, heads + kv_heads, d)
    assert torch.equal(heads_got[..., rot:], heads_want[..., rot:])  # the unrotated tail
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(heads_got.float(), heads_want.float(), rtol=eps, atol=eps)
    assert (heads_got == heads_want).float().mean() > 0.99
    # float64: the product, then the rotation of each head's first rot features.
    p = (x.double() @ w.double().T)[:, : q_size + kv_size].reshape(m, heads + kv_heads, d)
    c, s = cs[positions].double().chunk(2, dim=-1)
    x1, x2 = p[..., : rot // 2], p[..., rot // 2 : rot]
    c, s = c[:, None, :], s[:, None, :]
    ref = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, p[..., rot:]], dim=-1)
    tol = 3 * _TOL[dtype]
    torch.testing.assert_close(heads_got.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("m", [1, 2, 3])
def test_the_dense_method_rotates_in_the_qkv_projection_where_it_takes_the_kernel(m):
    """CudaDenseLinear.apply_rope: 1-2 bf16 rows on Hopper or newer give gemv_rope's result;
    3 rows, a bias, or a rotary width the rotary op's kernel would not take give None (the
    model projects, then rotates)."""
    from core.models.layers import RotaryEmbedding
    from core.ops import Ops
    from platforms.cuda.gemv import CUDA_DENSE, gemv_rope
    from platforms.cuda.ops import cuda_ops

    heads, kv_heads, d = 4, 2, 128
    x, w, positions = _qkv_case(m, heads, kv_heads, d, torch.bfloat16, 5 + m)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(w)
    layer.head_size, layer.num_heads, layer.num_kv_heads = d, heads, kv_heads
    ctx = types.SimpleNamespace(ops=Ops(cuda_ops()), device=torch.device("cuda"))
    params = {"rope_type": "default", "rope_theta": 10000.0}
    rotary = RotaryEmbedding(d, 128, 4096, params, ctx)
    got = CUDA_DENSE.apply_rope(layer, x[:, None, :], None, positions, rotary)
    if m <= 2 and torch.cuda.get_device_capability()[0] >= 9:
        assert got.shape == (m, 1, w.shape[0])
        want = gemv_rope(x, w, positions, rotary.cos_sin_cache, heads + kv_heads, d, 128)
        assert torch.equal(got[:, 0], want)
    else:
        assert got is None
    assert CUDA_DENSE.apply_rope(layer, x, torch.zeros(w.shape[0], device="cuda").bfloat16(), positions, rotary) is None
    # rotary_dim / 2 not whole 16-byte vectors: the rotary op's torch path, so not fused
    assert CUDA_DENSE.apply_rope(layer, x, None, positions, RotaryEmbedding(d, 12, 4096, params, ctx)) is None
    # a plugin's rotary_embedding (core_op_overrides) or a subclass's forward runs as given
    plugin = types.SimpleNamespace(ops=Ops({**cuda_ops(), "rotary_embedding": lambda *a: None}), device=ctx.device)
    assert CUDA_DENSE.apply_rope(layer, x, None, positions, RotaryEmbedding(d, 128, 4096, params, plugin)) is None

    class Scaled(RotaryEmbedding):
        def forward(self, positions, query, key):
            return super().forward(positions, query, key)

    assert CUDA_DENSE.apply_rope(layer, x, None, positions, Scaled(d, 128, 4096, params, ctx)) is None


def test_gemv_rope_refusals_name_the_limits():
    from platforms.cuda.build import load_ops

    ops = load_ops()
    x, w = torch.randn(1, 64, device="cuda").bfloat16(), torch.randn(48, 64, device="cuda").bfloat16()
    out, pos = torch.empty(1, 48, device="cuda").bfloat16(), torch.zeros(1, dtype=torch.int64, device="cuda")
    cs = torch.zeros(16, 8, device="cuda")
    with pytest.raises(RuntimeError, match="do not fit a weight of 48 rows"):
        ops.gemv_rope(out, x, w, 1, pos, cs, 4, 16, 8)  # 64 rotated rows > 48
    with pytest.raises(RuntimeError, match="one per row of x"):
        ops.gemv_rope(out, x, w, 1, torch.zeros(2, dtype=torch.int64, device="cuda"), cs, 2, 16, 8)
    with pytest.raises(RuntimeError, match=r"rotary_dim 8\] table"):
        ops.gemv_rope(out, x, w, 1, pos, torch.zeros(16, 6, device="cuda"), 2, 16, 8)
    x3, pos3 = torch.randn(3, 64, device="cuda").bfloat16(), torch.zeros(3, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match="takes 1 or 2"):
        ops.gemv_rope(torch.empty(3, 48, device="cuda").bfloat16(), x3, w, 1, pos3, cs, 2, 16, 8)


def _norm_case(m, n, k, dtype, seed, scale=7.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # A residual stream, far from unit scale; at 1e-3 its mean square is near eps (1e-5).
    h = (scale * torch.randn(m, k, device="cuda", generator=g)).to(dtype)
    gamma = (1 + 0.3 * torch.randn(k, device="cuda", generator=g)).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    normed = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + 1e-5) * gamma.double()
    return h, gamma, w, normed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_warp,split", [(1, 1), (1, 4), (2, 1), (2, 4)])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("scale", [7.0, 1e-3])
def test_gemv_with_the_norm_folded_in_matches_float64(dtype, per_warp, split, m, scale):
    """kFoldNorm: the product of rms_norm(h) * gamma for un-normed rows h, against float64, and
    on average no farther from it than the CUDA rms_norm op followed by the plain kernel (which
    rounds the normed input to the dtype first: the one difference between the two); at a
    scale where eps weighs in too."""
    from platforms.cuda.gemv import gemv
    from platforms.cuda.ops import rms_norm

    h, gamma, w, normed = _norm_case(m, 1027, 4096 + 8 * 37, dtype, 100 * m + 10 * per_warp + split, scale)
    got = gemv(h, w, per_warp, split, norm=(gamma, 1e-5))
    want = normed @ w.double().T
    tol = _TOL[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    two_kernels = gemv(rms_norm(h, gamma, 1e-5), w, per_warp, split)
    torch.testing.assert_close(two_kernels.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    if dtype != torch.float32:
        assert (got.double() - want).abs().mean() <= (two_kernels.double() - want).abs().mean()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("split", [1, 4])
def test_the_folded_norm_takes_the_silu_and_rotary_epilogues(dtype, m, split):
    """kFoldNorm with SiLU-and-mul (gate/up) and with the rotary embedding (QKV): the value
    heads and unrotated features equal the plain folded kernel's bit for bit, and everything
    agrees with the float64 norm, product and epilogue."""
    from core.models.rope import cos_sin_table
    from platforms.cuda.gemv import gemv, gemv_rope, gemv_silu_and_mul

    d, k = 1032, 2048
    h, gamma, w, normed = _norm_case(m, 2 * d, k, dtype, 7 + m + split)
    got = gemv_silu_and_mul(h, w, norm=(gamma, 1e-5))
    p = normed @ w.double().T
    want = torch.nn.functional.silu(p[:, :d]) * p[:, d:]
    tol = 3 * _TOL[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())

    heads, kv_heads, hd, rot = 4, 2, 128, 64
    h, gamma, w, normed = _norm_case(m, (heads + 2 * kv_heads) * hd, k, dtype, 9 + m + split)
    positions = torch.tensor([5, 4000][:m], device="cuda")
    cs = cos_sin_table(rot, {"rope_type": "default", "rope_theta": 500000.0}, 4096).cuda()
    got = torch.empty(m, w.shape[0], device="cuda", dtype=dtype)
    from platforms.cuda.build import load_ops

    load_ops().gemv_rope(got, h, w, split, positions, cs, heads + kv_heads, hd, rot, gamma, 1e-5)
    if split == 4:
        assert torch.equal(got, gemv_rope(h, w, positions, cs, heads + kv_heads, hd, rot, norm=(gamma, 1e-5)))
    plain = gemv(h, w, 2, split, norm=(gamma, 1e-5))
    qk = (heads + kv_heads) * hd
    assert torch.equal(got[:, qk:], plain[:, qk:])  # value heads
    got_heads = got[:, :qk].reshape(m, heads + kv_heads, hd)
    assert torch.equal(got_heads[..., rot:], plain[:, :qk].reshape(m, heads + kv_heads, hd)[..., rot:])
    p = (normed @ w.double().T)[:, :qk].reshape(m, heads + kv_heads, hd)
    c, s = (t[:, None, :] for t in cs[positions].double().chunk(2, dim=-1))
    x1, x2 = p[..., : rot // 2], p[..., rot // 2 : rot]
    ref = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, p[..., rot:]], dim=-1)
    torch.testing.assert_close(got_heads.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_warp,split", [(1, 1), (1, 4), (2, 1), (2, 4)])
@pytest.mark.parametrize("m", [1, 2])
def test_gemv_adds_the_residual_in_its_epilogue(dtype, per_warp, split, m):
    """kAddResidual: bit for bit the plain kernel's output plus the residual in torch (each
    rounded to the dtype: what fused_add_rms_norm's residual add computes), into strided rows."""
    from platforms.cuda.gemv import gemv

    n, k = 1027, 4096
    g = torch.Generator(device="cuda").manual_seed(31 * m + per_warp + split)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    r = (5 * torch.randn(m, n + 5, device="cuda", generator=g)).to(dtype)[:, :n]
    assert torch.equal(gemv(x, w, per_warp, split, residual=r), gemv(x, w, per_warp, split) + r)


def test_the_folded_forms_refuse_what_they_do_not_take():
    from platforms.cuda.build import load_ops

    ops = load_ops()
    x3, w = torch.randn(3, 64, device="cuda").bfloat16(), torch.randn(32, 64, device="cuda").bfloat16()
    gamma = torch.ones(64, device="cuda").bfloat16()
    with pytest.raises(RuntimeError, match="folded RMSNorm takes 1 or 2"):
        ops.gemv(torch.empty(3, 32, device="cuda").bfloat16(), x3, w, 1, 1, False, gamma, 1e-5)
    x = x3[:1]
    out = torch.empty(1, 32, device="cuda").bfloat16()
    with pytest.raises(RuntimeError, match="norm_weight \\[48\\] must be .* of 64 elements"):
        ops.gemv(out, x, w, 1, 1, False, torch.ones(48, device="cuda").bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="x's dtype"):
        ops.gemv(out, x, w, 1, 1, False, gamma.float(), 1e-5)
    with pytest.raises(RuntimeError, match="not with silu_and_mul or norm_weight"):
        ops.gemv(out, x, w, 1, 1, False, gamma, 1e-5, out.clone())
    with pytest.raises(RuntimeError, match="not with silu_and_mul or norm_weight"):
        ops.gemv(torch.empty(1, 16, device="cuda").bfloat16(), x, w, 2, 1, True, None, 0.0, out.clone())
    with pytest.raises(RuntimeError, match="must have out's shape"):
        ops.gemv(out, x, w, 1, 1, False, None, 0.0, torch.empty(1, 31, device="cuda").bfloat16())


@pytest.mark.parametrize("m", [1, 2, 3])
def test_the_dense_method_folds_core_rms_norm_and_adds_the_residual_where_it_takes_the_kernel(m):
    """CudaDenseLinear.folds_norm / adds_residual: yes at 1-2 bf16 rows on Hopper or newer for
    core's RMSNorm on this platform's op, and then apply equals the folded kernel; no at 3
    rows, for an RMSNorm subclass, or for a plugin's rms_norm op (applied by the layer)."""
    from core.models.layers import RMSNorm
    from core.ops import Ops
    from platforms.cuda.gemv import CUDA_DENSE, gemv
    from platforms.cuda.ops import cuda_ops

    h, gamma, w, _ = _norm_case(m, 1024, 4096, torch.bfloat16, 40 + m)
    layer = torch.nn.Module()
    layer.weight, layer.bias = torch.nn.Parameter(w), None
    ctx = types.SimpleNamespace(ops=Ops(cuda_ops()), device=torch.device("cuda"), dtype=torch.bfloat16)
    norm = RMSNorm(4096, 1e-5, ctx)
    norm.weight.data.copy_(gamma)
    r = torch.randn(m, 1024, device="cuda").bfloat16()
    takes = m <= 2 and torch.cuda.get_device_capability()[0] >= 9
    assert CUDA_DENSE.folds_norm(layer, h, norm) == takes
    assert CUDA_DENSE.adds_residual(layer, h, r) == takes
    if takes:
        assert torch.equal(CUDA_DENSE.apply(layer, h, None, norm=norm), gemv(h, w, norm=(gamma, 1e-5)))
        assert torch.equal(CUDA_DENSE.apply(layer, h, None, residual=r), gemv(h, w, residual=r))

    class Shifted(RMSNorm):
        def forward(self, x, residual=None):
            return super().forward(x, residual)

    assert not CUDA_DENSE.folds_norm(layer, h, Shifted(4096, 1e-5, ctx))
    plugin = types.SimpleNamespace(ops=Ops({**cuda_ops(), "rms_norm": lambda *a: None}), device=ctx.device,
                                   dtype=torch.bfloat16)
    assert not CUDA_DENSE.folds_norm(layer, h, RMSNorm(4096, 1e-5, plugin))


def _spy_folded_gemv(monkeypatch) -> list[bool]:
    """For each call of the dense GEMV from here on, whether a residual reached it (which it
    does only in the folded layer form)."""
    from platforms.cuda import gemv as gemv_mod

    calls, real = [], gemv_mod.gemv
    monkeypatch.setattr(gemv_mod, "gemv", lambda *a, **k: calls.append(k.get("residual") is not None) or real(*a, **k))
    return calls


def test_the_folded_decode_steps_agree_with_the_fp32_model_as_the_unfolded_do(tiny_llama, monkeypatch):
    """A tiny bf16 Llama on CUDA, teacher-forced one decode row a step (the rows the folded
    layer takes: no norm kernel, the residual added by the output and down projections): its
    logits stay as close to the CPU fp32 model's as those of the same steps with folding off,
    and the most likely token agrees as often; the folded path was taken."""
    from core import LLM
    from platforms.cuda import gemv as gemv_mod
    from tests.integration.test_cpu_formats import teacher_forced_logits
    from tests.integration.test_engine_hf import random_prompts

    path = tiny_llama(seed=11, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2)
    prompts = random_prompts(4, 512, seed=12, lo=5, hi=20)
    conts = random_prompts(4, 512, seed=13, lo=24, hi=25)

    def logits(**kw):
        llm = LLM(model=str(path), max_model_len=256, kv_cache_memory="32MiB", **kw)
        out = torch.cat([teacher_forced_logits(llm, p, c).float().cpu() for p, c in zip(prompts, conts)])
        llm.engine.shutdown()
        return out

    ref = logits(platform="cpu", dtype="float32")
    calls = _spy_folded_gemv(monkeypatch)
    folded = logits(platform="cuda", dtype="bfloat16", enforce_eager=True)
    assert sum(calls) > 0
    monkeypatch.setattr(gemv_mod.CudaDenseLinear, "folds_norm", lambda *a: False)
    monkeypatch.setattr(gemv_mod.CudaDenseLinear, "adds_residual", lambda *a: False)
    plain = logits(platform="cuda", dtype="bfloat16", enforce_eager=True)
    err_folded, err_plain = (folded - ref).abs().mean().item(), (plain - ref).abs().mean().item()
    top_folded = (folded.argmax(-1) == ref.argmax(-1)).float().mean().item()
    top_plain = (plain.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"\nmean |logit - fp32|: folded {err_folded:.4f}, unfolded {err_plain:.4f}; "
          f"top-1 agreement {top_folded:.3f} / {top_plain:.3f}")
    assert err_folded <= 1.1 * err_plain
    assert top_folded >= top_plain - 0.05


def test_the_folded_decode_steps_replay_as_they_ran_eagerly(tiny_llama, monkeypatch):
    """The folded layer form captured in the decode CUDA graphs (bf16, one sequence a step: every
    decode row through the folded GEMVs) gives the greedy tokens it gives eagerly; the graphs
    were captured with the folded form (the residual reached the GEMV)."""
    from core import LLM
    from tests.integration.test_engine_hf import random_prompts, run

    path = tiny_llama(seed=17, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2)
    prompts = random_prompts(2, 512, seed=18, lo=5, hi=30)
    outs, calls = {}, _spy_folded_gemv(monkeypatch)
    for eager in (True, False):
        calls.clear()
        llm = LLM(model=str(path), platform="cuda", dtype="bfloat16", max_model_len=256,
                  kv_cache_memory="32MiB", enforce_eager=eager)
        outs[eager] = [run(llm, [p], max_new=24) for p in prompts]  # one row a step (a bucket of one)
        llm.engine.shutdown()
        assert sum(calls) > 0, f"enforce_eager={eager}: no folded GEMV"
    assert outs[False] == outs[True]
