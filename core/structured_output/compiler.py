"""One grammar compiler per tokenizer: compiles specs off the engine loop and caches them.

llguidance (chosen over xgrammar: docs/benchmarks/structured_output.md) builds a grammar's
lexer lazily, at the first mask. So "compiling" here means: check the spec, build a matcher
and compute its first mask in a worker thread; the warmed matcher is kept as a template that
each sequence's matcher copies (a copy costs microseconds; a cold build tens of milliseconds
on a 49k vocabulary). The library drops the GIL while it builds, so the pool's threads run
beside the engine loop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from core.structured_output.spec import GrammarError, GrammarSpec


class CompiledGrammar:
    """A checked, warmed grammar for one tokenizer; :meth:`GrammarCompiler.matcher` makes
    per-sequence matchers from it. Never mutated after construction."""

    def __init__(self, spec: GrammarSpec, template: Any, vocab_size: int):
        self.spec = spec
        self.vocab_size = vocab_size
        self._template = template

    def new_llmatcher(self) -> Any:
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` s for one tokenizer; build once per model.

    :param tokenizer: a fast HF tokenizer (``PreTrainedTokenizerFast``).
    :param vocab_size: the model's vocabulary (logits width); it may exceed the tokenizer's,
        and the ids past the tokenizer are never allowed.
    :param eos_token_ids: ids that end a sequence (the engine's EOS set); the grammar allows
        them exactly where the output may end. Default: the tokenizer's EOS.
    :param max_workers: compile threads.
    :param cache_size: compiled grammars kept (least recently used dropped first).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int] | None = None,
        max_workers: int = 2,
        cache_size: int = 256,
    ):
        import llguidance
        import llguidance.hf

        tok_size = len(tokenizer)
        if vocab_size < tok_size:
            raise ValueError(
                f"model vocab_size {vocab_size} is smaller than the tokenizer's {tok_size} tokens; "
                f"structured output needs a logit for every token: check the model and tokenizer pair"
            )
        eos = sorted(set(eos_token_ids)) if eos_token_ids else None
        if eos is None and tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token: pass eos_token_ids to GrammarCompiler")
        self.vocab_size = vocab_size
        self._llg = llguidance
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor(num_threads=max_workers)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._checked: OrderedDict[GrammarSpec, None] = OrderedDict()

    def submit(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """Compile ``spec`` in the pool (or return the cached or in-flight future). The
        future raises :class:`GrammarError` for a spec the library refuses; a failed spec
        is not cached, so a retry compiles again."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f: self._forget_failed(spec, f))
        return fut

    def check(self, spec: GrammarSpec) -> None:
        """Validate ``spec`` now, in this thread (milliseconds: no lexer is built), so a
        request the library refuses is refused when it arrives. Specs already compiled or
        checked return at once.

        :raises GrammarError: the library's message, naming the request field.
        """
        with self._lock:
            fut = self._cache.get(spec)
            if spec in self._checked or (fut is not None and fut.done() and fut.exception() is None):
                return
        self._validate(spec.to_llguidance(), spec)
        with self._lock:
            self._checked[spec] = None
            while len(self._checked) > self._cache_size:
                self._checked.popitem(last=False)

    def _validate(self, grammar: str, spec: GrammarSpec) -> None:
        try:
            is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        except Exception as e:  # noqa: BLE001 - whatever the library raises, it is the spec's fault
            raise GrammarError(f"{spec.field or spec.kind}: {e}") from None
        if is_error:
            raise GrammarError(f"{spec.field or spec.kind}: {messages[0]}")

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """:meth:`submit` and wait (tests, the offline ``LLM``)."""
        return self.submit(spec).result()

    def _forget_failed(self, spec: GrammarSpec, fut: Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            return
        with self._lock:
            if self._cache.get(spec) is fut:
                del self._cache[spec]

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        grammar = spec.to_llguidance()
        self._validate(grammar, spec)
        template = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(f"{spec.field or spec.kind}: {template.get_error()}")
        warm = torch.empty(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        template.unsafe_compute_mask_ptr(warm.data_ptr(), warm.numel() * 4)  # builds the lexer
        if template.is_error():
            raise GrammarError(f"{spec.field or spec.kind}: {template.get_error()}")
        return CompiledGrammar(spec, template, self.vocab_size)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
