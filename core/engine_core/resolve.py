"""From user arguments to a validated, frozen :class:`~core.config.EngineConfig` for a
platform (read once where the engine core is built)."""

from __future__ import annotations

import torch

from core.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from core.engine_args import EngineArgs, parse_layer_split, parse_size
from core.executor.parallel_check import validate_parallel
from core.model_loader import default_model_path, load_config
from core.platform import Platform
from core.quantization.kv_cache import kv_cache_dtype_for
from core.quantization.registry import quantization_for


def _quantization(gguf_file: str | None) -> str | None:
    """"q4" when most of a GGUF's tensors are 4-bit (Q4_0, Q4_1, Q4_K), else None."""
    if gguf_file is None:
        return None
    from core.gguf_file import open_index

    types = [t.qtype for t in open_index(gguf_file).tensors]
    four_bit = sum(t in (2, 3, 12) for t in types)  # ggml types Q4_0, Q4_1, Q4_K
    return "q4" if types and four_bit * 2 > len(types) else None


def _checkpoint_dtype(hf_config) -> torch.dtype:
    # transformers 5 names it ``dtype`` and warns on every read of ``torch_dtype``;
    # configs saved by older versions may carry only the old name
    d = getattr(hf_config, "dtype", None) or vars(hf_config).get("torch_dtype")
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else torch.float32


def resolve_config(args: EngineArgs, platform: Platform, cache_dir: str | None = None,
                   plugins=None) -> EngineConfig:
    """Turn user arguments into a validated, frozen EngineConfig for ``platform``
    (``plugins``: where quantization methods and other platforms come from)."""
    model_path = args.model or default_model_path()
    arch, hf_config, gguf_file, tok_path = load_config(model_path, cache_dir)
    quantization = quantization_for(args.quantization, hf_config, gguf_file, platform, plugins)
    auto_dtype, auto_format = platform.default_formats(
        _checkpoint_dtype(hf_config), _quantization(gguf_file)
    )
    dtype = str(auto_dtype).removeprefix("torch.") if args.dtype == "auto" else args.dtype
    weight_format = args.weight_format
    if weight_format == "auto":
        # the platform's pick applies only together with its dtype pick
        weight_format = auto_format if args.dtype == "auto" else "dense"
    model_max = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", 2048)
    max_len = args.max_model_len or model_max
    if max_len > model_max:
        raise ValueError(
            f"--max-model-len {max_len} exceeds the model's max_position_embeddings {model_max}; "
            f"use at most {model_max}"
        )
    load_format = args.load_format
    if load_format == "auto":
        load_format = "gguf" if gguf_file else "safetensors"
    model = ModelConfig(
        model=model_path,
        tokenizer=args.tokenizer or tok_path,
        architecture=arch,
        hf_config=hf_config,
        dtype=dtype,
        max_model_len=max_len,
        load_format=load_format,
        seed=args.seed,
        gguf_file=gguf_file,
        cache_dir=cache_dir,
        weight_format=weight_format,
        quantization=quantization,
    )
    block_size = args.block_size or platform.preferred_block_size()
    cache = CacheConfig(
        block_size=block_size,
        kv_cache_memory=parse_size(args.kv_cache_memory),
        gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space=args.swap_space,
        enable_prefix_caching=args.enable_prefix_caching,
        num_blocks_override=args.num_blocks_override,
        cache_dtype=kv_cache_dtype_for(args.kv_cache_dtype, platform, plugins),
    )
    budget = args.max_num_batched_tokens or max(2048, min(max_len, 8192))
    if not args.enable_chunked_prefill and budget < max_len:
        budget = max_len  # without chunking a whole prompt must fit one step
    sched = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        policy=args.scheduling_policy,
        preemption_mode=args.preemption_mode,
        watermark_blocks=args.watermark_blocks,
        max_num_partial_prefills=args.max_num_partial_prefills,
        max_waiting_requests=args.max_waiting_requests,
    )
    if args.swap_space == 0 and args.preemption_mode == "swap":
        raise ValueError("--preemption-mode swap needs host memory: set --swap-space GiB (e.g. 4)")
    config = EngineConfig(
        model=model,
        cache=cache,
        scheduler=sched,
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            executor=args.executor,
            pipeline_parallel_size=args.pipeline_parallel_size,
            pp_layer_split=parse_layer_split(args.pp_layer_split) if args.pp_layer_split else None,
            ray_address=args.ray_address,
        ),
        platform=platform.name,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        disable_log_stats=args.disable_log_stats,
        log_prompts=args.log_prompts,
    )
    validate_parallel(config, platform)
    return platform.validate(config)
