"""The CPU platform: runs everywhere, so it is the reference and the fallback."""

from __future__ import annotations

import os

import torch

from core.attention import AttentionBackend, AttentionSpec
from core.config import GiB
from core.platform import Capability, Platform, ProbeResult
from platforms.cpu.attention import CpuAttentionBackend

DEFAULT_KV_CACHE_BYTES = 2 * GiB
"""KV budget when --kv-cache-memory is not given (capped at a quarter of available RAM); 2 GiB holds ~46k tokens of SmolLM2-135M."""


def _available_memory() -> tuple[int, int]:
    """(available, total) bytes of host RAM from /proc/meminfo (falls back to sysconf)."""
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) * 1024
        return fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total // 2, total


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    capabilities = frozenset({Capability.PINNED_HOST_MEMORY})
    verification = "real hardware (x86-64 CPU, CI)"

    @classmethod
    def probe(cls) -> ProbeResult:
        # Always usable, but any accelerator should win over it.
        return ProbeResult(1, f"{os.cpu_count()} CPU cores, torch {torch.__version__}")

    def device_count(self) -> int:
        return 1

    def memory_info(self, device_index: int = 0) -> tuple[int, int]:
        return _available_memory()

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16, torch.float16)

    def default_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        # fp32 is exact against the reference and the fastest path for torch's CPU GEMMs
        # without AMX; bf16 is an explicit opt-in.
        return torch.float32

    def supported_block_sizes(self) -> tuple[int, ...]:
        return (16, 32, 64, 128)

    def attention_backend_class(
        self, spec: AttentionSpec, requested: str | None = None
    ) -> type[AttentionBackend]:
        if requested not in (None, CpuAttentionBackend.name):
            raise ValueError(
                f"attention backend {requested!r} is not built into platform 'cpu' (it has "
                f"{CpuAttentionBackend.name!r}); a plugin can add one via core_attention_backends"
            )
        return CpuAttentionBackend

    def kv_cache_budget(
        self, requested_bytes: int | None, memory_utilization: float, weights_bytes: int
    ) -> int:
        if requested_bytes is not None:
            return requested_bytes
        available, _ = self.memory_info()
        return min(DEFAULT_KV_CACHE_BYTES, available // 4)

    def seed_everything(self, seed: int) -> None:
        torch.manual_seed(seed)
