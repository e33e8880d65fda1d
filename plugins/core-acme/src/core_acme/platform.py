"""The Acme NPU platform: a made-up accelerator, emulated on the host CPU.

There is no Acme silicon and no ``acme`` torch device: registering a torch device type
needs a C++ backend (PrivateUse1), which an emulation has no reason to build. So tensors
live on ``torch.device("cpu")`` and :attr:`AcmePlatform.verification` says "emulated".
Everything else is the NPU's own: its KV layout and kernels
(:mod:`core_acme.attention`), its block sizes (32, 64), its dtypes (no float16 units),
its simulated device memory (``ACME_NPU_MEMORY``, default 2 GiB), its config checks and
its static step shapes (:mod:`core_acme.buckets`: the NPU compiles a program per shape, so
the platform returns a batch shaper and every step arrives padded).

Selection: the probe scores 0 ("no Acme NPU here") unless ``ACME_NPU_EMULATE=1``; then
it scores :data:`EMULATED_SCORE`, above the CPU platform's 1, so an opted-in host picks
``acme`` without ``--platform``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from core.attention import AttentionBackend, AttentionSpec
from core.batch_shape import BatchShaper, BucketedBatchShaper
from core.config import EngineConfig
from core.platform import Capability, Platform, ProbeResult, host_memory
from core_acme import envs
from core_acme.attention import BLOCK_SIZES, DTYPES, AcmeAttentionBackend
from core_acme.buckets import AcmeBuckets

EMULATED_SCORE = 10
FIRMWARE_RESERVED = 64 << 20
"""Bytes of device memory the (simulated) firmware keeps: reported as in use."""
MAX_TOKENS_PER_STEP = 8192
"""The NPU's command queue holds at most this many tokens of one step."""
HOST_RAM_SHARE = 0.5
"""At most this share of available host RAM may back the emulated KV cache."""


@dataclass(frozen=True)
class AcmeDeviceProperties:
    """What ``get_extension("acme.device_properties")`` returns (vendor-specific facts)."""

    name: str
    memory_bytes: int
    block_sizes: tuple[int, ...]
    kv_layout: str


