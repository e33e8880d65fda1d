"""The TPU platform: torch-xla with bucketed static shapes (the batch shaper of
:mod:`core.batch_shape` with the buckets of :mod:`platforms.tpu.buckets`).

Probe policy (side-effect free: torch_xla is located with ``find_spec``, never imported,
and TPU chips are found by their device files, without starting the XLA runtime):

* torch-xla not installed -> score 0 (the reason says ``pip install 'core[tpu]'``);
* torch-xla installed and TPU chips present (``/dev/accel*`` or ``/dev/vfio/N``) -> 100;
* torch-xla installed, no TPU -> score 1, ``emulated``: XLA then runs on the host CPU
  (``PJRT_DEVICE=CPU``). Automatic selection never picks an emulation, so installing
  ``core[tpu]`` on a CPU host leaves a plain ``core generate`` on the CPU platform, while
  ``--platform tpu`` selects it explicitly (how CI verifies it).

torch-xla traces lazily: the runner's per-step :meth:`TpuPlatform.step_boundary` is where a
step's graph is cut, compiled (once per bucketed shape) and launched, and steps run under
``torch.no_grad`` (:meth:`TpuPlatform.inference_context`), since torch-xla cannot take
views of weights or caches under inference mode.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
from contextlib import AbstractContextManager
from typing import Any

import torch

from core.attention import AttentionBackend, AttentionSpec
from core.batch_shape import BatchShaper, BucketedBatchShaper
from core.platform import Capability, Platform, ProbeResult, builtin_backend, host_memory
from core.sampler.static import StaticShapeSampling
from platforms.tpu.attention import PallasTpuAttentionBackend, TpuAttentionBackend
from platforms.tpu.buckets import TpuBuckets

TPU_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*")
"""Where a TPU VM exposes its chips (v2-v5e: accel, v5p and later: vfio)."""


def _cut_graph() -> None:
    """Launch what is traced so far as one program (without waiting for it)."""
    import torch_xla

    torch_xla.sync()


def tpu_chip_files() -> list[str]:
    return sorted(f for pattern in TPU_DEVICE_FILES for f in glob.glob(pattern))


class TpuPlatform(Platform):
    name = "tpu"
    device_type = "xla"
    dispatch_key = "XLA"
    capabilities = frozenset({Capability.DEVICE_MEMORY})
    """On a TPU (HBM of its own). No GRAPH_CAPTURE: XLA compiles every step itself (see
    :meth:`step_boundary`), there is no decode graph runner to ask for. XLA on the host CPU
    has none (see :meth:`Platform.emulate_on_host`)."""
    verification = "emulated"
    device_visibility_env = "TPU_VISIBLE_CHIPS"

    def __init__(self) -> None:
        import torch_xla.runtime as xr

        self.on_tpu = xr.device_type() == "TPU"
        if not self.on_tpu:
            # tensors stay on the xla device, which the PJRT CPU client backs with host RAM
            self.emulate_on_host(host_tensors=False)

    @classmethod
    def probe(cls) -> ProbeResult:
        if importlib.util.find_spec("torch_xla") is None:
            return ProbeResult(0, "torch-xla is not installed; pip install 'core[tpu]'")
        version = importlib.metadata.version("torch-xla")
        chips = tpu_chip_files()
        if chips:
            return ProbeResult(100, f"{len(chips)} TPU chip device(s), torch-xla {version}")
        return ProbeResult(
            1,
            f"torch-xla {version} present, no TPU found: XLA runs on the CPU (PJRT_DEVICE=CPU) "
            f"as an emulation; used only when selected with --platform tpu",
            emulated=True,
        )

    # ---- device facts -----------------------------------------------------------------
    def device_count(self) -> int:
        import torch_xla

        return torch_xla.device_count()

    def memory_info(self, device_index: int = 0) -> tuple[int, int]:
        if not self.on_tpu:
            return host_memory()  # the PJRT CPU client keeps no allocator stats
        import torch_xla.core.xla_model as xm

        info = xm.get_memory_info(self.device(device_index))
        total = int(info["bytes_limit"])
        return total - int(info["bytes_used"]), total

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        if self.on_tpu:
            return (torch.bfloat16, torch.float32)
        return (torch.float32, torch.bfloat16)

    def default_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        if not self.on_tpu:
            return torch.float32  # exact against the CPU reference; bf16 is opt-in
        return torch.bfloat16  # the MXU's native type

    def supported_block_sizes(self) -> tuple[int, ...]:
        return (16, 32, 64, 128)

    def attention_backend_class(
        self, spec: AttentionSpec, requested: str | None = None
    ) -> type[AttentionBackend]:
        if requested == PallasTpuAttentionBackend.name and not self.on_tpu:
            raise ValueError(
                f"attention backend {requested!r} runs Pallas kernels, which need a TPU; "
                f"XLA here runs on the CPU, so use {TpuAttentionBackend.name!r} (the default)"
            )
        default = PallasTpuAttentionBackend if self.on_tpu else TpuAttentionBackend
        return builtin_backend(
            self.name, requested, default, PallasTpuAttentionBackend, TpuAttentionBackend
        )

    def batch_shaper(self, block_size: int) -> BatchShaper:
        """Every step padded to :class:`~platforms.tpu.buckets.TpuBuckets` on the host, so
        XLA compiles one program per bucketed shape, not one per batch. Before each step,
        the work the previous one left queued (sampling bookkeeping) is cut into its own
        program, so it never changes the step's."""
        return BucketedBatchShaper(TpuBuckets(), block_size, before_step=_cut_graph)

    def ops(self) -> dict[str, Any]:
        """The sampler without row subsets (:mod:`core.sampler.static`): with mixed
        sampling parameters the torch pipeline's subsets change size from step to step, and
        XLA would compile its program again for each size."""
        return {"sampling_kernel": StaticShapeSampling()}

    # ---- distributed and runtime ---------------------------------------------------------
    def distributed_backend(self) -> str:
        # registered with torch.distributed by torch_xla.distributed.xla_backend
        return "xla"

    def ray_resource(self) -> str:
        return "CPU" if self.emulated else "TPU"

    def synchronize(self) -> None:
        """Cut the traced graph here, run it, and wait for it to finish."""
        import torch_xla

        torch_xla.sync(wait=True)

    def inference_context(self) -> AbstractContextManager:
        # inference mode breaks torch-xla's views of weights and caches (see Platform)
        return torch.no_grad()

    def step_boundary(self) -> None:
        """Cut the step's traced graph and launch it (compiled once per bucketed shape)."""
        _cut_graph()

    def seed_everything(self, seed: int) -> None:
        import torch_xla.core.xla_model as xm

        torch.manual_seed(seed)
        xm.set_rng_state(seed)

    def get_extension(self, name: str) -> Any:
        """``"metrics"``: torch_xla.debug.metrics (compile counters); else None."""
        if name == "metrics":
            import torch_xla.debug.metrics as met

            return met
        return None
