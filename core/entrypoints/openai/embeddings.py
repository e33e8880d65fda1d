"""``POST /v1/embeddings`` for decoder models (``core serve --task embed``).

OpenAI's shapes: ``input`` is a string, a list of strings, a list of token ids, or a list of
such lists; ``encoding_format`` ``float`` (lists of numbers) or ``base64`` (little-endian
float32 bytes, what the openai SDK asks for by default). vLLM's extensions: ``normalize``
(default true) and ``add_special_tokens`` (default true). The pooling (``--pooling-type``:
the last prompt token's hidden state, or the mean over the prompt) runs in the engine
(core/pooling.py): each input is one engine request that computes its prompt and stops.

``dimensions`` is refused unless it equals the model's hidden size: shortening a vector is
only meaningful for models trained for it (Matryoshka), which no decoder model here is.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from typing import Annotated, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from core.entrypoints.openai.errors import OpenAIError, bad_request
from core.entrypoints.openai.protocol import (
    MAX_INT,
    MAX_PROMPTS,
    NonEmptyStr,
    StrictModel,
    Text,
    TokenId,
)
from core.entrypoints.openai.serving import (
    ClientDisconnected,
    ServerContext,
    engine_error,
    final_output,
    until_disconnect,
)
from core.pooling import PoolingParams, PoolingType
from core.sampling_params import SamplingParams

logger = logging.getLogger("core.entrypoints.openai")

EmbeddingInput = (
    NonEmptyStr
    | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_PROMPTS)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
)


class EmbeddingRequest(StrictModel):
    """Unknown fields are refused (400 naming them)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Text | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=MAX_INT,
                                   description="Must equal the model's embedding size (no Matryoshka truncation).")
    user: Text | None = Field(None, description="End-user id; only logged (with --log-prompts).")
    # extensions (vLLM's names)
    normalize: bool = Field(True, description="extension: scale each vector to unit L2 norm")
    add_special_tokens: bool = Field(True, description="extension: add BOS etc. to text inputs")
    priority: int = Field(0, ge=-(2**31), lt=2**31, description="extension")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def _inputs(value: str | list) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if isinstance(value[0], int):
        return [list(value)]
    return list(value)


async def _token_ids(ctx: ServerContext, texts: list[str], add_special: bool) -> list[list[int]]:
    """Text inputs tokenized on the tokenizer thread (vLLM's add_special_tokens applies)."""
    return await ctx.call_engine(lambda e: [list(e.tokenizer.encode(t, add_special_tokens=add_special)) for t in texts])


async def create_embedding(req: EmbeddingRequest, raw: Request, ctx: ServerContext, pooling: PoolingType) -> Response:
    ctx.check_model(req.model)
    inputs = _inputs(req.input)
    texts = [p for p in inputs if isinstance(p, str)]
    ctx.check_prompt_text(texts, "input")
    encoded = iter(await _token_ids(ctx, texts, req.add_special_tokens) if texts else [])
    prompts = [next(encoded) if isinstance(p, str) else p for p in inputs]
    if any(not p for p in prompts):
        raise bad_request("an input tokenizes to no tokens (add_special_tokens is false and the text is empty "
                          "of tokens); send text that has tokens", param="input")
    ctx.check_prompt_ids(prompts, "input")
    # One greedy, undetokenized token: the request computes its prompt, pools, and stops.
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                            pooling=PoolingParams(pooling, req.normalize))
    request_id = f"embd-{uuid.uuid4().hex}"
    streams = await ctx.submit(request_id, prompts, params, req.priority)
    if ctx.log_requests:
        logger.info("%s: embeddings, %d input(s), %d tokens, pooling %s%s", request_id, len(prompts),
                    sum(map(len, prompts)), pooling, f", user={req.user!r}" if ctx.log_prompts else "")
    try:
        outs = await until_disconnect(raw, asyncio.gather(*(final_output(s) for s in streams)), ctx.grace)
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:
        err = engine_error(e)
        if err is e:
            raise
        raise err from e
    vectors = [o.pooled for o in outs]
    if any(not v for v in vectors):  # aborted (shutdown, cache exhausted), or LOST (core/pooling.py)
        raise OpenAIError(503, "the engine could not pool an input (the request was stopped, or it was "
                               "swapped out too long mid-prompt); retry", code="pooling_failed",
                          headers={"Retry-After": "1"})
    size = len(vectors[0])
    if req.dimensions is not None and req.dimensions != size:
        raise bad_request(f"dimensions={req.dimensions} is not supported: this model's embeddings have {size} "
                          "dimensions and it was not trained for shorter (Matryoshka) ones; leave dimensions out "
                          f"or send {size}", param="dimensions", code="dimensions_not_supported")
    data = [EmbeddingData(index=i, embedding=_encode(v, req.encoding_format)) for i, v in enumerate(vectors)]
    n_tokens = sum(len(o.prompt_token_ids) for o in outs)
    resp = EmbeddingResponse(id=request_id, model=ctx.served.answer_name(req.model), data=data,
                             usage=EmbeddingUsage(prompt_tokens=n_tokens, total_tokens=n_tokens))
    return JSONResponse(resp.model_dump())


def _encode(vec: tuple[float, ...], fmt: str) -> list[float] | str:
    if fmt == "float":
        return list(vec)
    return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
