"""What the completions and chat handlers share: request checks, sampling parameters,
submitting to the engine with errors mapped to HTTP statuses, stream plumbing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from core.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from core.engine import EngineOverloaded
from core.entrypoints.openai.errors import OpenAIError, bad_request, clip
from core.entrypoints.openai.protocol import PromptLogprob, SamplingRequest
from core.entrypoints.openai.reasoning import make_reasoning_parser
from core.entrypoints.openai.served import ServedModel
from core.entrypoints.openai.shutdown import ShutdownGrace
from core.entrypoints.openai.tool_parsers import get_tool_parser
from core.outputs import CompletionOutput, RequestOutput
from core.sampling_params import SamplingParams
from core.structured_output import GrammarCompiler, GrammarError, GrammarSpec
from core.structured_output.request import spec_from_request

logger = logging.getLogger("core.entrypoints.openai")

T = TypeVar("T")

PROMPT_CHARS_PER_TOKEN = 16
"""Default --max-prompt-chars is this many characters per max_model_len token: far more than
any real tokenizer averages, so only prompts that cannot fit are refused unread."""

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""Keep proxies (nginx) from buffering a token stream."""


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


class ServerContext:
    """Per-app state handed to the handlers (no module globals)."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_name: str,
        chat_template: str | None,
        log_requests: bool,
        log_prompts: bool,
        max_prompt_chars: int | None = None,
        grace: ShutdownGrace | None = None,
        served: ServedModel | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ):
        self.engine = engine
        self.model_name = model_name
        self.served = served or ServedModel((model_name,))  # every name, sampling defaults (server.py)
        info = engine.info
        self.model_root = info.model
        self.max_model_len = info.max_model_len
        self.max_num_seqs = info.max_num_seqs
        self.vocab_size = info.vocab_size
        self.chat_template = chat_template
        self.log_requests = log_requests
        self.log_prompts = log_prompts
        self.max_prompt_chars = max_prompt_chars or PROMPT_CHARS_PER_TOKEN * self.max_model_len
        self.grace = grace
        self._token_texts: list[str] | None = None
        self._token_texts_lock = asyncio.Lock()
        if tool_call_parser is not None:
            get_tool_parser(tool_call_parser)  # an unknown name fails at start-up, listing the known
        if reasoning_parser is not None:
            make_reasoning_parser(reasoning_parser)
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self._grammars: GrammarCompiler | None = None

    # ---- request checks ---------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served.names:
            raise OpenAIError(
                404,
                f"the model {clip(model)!r} does not exist; this server serves {self.served.shown()} (see /v1/models)",
                param="model",
                code="model_not_found",
            )

    def check_prompt_text(self, texts: list[str], param: str) -> None:
        """Refuse text longer than ``max_prompt_chars`` before it reaches the tokenizer
        (tokenizing 10 MB takes seconds and gigabytes for a prompt that cannot fit anyway)."""
        chars = sum(len(t) for t in texts)
        if chars > self.max_prompt_chars:
            raise bad_request(
                f"the prompt has {chars} characters; this server takes at most {self.max_prompt_chars} "
                f"(--max-prompt-chars; max_model_len is {self.max_model_len} tokens); shorten the prompt",
                param=param, code="prompt_too_long")

    def check_prompt_ids(self, prompts: list[list[int]], param: str = "prompt") -> None:
        """Token-id prompts: in the vocabulary and leaving room for one generated token."""
        for ids in prompts:
            if len(ids) >= self.max_model_len:
                raise bad_request(
                    f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} (prompt plus at "
                    "least one generated token must fit); shorten the prompt", param=param, code="prompt_too_long")
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise bad_request(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                                  param=param)

    def check_room(self, max_tokens: int | None, prompt_lens: list[int], param: str) -> None:
        """``max_tokens`` must fit beside the prompt in max_model_len: refused, never cut
        (OpenAI and vLLM answer 400 too). ``prompt_lens`` may be empty when the prompts
        are text not yet tokenized: then the bound is max_model_len - 1."""
        if max_tokens is None:
            return
        longest = max(prompt_lens, default=1)
        room = self.max_model_len - longest
        if max_tokens > room:
            which = f"the prompt has {longest} tokens, " if prompt_lens else "a prompt has at least one token, "
            raise bad_request(
                f"{param}={max_tokens} does not fit: max_model_len is {self.max_model_len} tokens and {which}"
                f"so at most {room} can be generated; lower {param}", param=param, code="max_tokens_too_large")

    def sampling_params(
        self, req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
        structured: GrammarSpec | None = None, prompt_logprobs: int | None = None,
        skip_special_tokens: bool | None = None,
    ) -> SamplingParams:
        """The engine's SamplingParams for ``req``; a bad combination becomes a 400.
        ``prompt_logprobs`` / ``skip_special_tokens``: overrides of the request's fields
        (echo with logprobs needs the prompt's; some tool parsers need special tokens)."""
        req, max_tokens = self.served.with_defaults(req, max_tokens)  # --generation-config
        bad_stops = [t for t in req.stop_token_ids or () if t >= self.vocab_size]
        if bad_stops:
            raise bad_request(f"stop_token_ids {bad_stops[:5]} are outside the vocabulary [0, {self.vocab_size})",
                              param="stop_token_ids")
        if req.n > self.max_num_seqs:
            raise bad_request(
                f"n={req.n} is more than this server runs at once (--max-num-seqs {self.max_num_seqs}); "
                f"ask for at most {self.max_num_seqs} samples",
                param="n",
            )
        try:
            return SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                min_p=req.min_p or 0.0,
                repetition_penalty=req.repetition_penalty or 1.0,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                logit_bias=self._logit_bias(req.logit_bias),
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                ignore_eos=req.ignore_eos,
                stop=_stops(req.stop),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                include_stop_str_in_output=req.include_stop_str_in_output,
                logprobs=logprobs,
                prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
                structured=structured,
            )
        except ValueError as e:
            raise bad_request(str(e), param=_param_of(str(e))) from e

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        if not bias:
            return None
        out: dict[int, float] = {}
        for key, value in bias.items():
            try:
                tid = int(key)
            except ValueError:
                raise bad_request(f"logit_bias key {key!r} is not a token id (an integer as a string)",
                                  param="logit_bias") from None
            if not 0 <= tid < self.vocab_size:
                raise bad_request(f"logit_bias token id {tid} is outside the vocabulary [0, {self.vocab_size})",
                                  param="logit_bias")
            out[tid] = value
        return out

    def warn_unknown_fields(self, request_id: str, req: SamplingRequest) -> dict[str, str]:
        """Log the unknown top-level fields of ``req`` (ignored, as vLLM does) and return the
        response header that names them for the client (empty when there are none)."""
        if not req.model_extra:
            return {}
        names = sorted(req.model_extra)
        shown = [n[:40] for n in names[:5]] + (["..."] if len(names) > 5 else [])
        logger.warning("%s: ignoring %d unsupported field(s) %r", request_id, len(names), shown)
        return {IGNORED_FIELDS_HEADER: ignored_fields_value(names)}

    # ---- structured output -------------------------------------------------------------------
    def structured_spec(self, req: SamplingRequest, extra: dict[str, Any] | None = None) -> GrammarSpec | None:
        """The grammar the request's fields ask for (``extra``: chat's tools and tool_choice
        as plain values); a malformed or conflicting field is a 400 naming it."""
        fields = {name: getattr(req, name) for name in STRUCTURED_FIELDS}
        try:
            return spec_from_request({**fields, **(extra or {})})
        except GrammarError as e:
            raise bad_request(str(e), param=_grammar_param(str(e))) from None

    async def check_grammar(self, spec: GrammarSpec | None) -> None:
        """Let the grammar library check ``spec`` here, on the tokenizer thread (cached per
        spec), so a schema it refuses is a 400 with its message before the engine sees it."""
        if spec is None:
            return

        def check(engine: Any) -> None:
            if self._grammars is None:
                self._grammars = GrammarCompiler(engine.tokenizer, engine.vocab_size, max_workers=1)
            self._grammars.check(spec)

        try:
            await self.call_engine(check)
        except GrammarError as e:
            raise bad_request(str(e), param=_grammar_param(str(e))) from None

    # ---- engine ----------------------------------------------------------------------------------
    async def submit(
        self, request_id: str, prompts: list[str | list[int]], params: SamplingParams, priority: int,
        exact_max_tokens: bool = False,
    ) -> list[RequestStream]:
        """Add one engine request per prompt (ids ``{request_id}-{i}``); all or none.
        ``exact_max_tokens``: the client set max_tokens, so one that does not fit beside a
        prompt is refused, never cut."""
        results = await asyncio.gather(
            *(self.engine.add_request(p, params, f"{request_id}-{i}", priority, exact_max_tokens=exact_max_tokens)
              for i, p in enumerate(prompts)),
            return_exceptions=True,
        )
        streams = [r for r in results if isinstance(r, RequestStream)]
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is None:
            return streams
        for s in streams:
            s.close()
        raise engine_error(error, param=_param_of(str(error))) from error

    async def call_engine(self, fn: Any) -> Any:
        try:
            return await self.engine.call(fn)
        except EngineDeadError as e:
            raise engine_error(e) from e

    async def token_texts(self) -> list[str]:
        """Text of every token id (for logprobs), decoded once on the tokenizer thread."""
        async with self._token_texts_lock:
            if self._token_texts is None:
                self._token_texts = await self.call_engine(_decode_vocab)
        return self._token_texts

    def log_received(self, request_id: str, kind: str, req: SamplingRequest, prompts: list[Any], max_tokens: int | None) -> None:
        if not self.log_requests:
            return
        logger.info("%s: %s, %d prompt(s), n=%d, max_tokens=%s, stream=%s%s", request_id, kind, len(prompts), req.n,
                    max_tokens, req.stream, f", user={req.user!r}, prompt={prompts!r}" if self.log_prompts else "")

    def log_finished(self, request_id: str, outs: list[RequestOutput]) -> None:
        if not self.log_requests:
            return
        reasons = [c.finish_reason for o in outs for c in o.outputs]
        gen = sum(len(c.token_ids) for o in outs for c in o.outputs)
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        m = outs[0].metrics if outs else None
        took = f" in {m.finished_time - m.arrival_time:.3f}s" if m and m.finished_time else ""
        text = f", output={[c.text for o in outs for c in o.outputs]!r}" if self.log_prompts else ""
        logger.info("%s: finished %s, prompt_tokens=%d, completion_tokens=%d%s%s",
                    request_id, reasons, prompt, gen, took, text)


IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
"""Response header naming the unknown top-level request fields the server ignored."""

STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern")


def ignored_fields_value(names: list[str], limit: int = 1024) -> str:
    """The header value: the names, comma-separated, printable ASCII only, at most ``limit``
    characters (a client could send thousands of fields, or names no header may carry)."""
    safe = ["".join(c if 32 < ord(c) < 127 and c != "," else "?" for c in n[:64]) for n in names]
    value = ", ".join(safe)
    if len(value) <= limit:
        return value
    return value[: value.rfind(", ", 0, limit - 4)] + ", ..."  # whole names only


def _grammar_param(message: str) -> str | None:
    """The top-level request field a GrammarError message starts with."""
    first = re.split(r"[\s.:\[]", message, maxsplit=1)[0]
    return first if first in (*STRUCTURED_FIELDS, "tools", "tool_choice", "regex", "choice", "grammar") else None


def engine_error(e: BaseException, param: str | None = None) -> BaseException:
    """Map an exception from the engine to the HTTP error the client should get."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineOverloaded):
        return OpenAIError(503, str(e), code="overloaded", headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, str(e), code="engine_dead")
    if isinstance(e, (ValueError, TypeError)):
        return bad_request(str(e), param=param)
    return e


def prompt_logprobs_json(out: RequestOutput, texts: list[str]) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's ``prompt_logprobs`` layout: per prompt token, None for the first, else token id
    (as a string) -> logprob, rank and decoded text of the top-k plus the prompt token."""
    if out.prompt_logprobs is None:
        return None
    rows: list[dict[str, PromptLogprob] | None] = []
    for entry in out.prompt_logprobs:
        if entry is None:
            rows.append(None)
            continue
        rows.append({str(t): PromptLogprob(logprob=lp.logprob if math.isfinite(lp.logprob) else -9999.0,
                                           rank=lp.rank, decoded_token=texts[t] if t < len(texts) else "")
                     for t, lp in entry.items()})
    return rows


