"""The HPU (Intel Gaudi) platform.

Two modes, decided per instance from what is installed:

* **Gaudi**: ``habana_frameworks`` is importable. Tensors live on ``torch.device("hpu")``;
  device facts come from ``habana_frameworks.torch.hpu``. This mode has never run on a
  Gaudi (none was available); docs/platforms.md says so.
* **CPU emulation**: ``habana_frameworks`` is absent. The same attention and cache ops run
  on CPU tensors, which is how the conformance suite verifies them here. The probe scores
  this mode 0 (unusable) unless the user opts in with ``CORE_HPU_EMULATE=1``; then it is
  usable but ``emulated``: automatic selection never picks it, the user names it
  (``--platform hpu`` / ``--core-platform=hpu``).

``habana_frameworks`` is only looked up with ``importlib.util.find_spec`` (which does not
import it) in :meth:`probe`, and only imported inside methods of a Gaudi-mode instance.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
from types import ModuleType
from typing import Any

import torch

from core.attention import AttentionBackend, AttentionSpec
from core.batch_shape import BatchShaper, BucketedBatchShaper
from core.platform import Capability, Platform, ProbeResult, builtin_backend, host_memory
from core.structured_output.bitmask import apply_bitmask_host
from platforms.hpu.attention import HpuAttentionBackend
from platforms.hpu.buckets import BucketPolicy

EMULATE_ENV = "CORE_HPU_EMULATE"
"""Set to 1 to make the HPU platform selectable on a host without Gaudi: its ops then run
on CPU tensors (for verification; slower than the CPU platform)."""


def emulation_requested(environ: dict[str, str] | None = None) -> bool:
    """Whether the user opted into CPU emulation (``CORE_HPU_EMULATE``; read only here)."""
    e = os.environ if environ is None else environ
    return e.get(EMULATE_ENV, "") not in ("", "0", "false", "False")


def habana_installed() -> bool:
    """``habana_frameworks`` can be imported (looked up without importing it)."""
    return importlib.util.find_spec("habana_frameworks") is not None


def _hpu_module() -> ModuleType:
    """``habana_frameworks.torch.hpu`` (importing it registers the ``hpu`` torch device)."""
    importlib.import_module("habana_frameworks.torch.core")
    return importlib.import_module("habana_frameworks.torch.hpu")


class HpuPlatform(Platform):
    name = "hpu"
    device_type = "hpu"
    dispatch_key = "HPU"
    capabilities = frozenset({Capability.DEVICE_MEMORY, Capability.PINNED_HOST_MEMORY})
    """On a Gaudi (HBM of its own). No GRAPH_CAPTURE until the platform has a decode graph
    runner (HPU graphs); the emulation has none (see :meth:`Platform.emulate_on_host`)."""
    verification = "emulated"
    device_visibility_env = "HABANA_VISIBLE_DEVICES"

    def __init__(self) -> None:
        if not habana_installed():
            self.emulate_on_host()
        else:
            _hpu_module()  # registers the "hpu" device with torch before any allocation

    @classmethod
    def probe(cls) -> ProbeResult:
        if habana_installed():
            nodes = glob.glob("/dev/accel/accel[0-9]*")
            if nodes:
                return ProbeResult(100, f"habana_frameworks installed, {len(nodes)} Gaudi device(s)")
            return ProbeResult(0, "habana_frameworks installed but no Gaudi device under /dev/accel")
        if emulation_requested():
            return ProbeResult(
                1,
                f"habana_frameworks not installed; emulating on CPU ({EMULATE_ENV}=1); used "
                f"only when selected with --platform hpu",
                emulated=True,
            )
        return ProbeResult(
            0,
            f"habana_frameworks not installed (set {EMULATE_ENV}=1 to run the HPU ops on CPU "
            f"tensors, for verification only)",
        )

    # ---- device facts ---------------------------------------------------------------
    def device_count(self) -> int:
        return 1 if self.emulated else int(_hpu_module().device_count())

    def memory_info(self, device_index: int = 0) -> tuple[int, int]:
        if self.emulated:
            return host_memory()
        stats = _hpu_module().memory_stats(device_index)
        total = int(stats["Limit"])
        return total - int(stats["InUse"]), total

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        # bf16 is Gaudi's native compute type; fp32 is exact against the reference.
        return (torch.bfloat16, torch.float32)

    def default_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.emulated else torch.bfloat16

    def supported_block_sizes(self) -> tuple[int, ...]:
        # 128 fills Gaudi's matrix engine (first = preferred). The ops are gathers and
        # matmuls with no block-size-specific code, so 16 works as well and keeps caches
        # for short test sequences small.
        return (128, 16)

    # ---- attention ------------------------------------------------------------------
    def attention_backend_class(
        self, spec: AttentionSpec, requested: str | None = None
    ) -> type[AttentionBackend]:
        return builtin_backend(self.name, requested, HpuAttentionBackend)

    def ops(self) -> dict[str, Any]:
        """On a Gaudi, grammar masks go through the host: the device unpack (uint8 shifts, a
        boolean ``masked_fill`` on gathered rows) has never run on an HPU (verification:
        emulated), and the host path is the tested fallback. The emulation's tensors are on
        the host already, where the default op is right."""
        return {} if self.emulated else {"grammar_bitmask": apply_bitmask_host}

    def batch_shaper(self, block_size: int) -> BatchShaper:
        """Every step padded to :class:`~platforms.hpu.buckets.BucketPolicy` on the host, so
        HPU graphs see a bounded set of shapes (the emulation too: same code path)."""
        return BucketedBatchShaper(BucketPolicy(), block_size)

    # ---- distributed and runtime ----------------------------------------------------------
    def distributed_backend(self) -> str:
        return "hccl"

    def ray_resource(self) -> str:
        return "CPU" if self.emulated else "HPU"

    def synchronize(self) -> None:
        if not self.emulated:
            _hpu_module().synchronize()

    def set_device(self, index: int) -> None:
        if not self.emulated:
            _hpu_module().set_device(index)

    def seed_everything(self, seed: int) -> None:
        torch.manual_seed(seed)
        if not self.emulated:
            _hpu_module().random.manual_seed(seed)
