"""The Platform contract: everything the hardware-agnostic core asks of a device.

A platform plugin returns its :class:`Platform` subclass from the ``core_platforms`` hook.
Abstract methods must be implemented; the others state their default. The core never
asks "is this CUDA?": it reads capability flags and calls these methods.
"""

from __future__ import annotations

import dataclasses
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from core.attention import AttentionBackend, AttentionMetadata, AttentionSpec
    from core.batch_shape import BatchShaper
    from core.config import EngineConfig


@dataclass(frozen=True)
class ProbeResult:
    """How well a platform fits this host. ``score == 0`` means unusable here."""

    score: int
    reason: str
    """Why: the device found, or what is missing (shown by ``core platforms``)."""
    emulated: bool = False
    """The platform would run its ops on the host CPU (an emulation, or an accelerator's
    software installed on a host without the accelerator). Such a platform is usable only
    when asked for by name (``--platform NAME``): automatic selection never picks it, so
    installing an extra never changes what a plain ``core generate`` runs on."""


class Capability:
    """Capability flags a platform may declare in :attr:`Platform.capabilities`. Core reads
    each one (where is named below); a flag nothing reads does not belong here."""

    GRAPH_CAPTURE = "graph_capture"
    """Decode steps can be captured and replayed: the runner asks
    :meth:`Platform.decode_graph_runner` only of platforms declaring it."""
    FUSED_DECODE = "fused_decode"
    """Decode steps of the models a platform recognises run through its own fused forward,
    which captures nothing of the model's code (models need not be capturable): the runner
    asks :meth:`Platform.decode_graph_runner` of platforms declaring it too (the CPU)."""
    PINNED_HOST_MEMORY = "pinned_host_memory"
    """Host buffers can be page-locked so host-to-device copies need not block: read through
    :meth:`Platform.pin_host_memory` (host KV caches, sampler inputs)."""
    DEVICE_MEMORY = "device_memory"
    """The device has memory of its own, sized by ``--gpu-memory-utilization``; without it
    tensors live in host RAM shared with everything else (:meth:`Platform.shares_host_memory`,
    the default :meth:`Platform.kv_cache_budget`)."""


def capabilities_in_force(declared: frozenset[str], probe: ProbeResult) -> frozenset[str]:
    """The flags a platform has on this host: those it declares, or none when its probe says
    it would run as an emulation on the host (see :meth:`Platform.emulate_on_host`)."""
    return frozenset() if probe.emulated else declared

VERIFICATION_LEVELS = ("real hardware", "emulated", "never run")
"""Where a platform has really run (:attr:`Platform.verification`); the evidence for each
built-in platform is in docs/platforms.md."""

DEFAULT_HOST_KV_CACHE_BYTES = 2 << 30
"""KV budget of a platform without :attr:`Capability.DEVICE_MEMORY` when
``--kv-cache-memory`` is not given (capped at a quarter of available RAM): host RAM is shared
with everything else. 2 GiB holds ~46k tokens of SmolLM2-135M."""


HOST_DEVICE = torch.device("cpu")
"""torch's device for host memory (the contract's one fixed device: host swap caches, host
staging, and tensors numpy can view live there)."""


def in_host_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in host memory (numpy can view it; no copy reaches it)."""
    return t.device.type == HOST_DEVICE.type


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host RAM. "Available" is the kernel's MemAvailable (free
    plus reclaimable page cache), the figure a new allocation can count on; where
    /proc/meminfo is unreadable, sysconf's free pages (a lower bound)."""
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) * 1024
        return fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


ModelForward = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor], "AttentionMetadata"], torch.Tensor]
"""``model(input_ids, positions, kv_caches, metadata) -> hidden`` (see core.models)."""


@dataclass(frozen=True)
class DecodeGraphSpec:
    """What a platform needs to capture decode steps of one model (see
    :meth:`Platform.decode_graph_runner`)."""

    max_batch_size: int
    """Most sequences in a decode step (the scheduler's max_num_seqs)."""
    max_model_len: int
    """Longest context a sequence can reach; a captured step must be right for any length
    up to it."""
    block_size: int
    """KV block size: block tables have ceil(max_model_len / block_size) columns."""
    attention_sites: tuple = ()
    """The model's :class:`core.attention_sites.AttentionSite` objects, in layer order: a
    strategy may split its graphs around them to replay steps with prefills too."""
    max_mixed_tokens: int = 0
    """Most tokens of a step with prefills that may be replayed piecewise (0: none)."""


