"""The CUDA platform: NVIDIA GPUs through a CUDA build of torch and the csrc/ kernels.

Nothing here touches the GPU at import time, and :meth:`CudaPlatform.probe` never
initialises CUDA (it reads torch's build info, counts devices through NVML, and checks that
the kernels can be loaded), so probing is safe before a fork.
"""

from __future__ import annotations

import glob
from typing import Any

import torch

from core.platform import ProbeResult
from platforms.cuda.attention import CudaPagedAttention
from platforms.cuda.build import NVCC
from platforms.gpu_platform import GpuPlatform

PROBE_SCORE = 100
"""Score when usable: above the CPU platform's, so a GPU host picks CUDA by default."""


def visible_gpu_count() -> int:
    """NVIDIA GPUs this process may use, counted without initialising CUDA.

    NVML (through torch) honours CUDA_VISIBLE_DEVICES; where NVML is unavailable the
    driver's device nodes are counted instead.
    """
    try:
        count = torch.cuda._device_count_nvml()
    except Exception:  # torch without the helper, or a broken NVML: fall back
        count = -1
    if count >= 0:
        return count
    return len(glob.glob("/dev/nvidia[0-9]*"))


class CudaPlatform(GpuPlatform):
    """NVIDIA GPUs: the shared GPU platform with nvcc's build of csrc/ and its fused ops."""

    name = "cuda"
    verification = "real hardware"  # evidence: docs/platforms.md
    device_visibility_env = "CUDA_VISIBLE_DEVICES"
    toolchain = NVCC
    paged_attention = CudaPagedAttention

    @classmethod
    def probe(cls) -> ProbeResult:
        if torch.version.cuda is None:
            build = "ROCm" if getattr(torch.version, "hip", None) else "CPU-only"
            return ProbeResult(
                0,
                f"torch {torch.__version__} is a {build} build (torch.version.cuda is None); "
                "install a CUDA build of torch to use the cuda platform",
            )
        gpus = visible_gpu_count()
        if gpus == 0:
            return ProbeResult(
                0,
                f"torch {torch.__version__} supports CUDA {torch.version.cuda} but no NVIDIA GPU "
                "is visible (no driver, no device, or CUDA_VISIBLE_DEVICES hides them)",
            )
        ok, how = cls.toolchain.kernels_status()
        if not ok:
            return ProbeResult(0, how)
        return ProbeResult(
            PROBE_SCORE,
            f"{gpus} NVIDIA GPU(s), torch {torch.__version__} (CUDA {torch.version.cuda}); "
            f"kernels: {how}",
        )

    def ops(self) -> dict[str, Any]:
        """Fused csrc kernels for RMSNorm (+ residual), SiLU-and-mul and rotary."""
        from platforms.cuda.ops import cuda_ops

        return cuda_ops()

    def linear_method(self, weight_format: str) -> Any:
        """Dense weights multiply decode rows through csrc/gemv.cu (platforms/cuda/gemv.py)."""
        from core.models.layers import DENSE
        from platforms.cuda.gemv import CUDA_DENSE

        method = super().linear_method(weight_format)
        return CUDA_DENSE if method is DENSE else method

    @classmethod
    def quantization_methods(cls) -> dict[str, Any]:
        """Every built-in method kept quantized: FP8 through torch._scaled_mm, 4/8-bit codes
        through csrc/quant (see platforms/cuda/quant.py)."""
        from platforms.cuda.quant import QUANTIZED_LINEAR

        return dict(QUANTIZED_LINEAR)

    @classmethod
    def kv_cache_dtypes(cls) -> tuple[str, ...]:
        return ("fp8_e4m3",)  # csrc/ cache write and decode kernels, SDPA prompts
