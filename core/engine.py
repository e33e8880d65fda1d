"""LLMEngine: the in-process engine for offline use — a front end (tokenize, detokenize,
stop strings) around an :class:`~core.engine_core.core.EngineCore`, whose ``step()`` is
schedule -> execute -> update (pipelined one step deep with asynchronous scheduling: see
docs/engine.md). The OpenAI server runs the same EngineCore in its own process
(:mod:`core.async_engine`)."""

from __future__ import annotations

import math

from core.engine_args import EngineArgs
from core.engine_core.core import (
    EngineCore,
    EngineOverloaded,
    load_platform_and_config,
    vocab_size_of,
)
from core.engine_core.resolve import resolve_config
from core.input_processor import InputProcessor
from core.output_processor import OutputProcessor
from core.outputs import RequestOutput
from core.platform import Platform
from core.plugins import Plugins
from core.sampling_params import SamplingParams
from core.tokenizer import eos_token_ids, load_tokenizer

__all__ = ["EngineOverloaded", "LLMEngine", "resolve_config"]


class LLMEngine:
    """Accepts requests, runs steps, returns outputs. Not thread-safe: drive it from one
    thread."""

    def __init__(self, config, platform: Platform, plugins: Plugins):
        self.config = config
        self.platform = platform
        m = config.model
        self.tokenizer = load_tokenizer(m.tokenizer, m.gguf_file, m.cache_dir)
        self.vocab_size = vocab_size_of(config, self.tokenizer)
        self.core = EngineCore(config, platform, plugins, eos_token_ids(self.tokenizer, m.hf_config), self.vocab_size)
        self.inputs = InputProcessor(self.tokenizer, self.vocab_size, m.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._pending: list[RequestOutput] = []
        """Final outputs of aborted requests, returned by the next step()."""
        self._ids = 0

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def executor(self):
        return self.core.executor

    @property
    def kv_plan(self):
        return self.core.kv_plan

    @property
    def block_manager(self):
        return self.core.block_manager

    @classmethod
    def from_args(cls, args: EngineArgs, plugins: Plugins | None = None) -> LLMEngine:
        config, platform, plugins = load_platform_and_config(args, plugins)
        return cls(config, platform, plugins)

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
        """Queue a request; returns its id. Raises ValueError for bad input (including a
        request that can never fit the KV cache) and EngineOverloaded for a full queue.

        ``final_only``: step() returns this request's output only once it has finished
        (offline batches), sparing the per-step output and detokenization work.
        """
        request_id = request_id if request_id is not None else self._next_id()
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use; ids must be unique")
        req, text = self.inputs.process(request_id, prompt, params, priority, arrival_time)
        self.core.add_request(req)  # raises before the front end tracks anything
        self.output_processor.add_request(req, text, final_only)
        return request_id

    def _next_id(self) -> str:
        self._ids += 1
        return f"req-{self._ids}"

    def abort_request(self, request_id: str, report: bool = True) -> None:
        """Stop a request; its blocks are free now and its final output (finish_reason
        'abort') comes with the next step (unless ``report`` is False)."""
        self.core.abort([request_id])
        out = self.output_processor.abort(request_id)
        if out is not None and report:
            self._pending.append(out)

    # ---- the loop -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine-core step (schedule -> execute -> update), then its deltas as outputs."""
        outputs, self._pending = self._pending, []
        if self.core.has_unfinished_requests():
            new, stops = self.output_processor.process(self.core.step())
            outputs += new
            for hit in stops:
                self.core.stop_sample(hit.request_id, hit.index)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or bool(self._pending)

    def shutdown(self) -> None:
        self.core.shutdown()

    def max_concurrency(self) -> int:
        return math.floor(self.kv_plan.max_concurrent_at_max_len)
