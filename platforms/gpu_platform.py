"""What the CUDA and ROCm platforms share: a GPU that torch drives through ``torch.cuda``.

PyTorch's ROCm build exposes HIP devices as torch device type ``cuda`` (and its kernels under
the CUDA dispatch key), and its ``torch.cuda`` calls drive HIP: memory, streams and graphs
are HIP's. So everything but the probe, the kernels' toolchain, the attention backend and
the fused ops is the same code for both vendors, and lives here, in a module neither
vendor owns. :class:`platforms.cuda.platform.CudaPlatform` and
:class:`platforms.rocm.platform.RocmPlatform` are siblings under :class:`GpuPlatform`; each
composes its :class:`~platforms.gpu_toolchain.GpuToolchain` (nvcc, or hipcc after hipify)
and names its backend.

Nothing here touches the GPU at import time. The csrc/ kernels' limits and graph runner are
imported where used (their modules live in the cuda package, whose ``__init__`` imports
this module).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from core.attention import AttentionBackend
from core.platform import (
    Capability,
    DecodeGraphRunner,
    DecodeGraphSpec,
    ModelForward,
    Platform,
    builtin_backend,
)
from platforms.gpu_toolchain import GpuToolchain

if TYPE_CHECKING:
    from core.attention import AttentionSpec
    from core.config import EngineConfig


class GpuPlatform(Platform):
    """A GPU driven through ``torch.cuda`` running the csrc/ kernels. A vendor's subclass
    sets ``name``, ``toolchain``, ``paged_attention`` and implements ``probe``."""

    device_type = "cuda"  # torch's device type for CUDA and for HIP devices alike
    dispatch_key = "CUDA"
    capabilities = frozenset(
        {Capability.GRAPH_CAPTURE, Capability.DEVICE_MEMORY, Capability.PINNED_HOST_MEMORY}
    )
    toolchain: GpuToolchain
    """How this vendor's compiler builds and loads the ``core_C`` kernels."""
    paged_attention: type[AttentionBackend]
    """The built-in attention backend over those kernels."""

    # ---- device facts ---------------------------------------------------------------------
    def device_count(self) -> int:
        return torch.cuda.device_count()

    def memory_info(self, device_index: int = 0) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(device_index)
        return int(free), int(total)

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        from platforms.cuda.attention import SUPPORTED_DTYPES  # the csrc/ kernels' limits

        return SUPPORTED_DTYPES

    def supported_block_sizes(self) -> tuple[int, ...]:
        from platforms.cuda.attention import SUPPORTED_BLOCK_SIZES

        return SUPPORTED_BLOCK_SIZES

    # ---- attention ------------------------------------------------------------------------
    def attention_backend_class(
        self, spec: AttentionSpec, requested: str | None = None
    ) -> type[AttentionBackend]:
        return builtin_backend(self.name, requested, self.paged_attention)

    def distributed_backend(self) -> str:
        return "nccl"  # RCCL on ROCm builds, under torch's nccl name

    # ---- memory -----------------------------------------------------------------------------
    def kv_cache_budget(
        self, requested_bytes: int | None, memory_utilization: float, weights_bytes: int
    ) -> int:
        """``memory_utilization`` of the device minus ``weights_bytes`` (the profiled peak of
        weights plus activations) minus what other processes and the driver's context hold.

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

    # ---- graphs -----------------------------------------------------------------------------
    def decode_graph_runner(
        self, model: ModelForward, kv_caches: list[torch.Tensor], spec: DecodeGraphSpec
    ) -> DecodeGraphRunner | None:
        """Per-bucket graphs of decode steps (see :mod:`platforms.cuda.graphs`; torch.cuda's
        graphs are HIP graphs on ROCm)."""
        from platforms.cuda.graphs import CudaDecodeGraphs

        return CudaDecodeGraphs(model, kv_caches, spec)

    # ---- runtime ----------------------------------------------------------------------------
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
        from platforms.cuda.attention import SUPPORTED_HEAD_SIZES

        config = super().validate(config)
        head = _head_size(config.model.hf_config)
        if head is not None and head not in SUPPORTED_HEAD_SIZES:
            raise ValueError(
                f"the model's attention head size is {head}; the {self.name} platform's kernels "
                f"support {list(SUPPORTED_HEAD_SIZES)}. Run this model with --platform cpu"
            )
        return config

    def get_extension(self, name: str) -> Any:
        """``"core_C"``: the ``torch.ops.core_C`` namespace (builds or loads the kernels with
        this platform's toolchain)."""
        return self.toolchain.load_ops() if name == "core_C" else None


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