class AcmePlatform(Platform):
    name = "acme"
    device_type = "cpu"
    dispatch_key = "CPU"
    capabilities = frozenset({Capability.DEVICE_MEMORY})
    verification = "emulated"  # no Acme silicon exists; its tensors are on torch device cpu

    def __init__(self) -> None:
        self.env = envs.read()

    # ---- discovery --------------------------------------------------------------------
    @classmethod
    def probe(cls) -> ProbeResult:
        env = envs.read()
        if not env.emulate:
            return ProbeResult(
                0, f"no Acme NPU on this host; set {envs.EMULATE}=1 to emulate one on the CPU"
            )
        if env.memory_bytes is None:
            return ProbeResult(0, env.memory_problem or f"{envs.MEMORY} is unusable")
        return ProbeResult(
            EMULATED_SCORE,
            f"Acme NPU emulated on the host CPU ({envs.EMULATE}=1), 1 device, "
            f"{env.memory_bytes / (1 << 30):.2f} GiB simulated memory ({envs.MEMORY})",
        )

    # ---- device facts -----------------------------------------------------------------
    def device_count(self) -> int:
        return 1

    def _memory_total(self) -> int:
        if self.env.memory_bytes is None:  # only reachable when selected despite probe 0
            raise ValueError(self.env.memory_problem or f"{envs.MEMORY} is unusable")
        return self.env.memory_bytes

    def memory_info(self, device_index: int = 0) -> tuple[int, int]:
        """Simulated: ``total`` from ACME_NPU_MEMORY, the firmware region counted as used."""
        total = self._memory_total()
        return total - FIRMWARE_RESERVED, total

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return DTYPES

    def supported_block_sizes(self) -> tuple[int, ...]:
        return BLOCK_SIZES

    def attention_backend_class(
        self, spec: AttentionSpec, requested: str | None = None
    ) -> type[AttentionBackend]:
        if requested not in (None, AcmeAttentionBackend.name):
            raise ValueError(
                f"platform 'acme' has one attention backend, {AcmeAttentionBackend.name!r}; "
                f"got --attention-backend {requested!r}"
            )
        return AcmeAttentionBackend

    def get_extension(self, name: str) -> Any:
        if name == "acme.device_properties":
            return AcmeDeviceProperties(
                name="Acme NPU (emulated on CPU)",
                memory_bytes=self._memory_total(),
                block_sizes=BLOCK_SIZES,
                kv_layout="[blocks, 2, kv_heads, head*block]: keys [head, block], values [block, head]",
            )
        return None

    # ---- static shapes ------------------------------------------------------------------
    def batch_shaper(self, block_size: int) -> BatchShaper:
        """core's bucketed shaper with the NPU's buckets: the runner pads every step on
        the host, so the backend only ever sees shapes the NPU has a program for."""
        return BucketedBatchShaper(AcmeBuckets(), block_size)

    # ---- memory planning --------------------------------------------------------------
    def kv_cache_budget(
        self, requested_bytes: int | None, memory_utilization: float, weights_bytes: int
    ) -> int:
        free, total = self.memory_info()
        room = int(total * memory_utilization) - (total - free) - weights_bytes
        if requested_bytes is not None and requested_bytes > free - weights_bytes:
            raise ValueError(
                f"--kv-cache-memory {requested_bytes} bytes does not fit the Acme NPU: "
                f"{free} bytes free minus {weights_bytes} bytes of weights leaves "
                f"{free - weights_bytes}; lower --kv-cache-memory or raise {envs.MEMORY} "
                f"(now {self.env.memory_text})"
            )
        budget = requested_bytes if requested_bytes is not None else max(0, room)
        host = int(host_memory()[0] * HOST_RAM_SHARE)
        if budget > host:  # the emulation backs device memory with host RAM
            raise ValueError(
                f"the emulated Acme NPU would allocate a {budget / (1 << 30):.2f} GiB KV cache "
                f"in host RAM, but only {host / (1 << 30):.2f} GiB may be used ("
                f"{HOST_RAM_SHARE:.0%} of what is available); lower {envs.MEMORY} (now "
                f"{self.env.memory_text}), --gpu-memory-utilization or --kv-cache-memory"
            )
        return budget

    # ---- config -------------------------------------------------------------------------
    def validate(self, config: EngineConfig) -> EngineConfig:
        """Refuse what the NPU cannot do; return a copy with eager mode forced (the NPU
        has no graph capture) and the step budget capped at the command-queue size."""
        _check_block_size(config.cache.block_size)
        _check_dtype(config.model.dtype)
        if config.model.weight_format != "dense":
            raise ValueError(
                f"the Acme NPU keeps weights dense; --weight-format "
                f"{config.model.weight_format!r} is not supported (use dense)"
            )
        sched = config.scheduler
        if sched.max_num_batched_tokens > MAX_TOKENS_PER_STEP:
            if not sched.enable_chunked_prefill:
                raise ValueError(
                    f"without chunked prefill a step must hold a whole prompt of up to "
                    f"{sched.max_num_batched_tokens} tokens, but the Acme NPU runs at most "
                    f"{MAX_TOKENS_PER_STEP} per step; keep chunked prefill on or use "
                    f"--max-model-len {MAX_TOKENS_PER_STEP} or less"
                )
            sched = dataclasses.replace(sched, max_num_batched_tokens=MAX_TOKENS_PER_STEP)
        return dataclasses.replace(config, scheduler=sched, enforce_eager=True)


def _check_block_size(block_size: int) -> None:
    if block_size not in BLOCK_SIZES:
        raise ValueError(
            f"block size {block_size} is not supported by platform 'acme': the Acme NPU pages "
            f"the KV cache in blocks of {' or '.join(map(str, BLOCK_SIZES))} tokens; use "
            f"--block-size {BLOCK_SIZES[0]} (or leave it unset)"
        )


def _check_dtype(dtype: str) -> None:
    names = [str(d).removeprefix("torch.") for d in DTYPES]
    if dtype not in names:
        hint = " (it has no float16 units)" if dtype == "float16" else ""
        raise ValueError(
            f"dtype {dtype} is not supported by platform 'acme'{hint}; use --dtype with one "
            f"of {names}"
        )
