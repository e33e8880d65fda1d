"""``POST /v1/chat/completions``: the chat template turns messages into one prompt."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from core.entrypoints.openai.errors import OpenAIError, bad_request
from core.entrypoints.openai.logprobs import chat_logprobs
from core.entrypoints.openai.protocol import (
    AssistantMessage,
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
    until_disconnect,
    until_expired,
)
from core.outputs import RequestOutput


def _check(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise bad_request("tools (function calling) are not supported; leave tools out", param="tools")
    if req.tool_choice not in (None, "none"):
        raise bad_request("tool_choice other than 'none' is not supported", param="tool_choice")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request("only response_format {'type': 'text'} is supported", param="response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")


def _message(m: ChatMessage) -> dict[str, Any]:
    content = m.content
    if isinstance(content, list):  # text parts: join, as templates expect a string
        content = "\n".join(p.text for p in content)
    # Templates know system/user/assistant; OpenAI's newer 'developer' role is a system turn.
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
    if m.name is not None:
        out["name"] = m.name
    return out


async def _render(ctx: ServerContext, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
    template = ctx.chat_template

    def render(engine: Any) -> list[int]:
        tok = engine.tokenizer
        if template is None and not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; start the server with "
                             "--chat-template or use /v1/completions")
        ids = tok.apply_chat_template(messages, chat_template=template, add_generation_prompt=add_generation_prompt,
                                      tokenize=True, return_dict=False)
        return list(ids)

    try:
        return await ctx.call_engine(render)
    except OpenAIError:
        raise
    except Exception as e:  # template errors are the request's fault (roles out of order, ...)
        raise bad_request(f"cannot apply the chat template: {e}", param="messages") from e


async def create_chat_completion(req: ChatCompletionRequest, raw: Request, ctx: ServerContext) -> Response:
    ctx.check_model(req.model)
    _check(req)
    max_tokens = req.max_completion_tokens or req.max_tokens
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = ctx.sampling_params(req, max_tokens, k)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    ctx.warn_unknown_fields(request_id, req)
    messages = [_message(m) for m in req.messages]
    ctx.check_prompt_text([m["content"] for m in messages], "messages")
    prompt = await _render(ctx, messages, req.add_generation_prompt)
    ctx.check_prompt_ids([prompt], "messages")
    ctx.check_room(max_tokens, [len(prompt)], "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
    texts = await ctx.token_texts() if k is not None else []
    streams = await ctx.submit(request_id, [prompt], params, req.priority)
    ctx.log_received(request_id, "chat", req, [messages], max_tokens)
    if req.stream:
        events = _events(ctx, req, request_id, streams, texts)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
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
    choices = []
    for comp in out.outputs:
        lp = None
        if k is not None:
            lp = ChoiceLogprobs(content=chat_logprobs(comp.token_ids, comp.logprobs or (),
                                                      range(len(comp.token_ids)), k, texts))
        choices.append(ChatChoice(index=comp.index, message=AssistantMessage(content=comp.text), logprobs=lp,
                                  finish_reason=comp.finish_reason, stop_reason=comp.stop_reason))
    resp = ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=_usage(out))
    return JSONResponse(resp.model_dump())


def _usage(out: RequestOutput) -> Usage:
    gen = sum(len(c.token_ids) for c in out.outputs)
    return Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=gen,
                 total_tokens=len(out.prompt_token_ids) + gen)


async def _events(
    ctx: ServerContext, req: ChatCompletionRequest, request_id: str, streams: list, texts: list[str]
) -> AsyncIterator[str]:
    created = int(time.time())
    stops = tuple([req.stop] if isinstance(req.stop, str) else req.stop or [])
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    k = (req.top_logprobs or 0) if req.logprobs else None

    def sse(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        chunk = ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage)
        return f"data: {json.dumps(chunk.model_dump())}\n\n"

    cursors = [ChoiceCursor() for _ in range(req.n)]
    try:
        yield sse([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(req.n)])
        last = None
        async for _, out in until_expired(ctx, merge_streams(streams)):
            last = out
            choices = []
            for comp in out.outputs:
                delta, positions, reason = cursors[comp.index].advance(comp, stops)
                lp = None
                if k is not None and len(positions):
                    lp = ChoiceLogprobs(content=chat_logprobs(comp.token_ids, comp.logprobs or (), positions, k, texts))
                if delta or lp or reason:
                    choices.append(ChatChunkChoice(index=comp.index, delta=DeltaMessage(content=delta or None),
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
