"""``POST /v1/chat/completions``: the chat template turns messages (and tools) into one
prompt; the choices' text becomes messages with reasoning and tool calls parsed out
(``chat_output.py``)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from core.entrypoints.openai.chat_output import ChoiceShape, plain_tool_choice
from core.entrypoints.openai.errors import OpenAIError, bad_request
from core.entrypoints.openai.logprobs import chat_logprobs
from core.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChoiceLogprobs,
    DeltaMessage,
    Usage,
)
from core.entrypoints.openai.serving import (
    SSE_HEADERS,
    ChoiceCursor,
    ClientDisconnected,
    ServerContext,
    engine_error,
    final_output,
    merge_streams,
    prompt_logprobs_json,
    until_disconnect,
    until_expired,
)
from core.entrypoints.openai.tool_parsers import TOOL_PARSERS, guess_tool_parser
from core.outputs import RequestOutput

RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})
"""apply_chat_template's own arguments: chat_template_kwargs may not set them."""


def _check(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not available with stream=true; send stream=false",
                          param="prompt_logprobs")
    if req.continue_final_message and "add_generation_prompt" in req.model_fields_set and req.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true (one continues "
                          "the last message, the other starts a new one)", param="continue_final_message")
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise bad_request(f"continue_final_message needs the last message to be the assistant's (it is "
                          f"{req.messages[-1].role!r})", param="continue_final_message")
    taken = sorted(RESERVED_TEMPLATE_KWARGS & set(req.chat_template_kwargs or ()))
    if taken:
        raise bad_request(f"chat_template_kwargs may not set {taken}: they are request fields or the server's "
                          "own arguments", param="chat_template_kwargs")
    if req.tool_choice is not None and req.tool_choice != "none" and not req.tools:
        raise bad_request("tool_choice needs tools", param="tool_choice")


def _tool_mode(ctx: ServerContext, req: ChatCompletionRequest) -> tuple[str | None, Any]:
    """(native parser name for ``auto``, forcing tool_choice as a plain value)."""
    if not req.tools or req.tool_choice == "none":
        return None, None
    if req.tool_choice not in (None, "auto"):
        return None, plain_tool_choice(req.tool_choice)
    name = ctx.tool_call_parser or guess_tool_parser(ctx.chat_template or getattr(ctx.engine.tokenizer,
                                                                                   "chat_template", None))
    if name is None:
        raise bad_request(
            "tool_choice 'auto' needs a tool-call parser and this model's chat template shows no known format; "
            f"start the server with --tool-call-parser (one of {sorted(TOOL_PARSERS)}), or send tool_choice "
            "'required' or a named function (enforced by a grammar, no parser needed)", param="tool_choice")
    return name, None


def _message(m: ChatMessage) -> dict[str, Any]:
    """One message as the chat template takes it; no field the client sent is dropped."""
    content = m.content
    if isinstance(content, list):  # text parts: join, as templates expect a string
        content = "\n".join(p.text for p in content)
    # Templates know system/user/assistant; OpenAI's newer 'developer' role is a system turn.
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        # Templates (Qwen, Llama, Mistral) write arguments with `| tojson`: give them the
        # object, not the JSON text OpenAI sends back (which would be quoted twice).
        out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                                      "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


async def _render(ctx: ServerContext, req: ChatCompletionRequest, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> tuple[list[int], str]:
    """(prompt ids, the last characters of the prompt text)."""
    template = ctx.chat_template
    add_generation_prompt = req.add_generation_prompt and not (
        req.continue_final_message and "add_generation_prompt" not in req.model_fields_set)

    def render(engine: Any) -> tuple[list[int], str]:
        tok = engine.tokenizer
        if template is None and not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; start the server with "
                             "--chat-template or use /v1/completions")
        ids = tok.apply_chat_template(messages, tools=tools, chat_template=template,
                                      add_generation_prompt=add_generation_prompt,
                                      continue_final_message=req.continue_final_message,
                                      tokenize=True, return_dict=False, **(req.chat_template_kwargs or {}))
        ids = list(ids)
        return ids, tok.decode(ids[-16:], skip_special_tokens=False)

    try:
        return await ctx.call_engine(render)
    except OpenAIError:
        raise
    except Exception as e:  # template errors are the request's fault (roles out of order, ...)
        raise bad_request(f"cannot apply the chat template: {e}", param="messages") from e


