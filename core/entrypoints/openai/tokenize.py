"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes).

/tokenize takes either ``prompt`` (text, with ``add_special_tokens``, default true) or
``messages`` (rendered with the chat template exactly as /v1/chat/completions renders them,
with ``add_generation_prompt`` (default true), ``continue_final_message``,
``chat_template_kwargs``, ``tools`` (handed to the template), and ``add_special_tokens`` (default false: the template already
writes them)). It answers ``{count, max_model_len, tokens, token_strs}``; ``token_strs``
(each token's own string) only with ``return_token_strs: true``.

/detokenize takes ``tokens`` and answers ``{prompt}`` (special tokens kept, as vLLM does).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.entrypoints.openai.errors import OpenAIError, bad_request
from core.entrypoints.openai.protocol import ChatMessage, StrictModel, Text, TokenId
from core.entrypoints.openai.serving import ServerContext

MAX_DETOKENIZE = 1 << 20
"""Most token ids one /detokenize takes (max_model_len is the useful bound; this one only
keeps a body within --max-request-body-bytes from costing unbounded decode time)."""


class TokenizeRequest(StrictModel):
    """One of ``prompt`` or ``messages``; unknown fields are refused (400 naming them)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Text | None = None
    prompt: Text | None = Field(None, description="Text to tokenize (or send messages).")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = Field(
        None, description="A chat, rendered with the chat template (or send prompt).")
    add_special_tokens: bool | None = Field(
        None, description="Add the tokenizer's BOS/EOS; default true for prompt, false for messages.")
    add_generation_prompt: bool = Field(True, description="messages only: end with the assistant's turn opener.")
    continue_final_message: bool = Field(
        False, description="messages only: leave the last (assistant) message open to be continued.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="messages only: extra variables for the chat template (e.g. enable_thinking).")
    tools: list[dict[str, Any]] | None = Field(
        None, description="messages only: tool definitions, handed to the chat template as `tools`.")
    return_token_strs: bool = Field(False, description="Also return each token's string.")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt (text) or messages (a chat)")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true; "
                             "set add_generation_prompt to false to continue the last message")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: Text | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE)]


class DetokenizeResponse(BaseModel):
    prompt: str


async def tokenize(req: TokenizeRequest, ctx: ServerContext) -> TokenizeResponse:
    ctx.check_model(req.model)
    if req.prompt is not None:
        ctx.check_prompt_text([req.prompt], "prompt")
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await ctx.call_engine(lambda e: list(e.tokenizer.encode(req.prompt, add_special_tokens=special)))
    else:
        ids = await _render_chat(req, ctx)
    strs = None
    if req.return_token_strs:
        strs = await ctx.call_engine(lambda e: list(e.tokenizer.convert_ids_to_tokens(ids)))
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs)


async def _render_chat(req: TokenizeRequest, ctx: ServerContext) -> list[int]:
    from core.entrypoints.openai.chat import (
        _message,  # one normalization of messages for both routes
    )

    messages = [_message(m) for m in req.messages]
    ctx.check_prompt_text([m["content"] for m in messages if isinstance(m.get("content"), str)], "messages")
    template = ctx.chat_template
    kwargs = dict(req.chat_template_kwargs or {})
    if req.tools is not None:
        kwargs["tools"] = req.tools

    def render(engine: Any) -> list[int]:
        tok = engine.tokenizer
        if template is None and not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; start the server with "
                             "--chat-template, or send prompt instead of messages")
        text = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message, **kwargs)
        return list(tok.encode(text, add_special_tokens=bool(req.add_special_tokens)))

    try:
        return await ctx.call_engine(render)
    except OpenAIError:
        raise
    except Exception as e:  # template errors are the request's fault (roles out of order, ...)
        raise bad_request(f"cannot apply the chat template: {e}", param="messages") from e


async def detokenize(req: DetokenizeRequest, ctx: ServerContext) -> DetokenizeResponse:
    ctx.check_model(req.model)
    bad = [t for t in req.tokens if t >= ctx.vocab_size]
    if bad:
        raise bad_request(f"tokens {bad[:5]} are outside the vocabulary [0, {ctx.vocab_size}); "
                          f"send ids below {ctx.vocab_size}", param="tokens")
    text = await ctx.call_engine(lambda e: e.tokenizer.decode(req.tokens, skip_special_tokens=False))
    return DetokenizeResponse(prompt=text)