class DecodeGraphRunner(ABC):
    """Runs decode-only steps from captured graphs (a strategy object of a platform).

    Invariant: :meth:`run` returns exactly what ``model(input_ids, positions, kv_caches,
    metadata)`` returns for the same step (rows in the same order), for every batch that
    :meth:`can_run` accepts. The returned tensor may be a view of a buffer that the next
    :meth:`run` overwrites: consume it before the next step.
    """

    @abstractmethod
    def can_run(self, metadata: AttentionMetadata) -> bool:
        """Whether this step can be replayed (decode-only and small enough, or with
        prefills where the strategy replays those)."""

    @abstractmethod
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The hidden states [num_tokens, hidden] of the step, from a graph."""

    def capture_all(self) -> float:
        """Capture every batch size now instead of on first use; returns the seconds it
        took. The model runner calls it once, right after allocating the KV cache, so no
        capture happens while serving. Default: nothing to capture (0.0)."""
        return 0.0


class Platform(ABC):
    """One kind of device. Instances are cheap; ``probe`` must have no side effects."""

    name: str = ""
    """Short unique name used by ``--platform`` (cpu, cuda, rocm, xpu, tpu, hpu, ...)."""
    device_type: str = ""
    """torch device type tensors live on ("cpu", "cuda", "xpu", "hpu", "xla", ...)."""
    dispatch_key: str = ""
    """torch dispatch key of its ops (CPU, CUDA, XPU, ...)."""
    capabilities: frozenset[str] = frozenset()
    """Subset of :class:`Capability` flags the device has (an emulating instance has none:
    see :meth:`emulate_on_host`)."""
    verification: str = "never run"
    """One of :data:`VERIFICATION_LEVELS`: where this platform's code has really run. Only
    the level: the evidence (machine, versions, date) belongs in docs/platforms.md."""
    emulated: bool = False
    """True for an instance running an accelerator's ops on the host CPU (set only by
    :meth:`emulate_on_host`)."""
    device_visibility_env: str | None = None
    """Env var that restricts a worker process to one device (e.g. CUDA_VISIBLE_DEVICES)."""

    # ---- discovery ------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def probe(cls) -> ProbeResult:
        """Score this host without side effects (no device init, no allocation)."""

    def emulate_on_host(self, host_tensors: bool = True) -> None:
        """Make this instance an emulation on the host CPU; a constructor calls it when the
        probe found the platform's software but not its device (``ProbeResult.emulated``).

        The instance then has no capabilities (no device memory to size, nothing to pin or
        capture) and, with ``host_tensors``, keeps its tensors on the host (device type
        ``cpu``, dispatch key ``CPU``). A runtime that emulates its device behind its own
        device type (XLA on the CPU client) passes ``host_tensors=False``. This is the one
        place emulation changes an instance, so every emulating platform means the same.
        """
        self.emulated = True
        self.capabilities = frozenset()
        if host_tensors:
            self.device_type, self.dispatch_key = "cpu", "CPU"

    # ---- device facts ---------------------------------------------------------------
    def shares_host_memory(self) -> bool:
        """Whether tensors live in host RAM and ops run on the host's cores (the CPU
        platform, an emulation). Then tensor-parallel ranks share the host's cores and
        memory, ``CORE_NUM_THREADS`` applies, and a per-rank device-visibility variable
        means nothing. Default: the device type is the host's."""
        return self.device_type == "cpu"

    def pin_host_memory(self) -> bool:
        """Whether host buffers that feed the device (host KV caches, sampler inputs) should
        be page-locked, so copies to the device need not wait for queued work. Default:
        :attr:`Capability.PINNED_HOST_MEMORY` is declared (and in force)."""
        return Capability.PINNED_HOST_MEMORY in self.capabilities

    def ray_resource(self) -> str:
        """The Ray resource one rank's bundle asks for (Ray isolates GPUs per actor).
        Default: ``get_extension("ray_resource")`` when the platform gives one, else "CPU"
        for a platform sharing host memory and "GPU" otherwise."""
        named = self.get_extension("ray_resource")
        if named:
            return named
        return "CPU" if self.shares_host_memory() else "GPU"

    @abstractmethod
    def device_count(self) -> int:
        """Number of devices of this platform visible to this process."""

    @abstractmethod
    def memory_info(self, device_index: int = 0) -> tuple[int, int]:
        """(free bytes, total bytes) of the device's memory."""

    @abstractmethod
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """Compute dtypes its kernels accept, preferred first."""

    def default_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """dtype used for ``--dtype auto``. Default: the checkpoint's if supported, else the
        first supported dtype."""
        supported = self.supported_dtypes()
        return checkpoint_dtype if checkpoint_dtype in supported else supported[0]

    def default_formats(
        self, checkpoint_dtype: torch.dtype, quantization: str | None
    ) -> tuple[torch.dtype, str]:
        """(compute dtype, weight format) for ``--dtype auto`` / ``--weight-format auto``.

        :param quantization: the checkpoint's weight quantization when it has one (e.g.
            ``"q4"`` for a 4-bit GGUF), else None.
        Default: ``(default_dtype(checkpoint_dtype), "dense")``.
        """
        return self.default_dtype(checkpoint_dtype), "dense"

    @abstractmethod
    def supported_block_sizes(self) -> tuple[int, ...]:
        """KV block sizes (tokens) its attention kernels accept."""

    def preferred_block_size(self) -> int:
        """Block size used when the user sets none. Default: the first supported one."""
        return self.supported_block_sizes()[0]

    def device(self, index: int = 0) -> torch.device:
        """The torch device for ``index``. Default: ``torch.device(device_type, index)``
        (``cpu`` has no index)."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, index)

    # ---- attention and ops ----------------------------------------------------------
    @abstractmethod
    def attention_backend_class(
        self, spec: AttentionSpec, requested: str | None = None
    ) -> type[AttentionBackend]:
        """The attention backend for a layer; ``requested`` names a registered alternative
        (see the ``core_attention_backends`` hook), None picks the default."""

    def ops(self) -> dict[str, Any]:
        """Platform kernels overriding entries of :data:`core.ops.DEFAULT_OPS` by name
        (rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding, lm_head, fused_moe,
        sampling_kernel, grammar_bitmask). ``grammar_bitmask`` is how structured output's
        token masks reach the logits: the default unpacks them with torch ops on the
        device; a device that cannot run those supplies
        ``core.structured_output.bitmask.apply_bitmask_host``. Default: none."""
        return {}

    def supported_weight_formats(self) -> tuple[str, ...]:
        """In-memory linear weight formats (see ModelConfig.weight_format). Default: dense."""
        return ("dense",)

    def linear_method(self, weight_format: str) -> Any:
        """The :class:`core.models.layers.LinearMethod` that keeps linear weights in
        ``weight_format`` (one of :meth:`supported_weight_formats`). Default: the dense
        method for ``"dense"``."""
        from core.models.layers import DENSE

        if weight_format != "dense":
            raise ValueError(
                f"weight format {weight_format!r} is not supported by platform {self.name!r}; "
                f"use one of {list(self.supported_weight_formats())}"
            )
        return DENSE

    @classmethod
    def quantization_methods(cls) -> dict[str, Any]:
        """Quantization methods (:mod:`core.quantization`) this platform runs: method name ->
        a factory ``(method, compute dtype) -> LinearMethod`` keeping the weights quantized for
        its kernels, or None to load them dequantized into the dense weights. A method not
        named here is refused at start. Default: ``{"gguf": None}`` (GGUF files dequantized
        while loading, as every platform can)."""
        return {"gguf": None}

    @classmethod
    def kv_cache_dtypes(cls) -> tuple[str, ...]:
        """KV cache dtypes besides the compute dtype (``auto``) that this platform's attention
        backends store and read: ``"fp8_e4m3"`` for the FP8 KV cache (see
        :mod:`core.quantization.kv_cache`). ``--kv-cache-dtype`` is refused at start for any
        other. Default: none."""
        return ()

    # ---- memory planning ------------------------------------------------------------
    def kv_cache_budget(
        self, requested_bytes: int | None, memory_utilization: float, weights_bytes: int
    ) -> int:
        """Bytes available for the KV cache.

        :param weights_bytes: what the model needs on the device besides the KV cache: its
            weights, or, when the runner profiled a forward pass (see
            :meth:`peak_memory_bytes`), the peak of weights plus activations.

        Default: ``requested_bytes`` if given; else, with :attr:`Capability.DEVICE_MEMORY`,
        ``memory_utilization`` of total device memory minus the weights and what is already
        in use by others; else (host RAM, shared with everything else)
        :data:`DEFAULT_HOST_KV_CACHE_BYTES`, capped at a quarter of available host memory.
        """
        if requested_bytes is not None:
            return requested_bytes
        if Capability.DEVICE_MEMORY not in self.capabilities:
            available, _ = host_memory()
            return min(DEFAULT_HOST_KV_CACHE_BYTES, available // 4)
        free, total = self.memory_info()
        used_by_others = total - free
        return max(0, int(total * memory_utilization) - used_by_others - weights_bytes)

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory measurement (see :meth:`peak_memory_bytes`). Default:
        nothing."""

    def peak_memory_bytes(self) -> int | None:
        """Most device memory this process's tensors held since :meth:`reset_peak_memory`
        (tensors alive at the reset count). Default: None (cannot measure), and the runner
        then sizes the KV cache from the weights alone."""
        return None

    # ---- graphs -----------------------------------------------------------------------
    def decode_graph_runner(
        self, model: ModelForward, kv_caches: list[torch.Tensor], spec: DecodeGraphSpec
    ) -> DecodeGraphRunner | None:
        """A strategy that replays decode steps of ``model`` over ``kv_caches`` from captured
        graphs; asked only of platforms with :attr:`Capability.GRAPH_CAPTURE` (or
        :attr:`Capability.FUSED_DECODE`: then ``spec`` has no attention sites) and not under
        ``--enforce-eager``. Default: None (every step runs eagerly)."""
        return None

    # ---- static shapes ----------------------------------------------------------------
    def batch_shaper(self, block_size: int) -> BatchShaper | None:
        """A strategy that pads every step to this device's buckets (see
        :mod:`core.batch_shape`), for devices that compile one program per input shape.
        The runner applies it once per step, on the host, before the inputs reach the
        device; the attention backend then receives the shaped metadata. Default: None
        (each step has its exact sizes)."""
        return None

    # ---- distributed ----------------------------------------------------------------
    def distributed_backend(self) -> str:
        """torch.distributed backend for collectives. Default: gloo."""
        return "gloo"

    # ---- runtime --------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for queued device work. Default: nothing to wait for."""

    def inference_context(self) -> AbstractContextManager:
        """The grad mode the runner runs model steps in. Default: ``torch.inference_mode()``.
        torch-xla cannot take a view (``t``, ``view``, ``select``) of a tensor made outside
        inference mode, such as a weight or a KV cache, inside it; XLA platforms return
        ``torch.no_grad()``."""
        return torch.inference_mode()

    def step_boundary(self) -> None:
        """Called by the runner once per step, after the forward pass and before sampling.
        Lazy-tracing devices (XLA) cut the step's traced graph here and launch it, so each
        step is one cached program instead of a graph that grows with every step.
        Default: nothing."""

    def empty_cache(self) -> None:
        """Release cached allocator memory. Default: nothing."""

    def seed_everything(self, seed: int) -> None:
        """Seed torch's generators used on this device. Default: ``torch.manual_seed``."""
        torch.manual_seed(seed)

    def set_device(self, index: int) -> None:
        """Make ``index`` the current device of this process. Default: nothing."""

    def validate(self, config: EngineConfig) -> EngineConfig:
        """Check and adjust a config for this device; return a new frozen config (never
        mutate). Raise ValueError naming the value, the limit and the fix. Default: checks
        the block size and the dtype against the supported ones."""
        bs = config.cache.block_size
        if bs not in self.supported_block_sizes():
            raise ValueError(
                f"block size {bs} is not supported by platform {self.name!r}; "
                f"use --block-size with one of {list(self.supported_block_sizes())}"
            )
        names = [str(d).removeprefix("torch.") for d in self.supported_dtypes()]
        if config.model.dtype not in names:
            raise ValueError(
                f"dtype {config.model.dtype} is not supported by platform {self.name!r}; "
                f"use --dtype with one of {names}"
            )
        if config.model.weight_format not in self.supported_weight_formats():
            raise ValueError(
                f"weight format {config.model.weight_format!r} is not supported by platform "
                f"{self.name!r}; use one of {list(self.supported_weight_formats())}"
            )
        return config

    def get_extension(self, name: str) -> Any:
        """Escape hatch for vendor-specific extras. Default: None for every name."""
        return None

    @staticmethod
    def replace(config: EngineConfig, **parts: Any) -> EngineConfig:
        """Helper for ``validate``: a copy of ``config`` with some parts replaced."""
        return dataclasses.replace(config, **parts)


def builtin_backend(
    platform: str,
    requested: str | None,
    default: type[AttentionBackend],
    *others: type[AttentionBackend],
) -> type[AttentionBackend]:
    """:meth:`Platform.attention_backend_class` for the built-in backends: ``default`` when
    nothing is requested, else the one named ``requested``; any other name is an error that
    lists what ``platform`` has (plugin backends are looked up before the platform is asked)."""
    if requested is None:
        return default
    backends = {b.name: b for b in (default, *others)}
    if requested not in backends:
        raise ValueError(
            f"attention backend {requested!r} is not built into platform {platform!r} (it has "
            f"{sorted(backends)}); a plugin can add one via core_attention_backends"
        )
    return backends[requested]
