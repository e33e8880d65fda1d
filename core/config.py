"""Frozen configuration objects.

Users fill :class:`EngineArgs` (flat, mirrors the CLI flags); the engine resolves it once
into an :class:`EngineConfig` made of small frozen parts. Components receive only the
values they use. Derived values (the number of KV blocks, say) are returned by the code
that computes them and never written back into a config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GiB = 1 << 30


@dataclass(frozen=True)
class ModelConfig:
    model: str
    """Path of an HF model directory or a ``.gguf`` file."""
    tokenizer: str
    """Path to load the tokenizer from (defaults to ``model``)."""
    architecture: str
    """HF ``architectures[0]``, the key of the model registry."""
    hf_config: Any = field(compare=False, repr=False)
    """The ``transformers`` config object describing the network."""
    dtype: str = "float32"
    """Resolved compute dtype name: float32 | bfloat16 | float16."""
    max_model_len: int = 2048
    """Longest prompt + output the engine accepts for one sequence."""
    load_format: str = "auto"
    """auto | safetensors | gguf | pt | dummy (random weights, for benchmarks)."""
    seed: int = 0
    gguf_file: str | None = None
    """Set when ``model`` is a GGUF file (tokenizer and chat template come from it)."""
    cache_dir: str | None = None
    """Where files derived from the model (a GGUF's config/tokenizer) are cached."""
    weight_format: str = "dense"
    """How linear weights are kept in memory: dense (in ``dtype``) or a platform
    supported quantized form (see the platform's ``supported_weight_formats``)."""
    quantization: Any = None
    """The checkpoint's :class:`core.quantization.QuantizationMethod` (from
    ``--quantization``, config.json ``quantization_config`` or a GGUF file), None when the
    weights are not quantized."""


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    """Tokens per KV block (chosen by the platform when the user sets none)."""
    kv_cache_memory: int | None = None
    """Bytes of KV cache; None lets the platform decide (see Platform.kv_cache_budget)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory the engine may use (devices with their own memory)."""
    swap_space: float = 0.0
    """GiB of host memory for swapped-out KV blocks (preemption_mode='swap')."""
    enable_prefix_caching: bool = True
    num_blocks_override: int | None = None
    """Force the number of KV blocks (tests, debugging)."""
    cache_dtype: str = "auto"
    """What the KV cache stores: auto (the compute dtype) or fp8_e4m3 (float8 with per-layer
    scales, see core.quantization.kv_cache)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most sequences in one step's batch."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decodes)."""
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    """fcfs | priority (lower priority value runs first)."""
    preemption_mode: str = "recompute"
    """recompute | swap."""
    watermark_blocks: int = 0
    """Free blocks kept in reserve when admitting new requests."""
    max_num_partial_prefills: int = 1
    """How many prompts may be mid-prefill at once (starvation guard)."""
    max_waiting_requests: int | None = None


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    executor: str = "auto"
    """auto | uni (in-process) | mp (one process per rank) | ray."""
    pipeline_parallel_size: int = 1
    """Pipeline stages; each holds a contiguous range of the decoder layers and runs on
    ``tensor_parallel_size`` ranks."""
    pp_layer_split: tuple[int, ...] | None = None
    """Decoder layers per stage, first stage first; None: as even as possible, larger
    shares first (see core.executor.pipeline.split_layers)."""
    ray_address: str | None = None
    """The Ray cluster to join (``ray.init(address=...)``); None: Ray's own default
    (RAY_ADDRESS, a cluster on this host, or a new local one)."""

    @property
    def world_size(self) -> int:
        """Ranks in all: one per device."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    platform: str
    """Name of the selected platform."""
    attention_backend: str | None = None
    """Name of an attention backend to use instead of the platform's default."""
    enforce_eager: bool = False
    """Disable graph capture / compilation even where the platform supports it."""
    async_scheduling: bool | None = None
    """Schedule step N+1 while step N runs on the device (the engine core learns step N's
    tokens one step later). None: on where the executor supports it (the in-process one),
    off otherwise; True with an executor that cannot is refused."""
    disable_log_stats: bool = False
    log_prompts: bool = False
    """Log prompt text in request logs (off by default for privacy)."""
