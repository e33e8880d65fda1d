"""The block-scaled FP8 prefill probe of platforms/cuda/quant.py, on the CPU: cuBLASLt is
stood in for by a ``torch._scaled_mm`` that computes the 1x128-scaled product in float32 and
refuses row counts that are not a multiple of ``align`` with cuBLASLt's error (the H200
refused 17 rows, took 200). The probe must find the smallest alignment that works, pad to
it, and fall back (logged once) when none works or the results are wrong. On the GPU,
tests/cuda/test_cuda_quant.py runs the real thing."""

from __future__ import annotations

import logging

import pytest
import torch

from core.quantization.tensors import FP8_MAX, Fp8Weight
from platforms.cuda import quant
from platforms.cuda.quant import BLOCK_ROW_ALIGNMENTS, block_scaled_rows, fp8_scaled_mm

CPU = torch.device("cpu")


def fake_scaled_mm(align: int, wrong: bool = False):
    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        m, k = a.shape
        if m % align:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling "
                               "`cublasLtMatmulAlgoGetHeuristic(...)`")
        assert scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m)  # outer-dim major
        xa = a.float() * scale_a.repeat_interleave(128, dim=1)
        wb = b.float() * scale_b.repeat_interleave(128, dim=0)
        out = xa @ (wb.flip(0) if wrong else wb)
        return out.to(out_dtype)
    return scaled_mm


@pytest.fixture(autouse=True)
def fresh_probe():
    block_scaled_rows.cache_clear()
    yield
    block_scaled_rows.cache_clear()


def block_weight(n: int, k: int, gen: torch.Generator) -> Fp8Weight:
    w = torch.randn(n, k, generator=gen)
    scales = w.abs().view(n, k // 128, 128).amax(dim=2) / FP8_MAX
    codes = (w / scales.repeat_interleave(128, dim=1)).to(torch.float8_e4m3fn)
    return Fp8Weight(codes, scales, 128)


@pytest.mark.parametrize("align", [1, 4, 16, 128])
def test_probe_finds_the_smallest_alignment_and_prefill_pads_to_it(monkeypatch, align):
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm(align))
    want_align = min(a for a in BLOCK_ROW_ALIGNMENTS if a % align == 0)
    assert block_scaled_rows(CPU) == want_align
    gen = torch.Generator().manual_seed(align)
    w = block_weight(64, 384, gen)
    packed = quant._pack(w, CPU)
    assert packed.scale_b is not None and packed.row_align == want_align
    for rows in (17, 1, 130):
        x = torch.randn(rows, 384, generator=gen).to(torch.bfloat16)
        y = fp8_scaled_mm(packed, x)
        assert y.shape == (rows, 64)
        want = x.double() @ w.dequantize(torch.float64).T
        assert float((y.double() - want).norm() / want.norm()) < 0.05


@pytest.mark.parametrize("wrong", [False, True])
def test_no_working_alignment_means_dequantized_prefill_logged_once(monkeypatch, caplog, wrong):
    # wrong=False: every row count refused; wrong=True: accepted but the product is wrong
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm(1 << 20 if not wrong else 1, wrong))
    with caplog.at_level(logging.WARNING, logger="platforms.cuda.quant"):
        assert block_scaled_rows(CPU) == 0
        assert block_scaled_rows(CPU) == 0  # cached: asked once
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert ("CUBLAS_STATUS_NOT_SUPPORTED" in warnings[0]) != wrong and "dequantize" in warnings[0]
    packed = quant._pack(block_weight(64, 256, torch.Generator().manual_seed(1)), CPU)
    assert packed.scale_b is None  # CudaQuantizedLinear.matmul then dequantizes for prefill


def test_per_row_fp8_needs_no_probe(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("per-row scales must not probe block scaling")

    monkeypatch.setattr(quant, "block_scaled_rows", refuse)
    w = torch.randn(32, 256)
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    packed = quant._pack(Fp8Weight((w / scale).to(torch.float8_e4m3fn), scale, 256), CPU)
    assert packed.scale_b.shape == (1, 32) and packed.row_align == 1
