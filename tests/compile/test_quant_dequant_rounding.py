"""csrc/quant's dequantization must round as the reference does (core.quantization.tensors:
the fp32 product ``code * scale`` rounded, then ``+ min`` rounded): a fused multiply-add
rounds once and differs in the last bit for about a fifth of int4-with-mins weights, which
is what failed ``torch.equal`` on the H200 (docs/runs/2026-12-02-h200-cuda.log).

Checked in the PTX nvcc emits (no GPU needed): no ``quant_dequant_kernel`` instance may hold
an ``fma`` on f32, and the int4 instances must round the product and the sum separately.
Skipped only when nvcc is absent.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from platforms.cuda.build import CSRC_DIR, find_nvcc
from tests.compile.test_csrc_compiles import TORCH_NVCC_DEFINES

NVCC = find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA toolkit absent")


def _entries(ptx: str) -> dict[str, str]:
    """Kernel name -> its PTX body."""
    parts = re.split(r"(?=\.visible \.entry |\.entry )", ptx)
    return {m.group(1): p for p in parts if (m := re.search(r"\.entry (\S+)\(", p))}


def test_dequant_kernels_round_product_and_min_separately(tmp_path):
    out = tmp_path / "quant_gemm.ptx"
    cmd = [NVCC, "-std=c++17", "-O3", "-arch=compute_90", *TORCH_NVCC_DEFINES, "-I", str(CSRC_DIR),
           "-ptx", str(CSRC_DIR / "quant" / "quant_gemm.cu"), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    dequant = {k: v for k, v in _entries(out.read_text()).items() if "quant_dequant_kernel" in k}
    assert len(dequant) == 9, sorted(dequant)  # 3 activation dtypes x 3 codes
    fused = [k for k, body in dequant.items() if re.search(r"\bfma\.rn\.f32\b", body)]
    assert not fused, f"dequantization fused into an FMA (one rounding, not the reference's two): {fused}"
    int4 = [body for k, body in dequant.items() if "QuantCodeE0" in k]  # QuantCode::kInt4
    assert len(int4) == 3 and all("mul.rn.f32" in b and "add.rn.f32" in b for b in int4)
