"""The CUDA platform: NVIDIA GPUs through a CUDA build of torch and the csrc/ kernels.

Nothing here touches the GPU at import time, and :meth:`CudaPlatform.probe` never
initialises CUDA (it reads torch's build info, counts devices through NVML, and checks that
the kernels can be loaded), so probing is safe before a fork.
"""

from __future__ import annotations

import glob
from typing import TYPE_CHECKING, Any

import torch

from core.attention import AttentionBackend
from core.platform import (
    Capability,
    DecodeGraphRunner,
    DecodeGraphSpec,
    ModelForward,
    Platform,
    ProbeResult,
    builtin_backend,
)
from platforms.cuda.attention import (
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_SIZES,
    CudaPagedAttention,
)
from platforms.cuda.build import kernels_status, load_ops

if TYPE_CHECKING:
    from core.attention import AttentionSpec
    from core.config import EngineConfig

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


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dispatch_key = "CUDA"
    capabilities = frozenset(
        {Capability.GRAPH_CAPTURE, Capability.DEVICE_MEMORY, Capability.PINNED_HOST_MEMORY}
    )
    verification = "real hardware"  # evidence: docs/platforms.md
    device_visibility_env = "CUDA_VISIBLE_DEVICES"
    paged_attention: type[AttentionBackend] = CudaPagedAttention
    """The built-in backend (the ROCm platform, a subclass, names its own)."""

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
        ok, how = kernels_status()
        if not ok:
            return ProbeResult(0, how)
        return ProbeResult(
            PROBE_SCORE,
            f"{gpus} NVIDIA GPU(s), torch {torch.__version__} (CUDA {torch.version.cuda}); "
            f"kernels: {how}",
        )

    # ---- device facts ---------------------------------------------------------------------
    def device_count(self) -> int:
        return torch.cuda.device_count()

    def memory_info(self, device_index: int = 0) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(device_index)
        return int(free), int(total)

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return SUPPORTED_DTYPES

    def supported_block_sizes(self) -> tuple[int, ...]:
        return SUPPORTED_BLOCK_SIZES

    # ---- attention ---------------------------------------------------------------------------
    def attention_backend_class(
        self, spec: AttentionSpec, requested: str | None = None
    ) -> type[AttentionBackend]:
        return builtin_backend(self.name, requested, self.paged_attention)

    def ops(self) -> dict[str, Any]:
        """Fused csrc kernels for RMSNorm (+ residual), SiLU-and-mul and rotary."""
        from platforms.cuda.ops import cuda_ops

        return cuda_ops()

    @classmethod
    def quantization_methods(cls) -> dict[str, Any]:
        """Every built-in method kept quantized: FP8 through torch._scaled_mm, 4/8-bit codes
        through csrc/quant (see platforms/cuda/quant.py)."""
        from platforms.cuda.quant import QUANTIZED_LINEAR

        return dict(QUANTIZED_LINEAR)

    def distributed_backend(self) -> str:
        return "nccl"

    # ---- memory ------------------------------------------------------------------------------
    def kv_cache_budget(
        self, requested_bytes: int | None, memory_utilization: float, weights_bytes: int
    ) -> int:
        """``memory_utilization`` of the device minus ``weights_bytes`` (the profiled peak of
        weights plus activations) minus what other processes and the CUDA context hold.

        Memory held by this process's caching allocator is not "other": it is freed here
        first, and what stays allocated is part of ``weights_bytes``.
        """
        if requested_bytes is not None:
            return requested_bytes
        torch.cuda.empty_cache()
        free, total = self.memory_info(torch.cuda.current_device())
        others = max(0, total - free - torch.cuda.memory_reserved())
        return max(0, int(total * memory_utilization) - others - weights_bytes)

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def peak_memory_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated())

    # ---- graphs ------------------------------------------------------------------------------
    def decode_graph_runner(
        self, model: ModelForward, kv_caches: list[torch.Tensor], spec: DecodeGraphSpec
    ) -> DecodeGraphRunner | None:
        """Per-bucket CUDA graphs of decode steps (see :mod:`platforms.cuda.graphs`)."""
        from platforms.cuda.graphs import CudaDecodeGraphs

        return CudaDecodeGraphs(model, kv_caches, spec)

    # ---- runtime -----------------------------------------------------------------------------
    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def seed_everything(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def validate(self, config: EngineConfig) -> EngineConfig:
        config = super().validate(config)
        head = _head_size(config.model.hf_config)
        if head is not None and head not in SUPPORTED_HEAD_SIZES:
            raise ValueError(
                f"the model's attention head size is {head}; the {self.name} platform's kernels "
                f"support {list(SUPPORTED_HEAD_SIZES)}. Run this model with --platform cpu"
            )
        return config

    def get_extension(self, name: str) -> Any:
        """``"core_C"``: the ``torch.ops.core_C`` namespace (builds/loads the kernels)."""
        return load_ops() if name == "core_C" else None


def _head_size(hf_config: Any) -> int | None:
    """Attention head size from an HF config, or None when it does not say."""
    head = getattr(hf_config, "head_dim", None)
    if isinstance(head, int):
        return head
    hidden = getattr(hf_config, "hidden_size", None)
    heads = getattr(hf_config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None
