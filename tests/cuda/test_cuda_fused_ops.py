"""The fused csrc ops (platforms/cuda/ops.py) against the torch reference in core/ops.py.

Fresh seeded random inputs for every case; the raw ops write into NaN-poisoned outputs, so an
element the kernel skips shows up. Tolerances are one rounding of the storage dtype: the
kernels follow the reference's roundings, only float32 reduction order and exp differ.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/cuda/test_cuda_fused_ops.py``.
"""

from __future__ import annotations

import pytest
import torch

from core import ops as ref
from platforms.cuda import ops as fused
from platforms.cuda.build import load_ops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def rand(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).cuda()


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def close(got, want, dtype):
    assert not torch.isnan(got).any(), "an output element was never written"
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 4096), (300, 2048), (3, 5120)])
def test_rms_norm_and_fused_add(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * 31 + hidden)
    x, res = rand((rows, hidden), dtype, gen, 3.0), rand((rows, hidden), dtype, gen)
    w = rand((hidden,), dtype, gen)
    out = poisoned((rows, hidden), dtype)
    load_ops().rms_norm(out, x, w, 1e-5)
    close(out, ref.rms_norm(x, w, 1e-5), dtype)
    out, new_res = poisoned((rows, hidden), dtype), poisoned((rows, hidden), dtype)
    load_ops().fused_add_rms_norm(out, new_res, x, res, w, 1e-6)
    want_out, want_res = ref.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(new_res, want_res)  # one rounding of the same float sum
    close(out, want_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 64), (5, 14336), (257, 1024)])
def test_silu_and_mul(dtype, rows, d):
    gen = torch.Generator().manual_seed(rows + d)
    x = rand((rows, 2 * d), dtype, gen, 4.0)
    out = poisoned((rows, d), dtype)
    load_ops().silu_and_mul(out, x)
    close(out, ref.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,head,rotary_dim", [(32, 8, 128, 128), (4, 2, 64, 64), (6, 1, 128, 64)]
)
def test_rotary_on_views_of_a_fused_qkv(dtype, heads, kv_heads, head, rotary_dim):
    gen = torch.Generator().manual_seed(heads * head + rotary_dim)
    tokens, max_pos = 37, 4096
    qkv = rand((tokens, (heads + 2 * kv_heads) * head), dtype, gen)
    q, k, _ = qkv.split([heads * head, kv_heads * head, kv_heads * head], dim=-1)
    q, k = q.view(tokens, heads, head), k.view(tokens, kv_heads, head)  # strided views
    angles = torch.rand((max_pos, rotary_dim // 2), generator=gen) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).cuda()
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).cuda()
    q_out, k_out = poisoned(q.shape, dtype), poisoned(k.shape, dtype)
    load_ops().rotary_embedding(q_out, k_out, positions, q, k, cos_sin, rotary_dim)
    want_q, want_k = ref.rotary_embedding(positions, q, k, cos_sin, rotary_dim)
    close(q_out, want_q, dtype)
    close(k_out, want_k, dtype)


def test_wrappers_keep_the_functional_contract_and_fall_back_on_odd_rows():
    gen = torch.Generator().manual_seed(9)
    dtype = torch.bfloat16
    x, res, w = (rand((4, 60), dtype, gen), rand((4, 60), dtype, gen), rand((60,), dtype, gen))
    x_before, res_before = x.clone(), res.clone()
    # 60 bf16 elements are not whole 16-byte vectors: the reference runs, bit for bit.
    assert torch.equal(fused.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    got, want = fused.fused_add_rms_norm(x, res, w, 1e-5), ref.fused_add_rms_norm(x, res, w, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(fused.silu_and_mul(x), ref.silu_and_mul(x))
    # Inputs are never written.
    assert torch.equal(x, x_before) and torch.equal(res, res_before)
    # The kernel path allocates fresh outputs and leaves inputs alone too.
    x, res, w = rand((3, 256), dtype, gen), rand((3, 256), dtype, gen), rand((256,), dtype, gen)
    x_before, res_before = x.clone(), res.clone()
    out, new_res = fused.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(x, x_before) and torch.equal(res, res_before)
    close(out, ref.fused_add_rms_norm(x, res, w, 1e-5)[0], dtype)


def test_ops_capture_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(11)
    dtype = torch.bfloat16
    x, w = rand((8, 512), dtype, gen), rand((512,), dtype, gen)
    fused.rms_norm(x, w, 1e-5)  # load the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused.silu_and_mul(fused.rms_norm(x, w, 1e-5))
    x.copy_(rand((8, 512), dtype, gen))
    graph.replay()
    close(out, ref.silu_and_mul(ref.rms_norm(x, w, 1e-5)), dtype)