def _decode_vocab(engine: Any) -> list[str]:
    tok = engine.tokenizer
    return [tok.decode([i], skip_special_tokens=False) for i in range(min(len(tok), engine.vocab_size))]


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


_REQUEST_FIELDS = frozenset(SamplingRequest.model_fields) | {"max_tokens", "logprobs", "tools", "tool_choice"}


def _param_of(message: str) -> str | None:
    """The request field an engine or SamplingParams ``ValueError`` is about.

    SamplingParams errors read "SamplingParams.<field>=<value> is invalid: ..."; the engine's
    start with the field ("stop_token_ids contains ...") or are about the prompt.
    """
    if message.startswith("SamplingParams."):
        return message.removeprefix("SamplingParams.").split("=", 1)[0]
    first = re.split(r"[\s=.]", message, maxsplit=1)[0]
    if first in _REQUEST_FIELDS:
        return first
    return "prompt" if "prompt" in message else None


# ---- streams -----------------------------------------------------------------------------------
async def final_output(stream: RequestStream) -> RequestOutput:
    """Drain a stream and return its finished output."""
    last = None
    try:
        async for out in stream:
            last = out
    finally:
        stream.close()
    if last is None:  # a stream always ends with the finished output (or raises)
        raise RuntimeError(f"request {stream.request_id} ended without an output")
    return last


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


