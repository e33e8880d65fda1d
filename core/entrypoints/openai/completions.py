"""``POST /v1/completions``: one engine request per prompt, n choices each.

Choice indices are ``prompt_index * n + sample_index`` (as OpenAI numbers them).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from core.entrypoints.openai.errors import OpenAIError, bad_request
from core.entrypoints.openai.logprobs import completion_logprobs
from core.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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
from core.outputs import RequestOutput


def _prompts(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def _check(req: CompletionRequest) -> None:
    if req.suffix is not None:
        raise bad_request("suffix is not supported; leave it out", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of={req.best_of} differs from n={req.n}; only best_of == n is supported",
                          param="best_of")
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not available with stream=true; send stream=false",
                          param="prompt_logprobs")


def _check_prompts(ctx: ServerContext, req: CompletionRequest, prompts: list[str | list[int]]) -> None:
    """Size limits before anything is tokenized or queued."""
    texts = [p for p in prompts if isinstance(p, str)]
    ids = [p for p in prompts if not isinstance(p, str)]
    ctx.check_prompt_text(texts, "prompt")
    ctx.check_prompt_ids(ids)
    if "max_tokens" in req.model_fields_set:  # the default (16) is a cap, not a demand
        ctx.check_room(req.max_tokens, [len(i) for i in ids], "max_tokens")


async def create_completion(req: CompletionRequest, raw: Request, ctx: ServerContext) -> Response:
    ctx.check_model(req.model)
    _check(req)
    prompts = _prompts(req.prompt)
    _check_prompts(ctx, req, prompts)
    spec = ctx.structured_spec(req)
    params = ctx.sampling_params(req, req.max_tokens, req.logprobs, structured=spec,
                                 prompt_logprobs=_prompt_logprobs_k(req))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    headers = ctx.warn_unknown_fields(request_id, req)
    await ctx.check_grammar(spec)
    texts = await ctx.token_texts() if params.logprobs is not None or params.prompt_logprobs is not None else []
    # text prompts are measured only once tokenized (in the engine client): refuse there too
    streams = await ctx.submit(request_id, prompts, params, req.priority,
                               exact_max_tokens="max_tokens" in req.model_fields_set)
    ctx.log_received(request_id, "completions", req, prompts, req.max_tokens)
    if req.stream:
        events = _events(ctx, req, request_id, streams, texts)
        return StreamingResponse(events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})

    async def collect() -> list[RequestOutput]:
        return list(await asyncio.gather(*(final_output(s) for s in streams)))

    try:
        outs = await until_disconnect(raw, collect(), ctx.grace)
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the requests were aborted
    except Exception as e:
        err = engine_error(e)
        if err is e:
            raise
        raise err from e
    ctx.log_finished(request_id, outs)
    echoes = await _echo_texts(ctx, req, outs)
    resp = CompletionResponse(id=request_id, model=ctx.served.answer_name(req.model), choices=[], usage=_usage(outs))
    for i, out in enumerate(outs):
        plp = prompt_logprobs_json(out, texts) if req.prompt_logprobs is not None else None
        for comp in out.outputs:
            lp = None
            if req.logprobs is not None:
                lp = _choice_logprobs(req, out, comp, texts, echoes[i])
            resp.choices.append(CompletionChoice(index=i * req.n + comp.index, text=echoes[i] + comp.text,
                                                 logprobs=lp, finish_reason=comp.finish_reason,
                                                 stop_reason=comp.stop_reason, prompt_logprobs=plp))
    return JSONResponse(resp.model_dump(), headers=headers)


def _prompt_logprobs_k(req: CompletionRequest) -> int | None:
    """Prompt logprobs the engine computes: the request's, or with echo and logprobs the
    top ``logprobs`` of each echoed prompt token (OpenAI's echo layout), whichever is more."""
    if not (req.echo and req.logprobs is not None):
        return req.prompt_logprobs
    return max(req.logprobs, req.prompt_logprobs or 0)


def _choice_logprobs(req: CompletionRequest, out: RequestOutput, comp, texts: list[str],
                     echo: str) -> CompletionLogprobs:
    """The legacy logprobs of one choice; with echo the prompt tokens come first (the first
    one has no logprob: nothing precedes it)."""
    gen = completion_logprobs(comp.token_ids, comp.logprobs or (), range(len(comp.token_ids)),
                              req.logprobs, texts, len(echo))
    if not req.echo:
        return gen
    head = _echo_logprobs(out, req.logprobs, texts, echo)
    return CompletionLogprobs(
        text_offset=head.text_offset + gen.text_offset, token_logprobs=head.token_logprobs + gen.token_logprobs,
        tokens=head.tokens + gen.tokens, top_logprobs=head.top_logprobs + gen.top_logprobs)


def _echo_logprobs(out: RequestOutput, k: int, texts: list[str], echo: str) -> CompletionLogprobs:
    """The echoed prompt's part of the legacy logprobs: every prompt token, the first one
    without a logprob (nothing precedes it). Offsets count the tokens' texts."""
    ids = list(out.prompt_token_ids)
    first = texts[ids[0]] if ids[0] < len(texts) else ""
    head = completion_logprobs(ids[1:], (out.prompt_logprobs or ())[1:], range(len(ids) - 1), k, texts, 0)
    tokens = [first, *head.tokens]
    return CompletionLogprobs(text_offset=_offsets_in(echo, tokens), token_logprobs=[None, *head.token_logprobs],
                              tokens=tokens, top_logprobs=[None, *head.top_logprobs])


def _offsets_in(text: str, tokens: list[str]) -> list[int]:
    """Where each token starts in the echoed ``text``: a token whose text is not there (BOS,
    half a character) takes the position of what follows it."""
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        if tok and text.startswith(tok, pos):
            pos += len(tok)
    return offsets


async def _echo_texts(ctx: ServerContext, req: CompletionRequest, outs: list[RequestOutput]) -> list[str]:
    if not req.echo:
        return [""] * len(outs)
    if all(o.prompt is not None for o in outs):
        return [o.prompt or "" for o in outs]
    ids = [o.prompt_token_ids for o in outs]
    return await ctx.call_engine(lambda e: [o.prompt or e.tokenizer.decode(list(t)) for o, t in zip(outs, ids)])


def _usage(outs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    gen = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=gen, total_tokens=prompt + gen)


def _sse(obj: CompletionResponse) -> str:
    # pydantic's own JSON encoder: 1.3 us per chunk, json.dumps(model_dump()) 4.8 us
    return f"data: {obj.model_dump_json()}\n\n"


async def _events(
    ctx: ServerContext, req: CompletionRequest, request_id: str, streams: list, texts: list[str]
) -> AsyncIterator[str]:
    created = int(time.time())
    model = ctx.served.answer_name(req.model)
    stops = tuple([req.stop] if isinstance(req.stop, str) else req.stop or [])
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    cursors: dict[int, ChoiceCursor] = {}
    finals: dict[int, RequestOutput] = {}
    echoed: dict[int, int] = {}  # prompt index -> length of its echoed text
    try:
        async for i, out in until_expired(ctx, merge_streams(streams)):
            # Echo once the prompt is computed (its logprobs, with logprobs, are complete then).
            if req.echo and i not in echoed and (out.finished or any(c.token_ids for c in out.outputs)):
                echo = out.prompt if out.prompt is not None else await _echo_ids(ctx, out)
                echoed[i] = len(echo)
                lp = _echo_logprobs(out, req.logprobs, texts, echo) if req.logprobs is not None else None
                yield _sse(_chunk(request_id, created, model, [
                    CompletionChoice(index=i * req.n + k, text=echo, logprobs=lp) for k in range(req.n)]))
            choices = []
            for comp in out.outputs:
                index = i * req.n + comp.index
                cur = cursors.setdefault(index, ChoiceCursor())
                start = cur.text_sent + echoed.get(i, 0)
                delta, positions, reason = cur.advance(comp, stops)
                lp = None
                if req.logprobs is not None and len(positions):
                    lp = completion_logprobs(comp.token_ids, comp.logprobs or (), positions, req.logprobs, texts, start)
                if delta or lp or reason:
                    choices.append(CompletionChoice(index=index, text=delta, logprobs=lp, finish_reason=reason,
                                                    stop_reason=comp.stop_reason if reason else None))
            if choices:
                yield _sse(_chunk(request_id, created, model, choices))
            if out.finished:
                finals[i] = out
        outs = [finals[i] for i in sorted(finals)]
        ctx.log_finished(request_id, outs)
        if include_usage:
            yield _sse(_chunk(request_id, created, model, [], _usage(outs)))
    except Exception as e:
        err = engine_error(e)
        yield (err if isinstance(err, OpenAIError) else OpenAIError(500, "internal server error")).sse()
    yield "data: [DONE]\n\n"


async def _echo_ids(ctx: ServerContext, out: RequestOutput) -> str:
    ids = list(out.prompt_token_ids)
    return await ctx.call_engine(lambda e: e.tokenizer.decode(ids))


def _chunk(request_id: str, created: int, model: str, choices: list[CompletionChoice],
           usage: Usage | None = None) -> CompletionResponse:
    return CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)
