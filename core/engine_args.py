"""User-facing engine arguments (one flat dataclass mirroring the CLI flags)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields

from core.config import GiB

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
DEVICE_MEMORY_FLAGS = ("--gpu-memory-utilization",)
"""Flags only platforms with the ``device_memory`` capability read; ``--help`` hides them
elsewhere."""
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": GiB, "t": 1 << 40}


def parse_size(text: str | int | float | None) -> int | None:
    """'4GiB', '512M', '1.5G' or a plain number of bytes -> bytes."""
    if text is None or isinstance(text, int):
        return text
    if isinstance(text, float):
        return int(text)
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 4GiB, 512MiB or 1073741824")
    unit = (m.group(2) or "").lower()[:1]
    return int(float(m.group(1)) * _UNITS[unit])


def parse_layer_split(text: str | tuple | list) -> tuple[int, ...]:
    """'8,8,7,7' (or a sequence of ints) -> (8, 8, 7, 7); raises ValueError naming the flag."""
    parts = text.split(",") if isinstance(text, str) else list(text)
    try:
        counts = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        counts = ()
    if not counts or min(counts) < 1:
        raise ValueError(f"pp_layer_split (--pp-layer-split)={text!r} is invalid: must be layer "
                         "counts >= 1 per pipeline stage, comma-separated, e.g. 8,8,7,7")
    return counts


# field -> (smallest value, whether None = "decide for me" is allowed)
_COUNTS = {
    "max_model_len": (1, True),
    "block_size": (1, True),
    "num_blocks_override": (1, True),
    "max_num_seqs": (1, False),
    "max_num_batched_tokens": (1, True),
    "watermark_blocks": (0, False),
    "max_num_partial_prefills": (1, False),
    "tensor_parallel_size": (1, False),
    "pipeline_parallel_size": (1, False),
    "max_waiting_requests": (0, True),
    "seed": (0, False),
}
CHOICES = {
    # field -> the values it accepts (also the flag's choices)
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "scheduling_policy": ("fcfs", "priority"),
    "preemption_mode": ("recompute", "swap"),
    "executor": ("auto", "uni", "mp", "ray"),
    "load_format": ("auto", "safetensors", "gguf", "pt", "dummy"),
    "kv_cache_dtype": ("auto", "fp8", "fp8_e4m3"),  # see core.quantization.kv_cache
}


def _where(name: str) -> str:
    return f"{name} (--{name.replace('_', '-')})"


def validate_engine_args(args: EngineArgs) -> None:
    """Refuse values the engine would misread: 0 or a negative count is not "unset", a
    float or a bool is not a count. Raises ValueError naming the argument and the limit."""
    for name, (low, optional) in _COUNTS.items():
        value = getattr(args, name)
        if value is None and optional:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            unset = " or None (automatic)" if optional else ""
            raise ValueError(f"{_where(name)}={value!r} is invalid: must be an integer >= {low}{unset}")
    from core.quantization.kv_cache import normalize_kv_cache_dtype  # (imports torch)

    normalize_kv_cache_dtype(args.kv_cache_dtype)  # before CHOICES: says why e5m2 & co. are not
    for name, allowed in CHOICES.items():
        if getattr(args, name) not in allowed:
            raise ValueError(f"{_where(name)}={getattr(args, name)!r} is invalid: must be one of {', '.join(allowed)}")
    if args.async_scheduling is not None and not isinstance(args.async_scheduling, bool):
        raise ValueError(f"{_where('async_scheduling')}={args.async_scheduling!r} is invalid: must be "
                         "True, False or None (on where the executor supports it)")
    util = args.gpu_memory_utilization
    if isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1:
        raise ValueError(f"{_where('gpu_memory_utilization')}={util!r} is invalid: must be a fraction in (0, 1]")
    swap = args.swap_space
    if isinstance(swap, bool) or not isinstance(swap, int | float) or not 0 <= swap < float("inf"):
        raise ValueError(f"{_where('swap_space')}={swap!r} is invalid: must be a number of GiB >= 0")
    if args.kv_cache_memory is not None:
        size = parse_size(args.kv_cache_memory) if not isinstance(args.kv_cache_memory, bool) else 0
        if size is None or size <= 0:
            raise ValueError(f"{_where('kv_cache_memory')}={args.kv_cache_memory!r} is invalid: must be a size "
                             "> 0 (e.g. 2GiB) or None (the platform's default budget)")


@dataclass
class EngineArgs:
    """Everything a user can set when starting an engine. ``None`` means "decide for me".

    Each field is one command-line flag (``--max-num-seqs`` for ``max_num_seqs``), made by
    :mod:`core.entrypoints.engine_flags` from the field's type, default and the docstring
    below it, which is the flag's help: add a field with a docstring and the flag exists.
    """

    model: str | None = None
    """HF model dir or .gguf file (default: the embedded SmolLM2-135M-Instruct)"""
    tokenizer: str | None = None
    """tokenizer dir (default: the model's own)"""
    platform: str | None = None
    """platform name (default: CORE_PLATFORM, else the best probe; see `core platforms`)"""
    dtype: str = "auto"
    """compute dtype; auto = the platform's choice for the checkpoint"""
    max_model_len: int | None = None
    """longest prompt + reply in tokens (default: the model's max_position_embeddings)"""
    block_size: int | None = None
    """tokens per KV block (default: the platform's)"""
    kv_cache_memory: int | str | None = None
    """KV cache size in bytes or e.g. 2GiB (default: the platform's budget)"""
    gpu_memory_utilization: float = 0.9
    """fraction of the device's memory for weights, activations and KV cache (platforms with
    their own device memory; --kv-cache-memory overrides)"""
    swap_space: float = 0.0
    """GiB of host memory for swapped-out KV blocks"""
    kv_cache_dtype: str = "auto"
    """what the KV cache stores: auto (the compute dtype) or fp8 (= fp8_e4m3: float8 with
    per-layer scales, from the checkpoint when it has them; about twice the tokens of a bf16
    cache)"""
    enable_prefix_caching: bool = True
    """reuse the KV blocks of a shared prompt prefix (--no-prefix-caching: do not)"""
    num_blocks_override: int | None = None
    """exact number of KV blocks, ignoring the memory budget (for tests)"""
    max_num_seqs: int = 256
    """most sequences in one step's batch"""
    max_num_batched_tokens: int | None = None
    """most tokens in one step (default: max(2048, min(max-model-len, 8192)))"""
    enable_chunked_prefill: bool = True
    """prefill long prompts in chunks (--no-chunked-prefill: each prompt in one step)"""
    scheduling_policy: str = "fcfs"
    """fcfs = arrival order; priority = lower priority value first, then arrival"""
    preemption_mode: str = "recompute"
    """what a preempted sequence loses: its KV (recompute) or moves it to host (swap)"""
    watermark_blocks: int = 0
    """free KV blocks kept in reserve when admitting new requests"""
    max_num_partial_prefills: int = 1
    """how many prompts may be mid-prefill at once"""
    tensor_parallel_size: int = 1
    """devices to split every layer over (per pipeline stage)"""
    pipeline_parallel_size: int = 1
    """pipeline stages, each holding a range of the layers on its own tensor-parallel devices"""
    pp_layer_split: str | None = None
    """decoder layers per pipeline stage, e.g. 8,8,7,7 (default: as even as possible, larger
    shares first)"""
    executor: str = "auto"
    """where the model runs: uni = this process, mp = one process per rank, ray"""
    ray_address: str | None = None
    """Ray cluster to join with --executor ray, e.g. HEAD_IP:6379 (default: RAY_ADDRESS, a
    cluster on this host, or a new local one)"""
    load_format: str = "auto"
    """checkpoint format; dummy = random weights of the model's shape (benchmarks)"""
    weight_format: str = "auto"
    """in-memory weight format: auto (platform's choice, with --dtype auto), dense, or a
    platform format (cpu: int8, int4)"""
    quantization: str | None = None
    """quantization method: fp8, awq, gptq, compressed-tensors, gguf (default: the
    checkpoint's quantization_config); fp8 on a bf16 checkpoint quantizes it on load"""
    seed: int = 0
    """seed of the engine's random state at start (dummy weights; sampling of requests
    without --sample-seed)"""
    attention_backend: str | None = None
    """attention backend by name (default: the platform's)"""
    enforce_eager: bool = False
    """no graph capture or compilation"""
    async_scheduling: bool | None = None
    """schedule step N+1 while the device runs step N (default: on with the in-process
    executor, off with mp/ray, which run steps synchronously)"""
    max_waiting_requests: int | None = None
    """refuse new requests while this many wait (default: no limit)"""
    disable_log_stats: bool = False
    """no periodic throughput and queue log lines from the server"""
    log_prompts: bool = False
    """include prompt text in request logs"""

    def __post_init__(self) -> None:
        validate_engine_args(self)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One flag per field (see :func:`core.entrypoints.engine_flags.add_engine_flags`)."""
        from core.entrypoints.engine_flags import add_engine_flags

        add_engine_flags(parser)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})
