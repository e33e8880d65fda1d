"""The Intel XPU platform: IPEX paged attention on an Intel GPU, or on IPEX's CPU kernels.

Probe policy (side-effect free: IPEX is located with ``find_spec``, never imported):

* IPEX not installed -> score 0 (unusable; the reason says ``pip install 'core[xpu]'``);
* IPEX installed and ``torch.xpu`` sees devices -> score 100, device ``xpu``;
* IPEX installed, no XPU device -> score 1, ``emulated``: it runs on IPEX's CPU kernels.
  Automatic selection never picks an emulation, so installing ``core[xpu]`` on a CPU host
  leaves a plain ``core generate`` on the CPU platform, while ``--platform xpu`` selects
  it explicitly (this is how it is verified on x86 CI).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any

import torch

from core.attention import AttentionBackend, AttentionSpec
from core.platform import Capability, Platform, ProbeResult, builtin_backend, host_memory
from platforms.xpu.attention import XpuAttentionBackend

IPEX_DIST = "intel-extension-for-pytorch"


def xpu_device_count() -> int:
    """Intel GPUs torch can see (0 on builds without XPU support)."""
    xpu = getattr(torch, "xpu", None)
    return int(xpu.device_count()) if xpu is not None and xpu.is_available() else 0


class XpuPlatform(Platform):
    name = "xpu"
    device_type = "xpu"
    dispatch_key = "XPU"
    capabilities = frozenset({Capability.DEVICE_MEMORY, Capability.PINNED_HOST_MEMORY})
    """On an Intel GPU; an instance running on IPEX's CPU kernels has none of these."""
    verification = "emulated"
    device_visibility_env = "ZE_AFFINITY_MASK"

    def __init__(self) -> None:
        self.on_device = xpu_device_count() > 0
        if not self.on_device:
            self.emulate_on_host()  # IPEX's CPU kernels: tensors live on the host

    @classmethod
    def probe(cls) -> ProbeResult:
        if importlib.util.find_spec("intel_extension_for_pytorch") is None:
            return ProbeResult(
                0, "intel-extension-for-pytorch is not installed; pip install 'core[xpu]'"
            )
        version = importlib.metadata.version(IPEX_DIST)
        n = xpu_device_count()
        if n:
            return ProbeResult(100, f"{n} Intel XPU device(s), IPEX {version}")
        return ProbeResult(
            1,
            f"IPEX {version} present, no XPU device: runs on IPEX's CPU kernels (emulation); "
            f"used only when selected with --platform xpu",
            emulated=True,
        )

    # ---- device facts -----------------------------------------------------------------
    def device_count(self) -> int:
        return xpu_device_count() if self.on_device else 1

    def memory_info(self, device_index: int = 0) -> tuple[int, int]:
        if not self.on_device:
            return host_memory()
        free, total = torch.xpu.mem_get_info(device_index)
        return int(free), int(total)

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        if self.on_device:
            return (torch.bfloat16, torch.float16, torch.float32)
        return (torch.float32, torch.bfloat16)

    def default_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        if not self.on_device:
            return torch.float32  # exact against the CPU reference; bf16 is opt-in
        return super().default_dtype(checkpoint_dtype)

    def supported_block_sizes(self) -> tuple[int, ...]:
        return (16, 32, 64)

    def attention_backend_class(
        self, spec: AttentionSpec, requested: str | None = None
    ) -> type[AttentionBackend]:
        return builtin_backend(self.name, requested, XpuAttentionBackend)

    # ---- distributed and runtime ---------------------------------------------------------
    def distributed_backend(self) -> str:
        return "xccl" if self.on_device else "gloo"

    def synchronize(self) -> None:
        if self.on_device:
            torch.xpu.synchronize()

    def empty_cache(self) -> None:
        if self.on_device:
            torch.xpu.empty_cache()

    def set_device(self, index: int) -> None:
        if self.on_device:
            torch.xpu.set_device(index)

    def seed_everything(self, seed: int) -> None:
        torch.manual_seed(seed)  # seeds the CPU and every XPU generator

    def get_extension(self, name: str) -> Any:
        """``"ipex"``: the intel_extension_for_pytorch module; anything else: None."""
        if name == "ipex":
            import intel_extension_for_pytorch

            return intel_extension_for_pytorch
        return None