def until_expired(ctx: ServerContext, items: AsyncIterator[T]) -> AsyncIterator[T]:
    """``items``, ended with the shutdown grace's error once the grace period ran out."""
    return ctx.grace.until_expired(items) if ctx.grace is not None else items


async def until_disconnect(request: Request, work: Awaitable[T], grace: ShutdownGrace | None = None) -> T:
    """Await ``work`` unless the client disconnects first (then cancel it, which aborts
    its engine requests, and raise :class:`ClientDisconnected`) or the shutdown grace
    period runs out (then cancel it and raise the grace's 503)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    waits = {task, watcher}
    if grace is not None:
        waits.add(asyncio.ensure_future(grace.expired.wait()))
    disconnected = False
    with grace.request() if grace is not None else contextlib.nullcontext():
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            disconnected = watcher.done()
        finally:
            for w in waits - {task}:
                w.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        if disconnected or grace is None:
            raise ClientDisconnected()
        raise grace.error()
    return task.result()


# ---- incremental text ----------------------------------------------------------------------
def stream_safe_len(text: str, stops: tuple[str, ...]) -> int:
    """How much of an unfinished text may be sent: hold back a tail that could still
    become a stop string (which is cut from the output when it completes)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return len(text) - hold


@dataclass
class ChoiceCursor:
    """What has been sent so far for one choice of a streamed response."""

    text_sent: int = 0
    tokens_sent: int = 0
    finished: bool = False

    def advance(self, comp: CompletionOutput, stops: tuple[str, ...]) -> tuple[str, range, str | None]:
        """New text, new token positions, and the finish reason if it finished just now."""
        safe = len(comp.text) if comp.finished else stream_safe_len(comp.text, stops)
        delta = comp.text[self.text_sent:safe] if safe > self.text_sent else ""
        self.text_sent = max(self.text_sent, safe)
        new_tokens = range(self.tokens_sent, len(comp.token_ids))
        self.tokens_sent = len(comp.token_ids)
        reason = None
        if comp.finished and not self.finished:
            self.finished = True
            reason = comp.finish_reason
        return delta, new_tokens, reason
