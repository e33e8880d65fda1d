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
    "max_waiting_requests": (0, True),
    "seed": (0, False),
}
_CHOICES = {
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "scheduling_policy": ("fcfs", "priority"),
    "preemption_mode": ("recompute", "swap"),
    "executor": ("auto", "uni", "mp", "ray"),
    "load_format": ("auto", "safetensors", "gguf", "pt", "dummy"),
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
    for name, allowed in _CHOICES.items():
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
    """Everything a user can set when starting an engine. ``None`` means "decide for me"."""

    model: str | None = None
    """HF model directory or .gguf file; None = the embedded SmolLM2-135M-Instruct."""
    tokenizer: str | None = None
    platform: str | None = None
    """Platform name; None = CORE_PLATFORM or the best probe score."""
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int | None = None
    kv_cache_memory: int | str | None = None
    """Bytes (or '4GiB') of KV cache; None = the platform's default budget."""
    gpu_memory_utilization: float = 0.9
    swap_space: float = 0.0
    """GiB of host memory for swapped-out KV blocks."""
    enable_prefix_caching: bool = True
    num_blocks_override: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    watermark_blocks: int = 0
    max_num_partial_prefills: int = 1
    tensor_parallel_size: int = 1
    executor: str = "auto"
    load_format: str = "auto"
    weight_format: str = "auto"
    """In-memory weight format; auto lets the platform choose (with --dtype auto)."""
    quantization: str | None = None
    """Quantization method (vLLM's names: fp8, awq, gptq, compressed-tensors, gguf); None =
    the checkpoint's own; fp8 on an unquantized checkpoint quantizes it while loading."""
    seed: int = 0
    attention_backend: str | None = None
    enforce_eager: bool = False
    async_scheduling: bool | None = None
    """Schedule the next step while the device runs this one; None = where the executor
    supports it (tensor_parallel_size 1, the in-process executor)."""
    max_waiting_requests: int | None = None
    disable_log_stats: bool = False
    log_prompts: bool = False

    def __post_init__(self) -> None:
        validate_engine_args(self)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=None, help="HF model dir or .gguf file (default: embedded SmolLM2-135M-Instruct)")
        g.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the model's own)")
        g.add_argument("--platform", default=None,
                       help="platform name (default: CORE_PLATFORM, else the best probe; see `core platforms`)")
        g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="compute dtype; auto = the platform's choice for the checkpoint")
        g.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + reply in tokens (default: the model's max_position_embeddings)")
        g.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: the platform's)")
        g.add_argument("--kv-cache-memory", default=None,
                       help="KV cache size, e.g. 2GiB (default: the platform's budget)")
        g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of the device's memory for weights, activations and KV cache "
                            "(platforms with their own device memory; --kv-cache-memory overrides)")
        g.add_argument("--swap-space", type=float, default=0.0, help="GiB of host memory for swapped-out KV blocks")
        g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="do not reuse the KV blocks of a shared prompt prefix")
        g.add_argument("--num-blocks-override", type=int, default=None,
                       help="exact number of KV blocks, ignoring the memory budget (for tests)")
        g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step's batch")
        g.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="most tokens in one step (default: max(2048, min(max-model-len, 8192)))")
        g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                       help="prefill each prompt in one step instead of in chunks")
        g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                       help="fcfs = arrival order; priority = lower priority value first, then arrival")
        g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                       help="what a preempted sequence loses: its KV (recompute) or moves it to host (swap)")
        g.add_argument("--watermark-blocks", type=int, default=0,
                       help="free KV blocks kept in reserve when admitting new requests")
        g.add_argument("--max-num-partial-prefills", type=int, default=1,
                       help="how many prompts may be mid-prefill at once")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="devices to split the model over")
        g.add_argument("--executor", default="auto", choices=["auto", "uni", "mp", "ray"],
                       help="where the model runs: uni = this process, mp = one process per rank, ray")
        g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "pt", "dummy"],
                       help="checkpoint format; dummy = random weights of the model's shape (benchmarks)")
        g.add_argument("--weight-format", default="auto",
                       help="in-memory weight format: auto (platform's choice), dense, or a platform format (cpu: int8, int4)")
        g.add_argument("--quantization", "-q", default=None,
                       help="quantization method: fp8, awq, gptq, compressed-tensors, gguf (default: the "
                            "checkpoint's quantization_config); fp8 on a bf16 checkpoint quantizes it on load")
        g.add_argument("--seed", type=int, default=0,
                       help="seed of the engine's random state at start (dummy weights; sampling of "
                            "requests without --sample-seed)")
        g.add_argument("--attention-backend", default=None,
                       help="attention backend by name (default: the platform's)")
        g.add_argument("--enforce-eager", action="store_true", help="no graph capture or compilation")
        g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="schedule step N+1 while the device runs step N (default: on with the "
                            "in-process executor, off with mp/ray, which run steps synchronously)")
        g.add_argument("--max-waiting-requests", type=int, default=None,
                       help="refuse new requests while this many wait (default: no limit)")
        g.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput and queue log lines from the server")
        g.add_argument("--log-prompts", action="store_true", help="include prompt text in request logs")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})
