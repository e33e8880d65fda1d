"""LLMEngine: the synchronous engine. ``step()`` is schedule -> execute -> update."""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from core import envs
from core.block_manager import BlockManager
from core.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from core.engine_args import EngineArgs, parse_size
from core.executor import Executor, UniExecutor
from core.model_loader import default_model_path, load_config
from core.model_runner import RunnerSetup
from core.models import ModelRegistry
from core.ops import Ops
from core.output_processor import OutputProcessor
from core.outputs import RequestOutput
from core.parallel_check import validate_parallel
from core.platform import Platform
from core.plugins import Plugins, load_plugins
from core.request import Request
from core.sampling_params import SamplingParams
from core.scheduler import Scheduler
from core.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


def _quantization(gguf_file: str | None) -> str | None:
    """"q4" when most of a GGUF's tensors are 4-bit (Q4_0, Q4_1, Q4_K), else None."""
    if gguf_file is None:
        return None
    from core.gguf_file import open_index

    types = [t.qtype for t in open_index(gguf_file).tensors]
    four_bit = sum(t in (2, 3, 12) for t in types)  # ggml types Q4_0, Q4_1, Q4_K
    return "q4" if types and four_bit * 2 > len(types) else None


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (``max_waiting_requests``); retry later."""


def _checkpoint_dtype(hf_config) -> torch.dtype:
    # transformers 5 names it ``dtype`` and warns on every read of ``torch_dtype``;
    # configs saved by older versions may carry only the old name
    d = getattr(hf_config, "dtype", None) or vars(hf_config).get("torch_dtype")
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else torch.float32


def resolve_config(args: EngineArgs, platform: Platform, cache_dir: str | None = None) -> EngineConfig:
    """Turn user arguments into a validated, frozen EngineConfig for ``platform``."""
    model_path = args.model or default_model_path()
    arch, hf_config, gguf_file, tok_path = load_config(model_path, cache_dir)
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
    )
    block_size = args.block_size or platform.preferred_block_size()
    cache = CacheConfig(
        block_size=block_size,
        kv_cache_memory=parse_size(args.kv_cache_memory),
        gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space=args.swap_space,
        enable_prefix_caching=args.enable_prefix_caching,
        num_blocks_override=args.num_blocks_override,
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
        parallel=ParallelConfig(args.tensor_parallel_size, args.executor),
        platform=platform.name,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        disable_log_stats=args.disable_log_stats,
        log_prompts=args.log_prompts,
    )
    validate_parallel(config, platform)
    return platform.validate(config)


class LLMEngine:
    """Accepts requests, runs steps, returns outputs. Not thread-safe: drive it from one
    thread (the async engine does)."""

    def __init__(self, config: EngineConfig, platform: Platform, plugins: Plugins):
        self.config = config
        self.platform = platform
        self.tokenizer = load_tokenizer(
            config.model.tokenizer, config.model.gguf_file, config.model.cache_dir
        )
        self.eos_token_ids = eos_token_ids(self.tokenizer, config.model.hf_config)
        platform.seed_everything(config.model.seed)
        self.executor = self._make_executor(plugins)
        self.kv_plan = self.executor.initialize()
        self._warn_if_oversubscribed()
        c = config.cache
        self.block_manager = BlockManager(
            self.kv_plan.num_blocks, c.block_size, c.enable_prefix_caching, self.kv_plan.num_host_blocks,
            sliding_window=self.kv_plan.sliding_window,
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.output_processor = OutputProcessor(
            self.scheduler, self.tokenizer, self.eos_token_ids, config.model.max_model_len
        )
        self.vocab_size = int(getattr(config.model.hf_config, "vocab_size", 0) or len(self.tokenizer))
        self._ids = 0

    def _warn_if_oversubscribed(self) -> None:
        """max_num_seqs x max_model_len may exceed the cache: legal and common (most sequences
        are short, and a one-prompt run never comes near it), so DEBUG, with the numbers for
        whoever investigates preemptions under load."""
        plan, want = self.kv_plan, self.config.scheduler.max_num_seqs
        if plan.max_concurrent_at_max_len < want:
            logger.debug(
                "max_num_seqs %d x max_model_len %d would need %d KV blocks; the cache holds %d "
                "(%d sequences at full length). Longer sequences will wait or be preempted; to run "
                "all at full length raise --kv-cache-memory (or --gpu-memory-utilization) or lower "
                "--max-num-seqs / --max-model-len",
                want, plan.max_model_len, want * plan.blocks_per_max_len_seq,
                plan.num_blocks - 1, plan.max_concurrent_at_max_len,
            )

    @classmethod
    def from_args(cls, args: EngineArgs, plugins: Plugins | None = None) -> LLMEngine:
        env = envs.read()
        plugins = plugins or load_plugins(env.no_plugin_autoload, env.plugins)
        info = plugins.select(args.platform or env.platform)
        platform = info.cls()
        if env.num_threads and platform.device_type == "cpu":
            torch.set_num_threads(env.num_threads)
        plugins.register_model_configs()  # before the checkpoint's config.json is read
        config = resolve_config(args, platform, env.cache_dir)
        logger.info("platform %s (%s); model %s (%s, %s)", platform.name, info.probe.reason,
                    config.model.model, config.model.architecture, config.model.dtype)
        return cls(config, platform, plugins)

    def _make_executor(self, plugins: Plugins) -> Executor:
        extra = plugins.attention_backends(self.platform.name)
        requested = self.config.attention_backend
        setup = RunnerSetup(
            config=self.config,
            platform=self.platform,
            ops=Ops({**self.platform.ops(), **plugins.op_overrides(self.platform.name, self.config)}),
            registry=ModelRegistry(plugins.model_architectures()),
            attention_backend_cls=extra.get(requested) if requested else None,
        )
        tp = self.config.parallel.tensor_parallel_size
        if tp == 1 and self.config.parallel.executor in ("auto", "uni"):
            return UniExecutor(setup, self.eos_token_ids)
        from core.distributed_executor import make_distributed_executor

        return make_distributed_executor(setup, self.eos_token_ids)

    # ---- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        final_only: bool = False,
    ) -> str:
        """Queue a request; returns its id. Raises ValueError for bad input.

        ``final_only``: step() returns this request's output only once it has finished
        (offline batches), sparing the per-step output and detokenization work.
        """
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else self._next_id()
        if self.scheduler.get_request(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use; ids must be unique")
        limit = self.config.scheduler.max_waiting_requests
        if limit is not None and self.scheduler.stats().num_waiting >= limit:
            raise EngineOverloaded(
                f"{limit} requests are already waiting (--max-waiting-requests {limit}); retry later"
            )
        text, ids = self._tokenize(prompt)
        params = self._check_params(params, len(ids))
        req = Request(request_id, tuple(ids), params, prompt=text, priority=priority)
        if arrival_time is not None:
            req.arrival_time = arrival_time
            for s in req.seqs:
                s.arrival_time = arrival_time
        self.output_processor.add_request(req, final_only)
        self.scheduler.add_request(req)
        return request_id

    def _tokenize(self, prompt: str | list[int] | None) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            text = prompt
        else:
            ids, text = list(prompt or []), None
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not (0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return text, ids

    def _check_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        max_len = self.config.model.max_model_len
        if prompt_len >= max_len:
            raise ValueError(
                f"the prompt has {prompt_len} tokens but max_model_len is {max_len} (prompt plus "
                f"at least one generated token must fit); shorten the prompt or raise --max-model-len"
            )
        params.check_vocab(self.vocab_size)
        room = max_len - prompt_len
        if params.max_tokens is None or params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room)
        if params.min_tokens > params.max_tokens:
            params = dataclasses.replace(params, min_tokens=params.max_tokens)
        return params

    def _next_id(self) -> str:
        self._ids += 1
        return f"req-{self._ids}"

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its blocks are free now and its final output (finish_reason
        'abort') comes with the next step."""
        if self.scheduler.abort_request(request_id):
            self.output_processor.abort(request_id)

    # ---- the loop -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        result = self.executor.execute(sched)
        return self.output_processor.update(sched, result)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.output_processor.has_pending()

    def shutdown(self) -> None:
        self.executor.shutdown()

    def max_concurrency(self) -> int:
        return math.floor(self.kv_plan.max_concurrent_at_max_len)