async def create_chat_completion(req: ChatCompletionRequest, raw: Request, ctx: ServerContext) -> Response:
    ctx.check_model(req.model)
    _check(req)
    native, forced = _tool_mode(ctx, req)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" else None
    spec = ctx.structured_spec(req, {"tools": tools, "tool_choice": forced})
    max_tokens = req.max_completion_tokens or req.max_tokens
    k = (req.top_logprobs or 0) if req.logprobs else None
    keep_special = native is not None and TOOL_PARSERS[native].keeps_special_tokens
    params = ctx.sampling_params(req, max_tokens, k, structured=spec, skip_special_tokens=False if keep_special else None)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    headers = ctx.warn_unknown_fields(request_id, req)
    messages = [_message(m) for m in req.messages]
    ctx.check_prompt_text([m["content"] for m in messages], "messages")
    prompt, tail = await _render(ctx, req, messages, tools)
    ctx.check_prompt_ids([prompt], "messages")
    ctx.check_room(max_tokens, [len(prompt)], "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
    await ctx.check_grammar(spec)
    shape = ChoiceShape(ctx.reasoning_parser, tail, native, forced, req.parallel_tool_calls)
    texts = await ctx.token_texts() if k is not None or req.prompt_logprobs is not None else []
    streams = await ctx.submit(request_id, [prompt], params, req.priority)
    ctx.log_received(request_id, "chat", req, [messages], max_tokens)
    if req.stream:
        events = _events(ctx, req, request_id, streams, texts, shape)
        return StreamingResponse(events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
    try:
        out = await until_disconnect(raw, final_output(streams[0]), ctx.grace)
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the request was aborted
    except Exception as e:
        err = engine_error(e)
        if err is e:
            raise
        raise err from e
    ctx.log_finished(request_id, [out])
    resp = ChatCompletionResponse(id=request_id, model=ctx.served.answer_name(req.model), choices=_choices(out, shape, k, texts),
                                  usage=_usage(out), prompt_logprobs=prompt_logprobs_json(out, texts))
    return JSONResponse(resp.model_dump(), headers=headers)


def _choices(out: RequestOutput, shape: ChoiceShape, k: int | None, texts: list[str]) -> list[ChatChoice]:
    choices = []
    for comp in out.outputs:
        lp = None
        if k is not None:
            lp = ChoiceLogprobs(content=chat_logprobs(comp.token_ids, comp.logprobs or (),
                                                      range(len(comp.token_ids)), k, texts))
        message = shape.message(comp.text)
        reason = shape.finish_reason(comp.finish_reason, bool(message.tool_calls))
        choices.append(ChatChoice(index=comp.index, message=message, logprobs=lp, finish_reason=reason,
                                  stop_reason=comp.stop_reason))
    return choices


def _usage(out: RequestOutput) -> Usage:
    gen = sum(len(c.token_ids) for c in out.outputs)
    return Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=gen,
                 total_tokens=len(out.prompt_token_ids) + gen)


async def _events(
    ctx: ServerContext, req: ChatCompletionRequest, request_id: str, streams: list, texts: list[str],
    shape: ChoiceShape,
) -> AsyncIterator[str]:
    created = int(time.time())
    stops = tuple([req.stop] if isinstance(req.stop, str) else req.stop or [])
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    k = (req.top_logprobs or 0) if req.logprobs else None

    model = ctx.served.answer_name(req.model)

    def sse(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        chunk = ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)
        return f"data: {chunk.model_dump_json()}\n\n"  # pydantic's encoder, as completions' _sse

    cursors = [ChoiceCursor() for _ in range(req.n)]
    parsers = [shape.streamer() for _ in range(req.n)]
    try:
        yield sse([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(req.n)])
        last = None
        async for _, out in until_expired(ctx, merge_streams(streams)):
            last = out
            choices = []
            for comp in out.outputs:
                text, positions, reason = cursors[comp.index].advance(comp, stops)
                parser = parsers[comp.index]
                delta = parser.feed(text) if text else None
                if reason is not None:
                    delta = _joined(delta, parser.finish())
                    reason = shape.finish_reason(reason, parser.has_calls)
                lp = None
                if k is not None and len(positions):
                    lp = ChoiceLogprobs(content=chat_logprobs(comp.token_ids, comp.logprobs or (), positions, k, texts))
                if delta or lp or reason:
                    choices.append(ChatChunkChoice(index=comp.index, delta=delta or DeltaMessage(),
                                                   logprobs=lp, finish_reason=reason))
            if choices:
                yield sse(choices)
        if last is not None:
            ctx.log_finished(request_id, [last])
            if include_usage:
                yield sse([], _usage(last))
    except Exception as e:
        err = engine_error(e)
        yield (err if isinstance(err, OpenAIError) else OpenAIError(500, "internal server error")).sse()
    yield "data: [DONE]\n\n"


def _joined(a: DeltaMessage | None, b: DeltaMessage | None) -> DeltaMessage | None:
    """One delta holding both (the last text of a choice and what its parsers flushed)."""
    if a is None or b is None:
        return a or b

    def cat(x: str | None, y: str | None) -> str | None:
        return (x or "") + (y or "") or None

    calls = (a.tool_calls or []) + (b.tool_calls or [])
    return DeltaMessage(content=cat(a.content, b.content), reasoning_content=cat(a.reasoning_content,
                        b.reasoning_content), tool_calls=calls or None)
