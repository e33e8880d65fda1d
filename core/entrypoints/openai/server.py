"""The FastAPI app (:func:`build_app`) and ``core serve`` (:func:`run_server`).

Routes: GET /v1/models, GET /v1/models/{model}, POST /v1/completions,
POST /v1/chat/completions, POST /v1/embeddings (``--task embed``), POST /tokenize,
POST /detokenize, GET /health, GET /metrics, GET /version, GET /openapi.json.

The engine core runs in its own process (:class:`~core.async_engine.AsyncLLMEngine`); this
process tokenizes, detokenizes, and speaks HTTP. If the engine core dies, open requests fail
at once and ``/health`` answers 503.

Shutdown: on SIGTERM uvicorn stops accepting connections, in-flight requests get
``--shutdown-grace-period`` seconds to finish (then each open stream gets a final error
event and ``[DONE]``, each other request a 503, and their engine requests are aborted: see
``shutdown.py``), the engine-core process stops, and the process exits 0.

Guards (``middleware.py``, ``connection.py``): Host header check, request-body size and
time limits, the API key, and a deadline for request heads on every connection.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from core.async_engine import AsyncLLMEngine, EngineDeadError, EngineStartupError
from core.engine_args import EngineArgs
from core.entrypoints.heap import freeze_startup_heap
from core.entrypoints.openai.args import ServerArgs
from core.entrypoints.openai.chat import create_chat_completion
from core.entrypoints.openai.completions import create_completion
from core.entrypoints.openai.connection import protocol_with_header_timeout
from core.entrypoints.openai.embeddings import EmbeddingRequest, EmbeddingResponse, create_embedding
from core.entrypoints.openai.errors import OpenAIError, bad_request, install_error_handlers
from core.entrypoints.openai.generation_config import load_generation_defaults
from core.entrypoints.openai.metrics import CONTENT_TYPE, Metrics
from core.entrypoints.openai.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    HostCheckMiddleware,
    default_allowed_hosts,
)
from core.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from core.entrypoints.openai.served import ServedModel, default_served_name
from core.entrypoints.openai.serving import ServerContext
from core.entrypoints.openai.shutdown import BACKSTOP_S, ShutdownGrace
from core.entrypoints.openai.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    detokenize,
    tokenize,
)
from core.entrypoints.signals import exit_on_sigterm
from core.version import __version__

logger = logging.getLogger("core.entrypoints.openai")

_ERRORS = {
    400: {"model": ErrorResponse, "description": "Invalid parameters, a prompt longer than max_model_len or "
                                                 "--max-prompt-chars, max_tokens beyond the model's room"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key (when --api-key is set)"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    408: {"model": ErrorResponse, "description": "The body did not arrive within --timeout-body"},
    413: {"model": ErrorResponse, "description": "The body is larger than --max-request-body-bytes"},
    503: {"model": ErrorResponse, "description": "Waiting queue full (see Retry-After), engine dead, or "
                                                 "the shutdown grace period ran out"},
}


def _streamed(chunk: type) -> dict:
    """The 200 response of a route with ``stream: true``: an event stream whose schema (in
    OpenAPI 3.1, the schema of one event) says each event's data is a ``chunk``, an error
    (a failure after the stream started) or the closing ``[DONE]``."""
    data = {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
            {"$ref": f"#/components/schemas/{chunk.__name__}"}, {"$ref": "#/components/schemas/ErrorResponse"}]}},
    ]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data},
             "description": f"with stream: true, server-sent events 'data: <{chunk.__name__} JSON>' ending in "
                            "'data: [DONE]'; a failure after the stream started is one ErrorResponse event "
                            "before [DONE]"}
    return {200: {"content": {"text/event-stream": {"schema": event}}}}


def _fix_openapi(app: FastAPI, *models: type) -> None:
    """Make /openapi.json say what the server does: add ``models`` (referenced only from
    stream schemas) to the components, and drop FastAPI's 422 (every refusal is a 400)."""
    build = app.openapi

    def openapi() -> dict:
        schema = build()  # cached by FastAPI: the changes below are made once
        for operation in (op for path in schema.get("paths", {}).values() for op in path.values()):
            operation.get("responses", {}).pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        for model in models:
            body = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
            for name, sub in body.pop("$defs", {}).items():
                components.setdefault(name, sub)
            components.setdefault(model.__name__, body)
        return schema

    app.openapi = openapi


def served_model(args: ServerArgs, model_path: str) -> ServedModel:
    """The names and sampling defaults the server answers with.

    :raises ValueError: a bad --served-model-name or --generation-config (says which)
    """
    names = args.served_model_name or (default_served_name(model_path),)
    return ServedModel(names, load_generation_defaults(args.generation_config, model_path))


def _add_guards(app: FastAPI, args: ServerArgs, metrics: Metrics) -> None:
    """Middlewares, outermost last: Host check, then body limits, then the API key."""
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, on_refused=metrics.on_refused)
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_body_bytes, timeout=args.timeout_body,
                       on_refused=metrics.on_refused)
    hosts = args.allowed_hosts if args.allowed_hosts is not None else default_allowed_hosts(args.host)
    app.add_middleware(HostCheckMiddleware, allowed=hosts, on_refused=metrics.on_refused)


def build_app(engine: AsyncLLMEngine, args: ServerArgs, metrics: Metrics, served: ServedModel | None = None) -> FastAPI:
    """The ASGI app serving ``engine``. The app stops the engine when it shuts down."""
    grace = ShutdownGrace(args.shutdown_grace_period)
    served = served or ServedModel((metrics.model_name,))
    ctx = ServerContext(engine, served.primary, args.chat_template,
                        log_requests=not args.disable_log_requests, log_prompts=args.log_prompts,
                        max_prompt_chars=args.max_prompt_chars, grace=grace, served=served,
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        logger.info("serving %r on http://%s:%d (OpenAI API under /v1)", ctx.model_name, args.host, args.port)
        stats = None
        if not engine.info.disable_log_stats:
            stats = asyncio.ensure_future(_log_stats(engine, STATS_INTERVAL_S))
        yield
        if stats is not None:
            stats.cancel()
        logger.info("stopping the engine")
        await asyncio.to_thread(engine.shutdown, 30.0)

    # The interactive docs pages are open to anyone who can reach the port; with an API key
    # they are opt-in. /openapi.json (the API's description, no data) stays available.
    docs = not args.api_key or args.enable_docs
    app = FastAPI(title="core: OpenAI-compatible API", version=__version__, lifespan=lifespan,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None)
    app.state.grace = grace
    install_error_handlers(app, on_error=metrics.on_refused)
    _add_guards(app, args, metrics)
    _add_api_routes(app, ctx, started=int(time.time()))
    _add_token_routes(app, ctx)
    _add_embedding_route(app, ctx, args)
    _fix_openapi(app, ChatCompletionChunk, ErrorResponse)
    _add_ops_routes(app, engine, metrics)
    return app


def _add_api_routes(app: FastAPI, ctx: ServerContext, started: int) -> None:
    """The OpenAI routes under /v1."""

    def card(name: str) -> ModelCard:
        # root is the model's file or directory *name*: the full path tells a client about
        # the server's file system and nothing it needs.
        return ModelCard(id=name, created=started, root=Path(ctx.model_root).name,
                         max_model_len=ctx.max_model_len)

    @app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
    async def list_models() -> ModelList:
        return ModelList(data=[card(n) for n in ctx.served.names])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses={401: _ERRORS[401], 404: _ERRORS[404]})
    async def get_model(model: str) -> ModelCard:
        ctx.check_model(model)
        return card(model)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**_ERRORS, **_streamed(CompletionResponse)})
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        """OpenAI completions; with ``stream: true`` a text/event-stream of chunks ending in ``[DONE]``."""
        return await create_completion(body, raw, ctx)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_ERRORS, **_streamed(ChatCompletionChunk)})
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        """OpenAI chat completions; with ``stream: true`` a text/event-stream of chunks ending in ``[DONE]``."""
        return await create_chat_completion(body, raw, ctx)


def _add_token_routes(app: FastAPI, ctx: ServerContext) -> None:
    """vLLM's /tokenize and /detokenize (not under /v1, as in vLLM; the API key guards them
    too: they run the tokenizer)."""
    errors = {k: _ERRORS[k] for k in (400, 401, 404)}

    @app.post("/tokenize", response_model=TokenizeResponse, responses=errors)
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        """Token ids of ``prompt``, or of ``messages`` rendered with the chat template."""
        return await tokenize(body, ctx)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=errors)
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        """The text of ``tokens``."""
        return await detokenize(body, ctx)


def _add_embedding_route(app: FastAPI, ctx: ServerContext, args: ServerArgs) -> None:
    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        """Pooled hidden states of each input (``--task embed``; ``--pooling-type`` last or mean)."""
        if args.task != "embed":
            raise bad_request("this server runs --task generate; start it with --task embed to serve "
                              "/v1/embeddings", code="embeddings_disabled")
        return await create_embedding(body, raw, ctx, args.pooling_type)


def _add_ops_routes(app: FastAPI, engine: AsyncLLMEngine, metrics: Metrics) -> None:
    """Health, metrics and version: open even with --api-key (for load balancers and Prometheus)."""

    @app.get("/health", responses={503: {"model": ErrorResponse, "description": "The engine is dead"}})
    async def health() -> Response:
        """200 while the engine loop runs; 503 once it died (restart the server)."""
        try:
            await asyncio.to_thread(engine.check_health)
        except EngineDeadError as e:
            return OpenAIError(503, str(e), code="engine_dead").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        """Prometheus text exposition; see docs/serving.md for every metric."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}


STATS_INTERVAL_S = 10.0


async def _log_stats(engine: AsyncLLMEngine, interval: float) -> None:
    """Every ``interval`` seconds while there is work: throughput and queue state."""
    last = engine.snapshot
    while True:
        await asyncio.sleep(interval)
        snap, s = engine.snapshot, engine.snapshot.scheduler
        prompt = snap.prompt_tokens - last.prompt_tokens
        gen = snap.generation_tokens - last.generation_tokens
        if s is not None and (prompt or gen or s.num_running or s.num_waiting):
            logger.info("prompt %.1f tok/s, generation %.1f tok/s; running %d, waiting %d, swapped %d; "
                        "KV cache %.1f%%; prefix cache hit rate %.1f%%", prompt / interval, gen / interval,
                        s.num_running, s.num_waiting, s.num_swapped, 100 * s.kv_cache_usage,
                        100 * s.prefix_cache_hit_rate)
        last = snap


def run_server(ns: argparse.Namespace) -> int:
    """``core serve``: load the engine, serve until SIGTERM/SIGINT, return the exit code."""
    args = ServerArgs.from_cli_args(ns)
    metrics: Metrics | None = None

    def on_finished(out) -> None:  # metrics exists once the engine is up and named
        if metrics is not None:
            metrics.on_finished(out)

    def on_outputs(outs) -> None:
        if metrics is not None:
            metrics.on_outputs(outs)

    # A SIGTERM while the model loads must stop the engine-core child too, not orphan it:
    # it unwinds as SystemExit (a second one kills at once), and AsyncLLMEngine stops the child.
    previous = signal.getsignal(signal.SIGTERM)
    exit_on_sigterm()
    try:
        async_engine = AsyncLLMEngine(EngineArgs.from_cli_args(ns), on_finished=on_finished, on_outputs=on_outputs)
    except EngineStartupError as e:
        logger.error("%s", e)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:  # from here every way out stops the engine core
        try:
            served = served_model(args, async_engine.info.model)
        except ValueError as e:
            logger.error("%s", e)
            return 1
        metrics = Metrics(served.primary, lambda: async_engine.snapshot)
        app = build_app(async_engine, args, metrics, served)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_config=None,  # keep the process's logging setup (core's format and level)
            log_level=args.uvicorn_log_level,
            access_log=args.uvicorn_log_level in ("info", "debug", "trace"),
            # ShutdownGrace ends open requests at the grace period; uvicorn's cancel is a backstop.
            timeout_graceful_shutdown=args.shutdown_grace_period + BACKSTOP_S,
            http=protocol_with_header_timeout(args.timeout_header),
            timeout_keep_alive=args.timeout_keep_alive,
            h11_max_incomplete_event_size=args.max_header_bytes,
        )
        server = _Server(config, app.state.grace)
        # uvicorn re-raises the signal it shut down for once it is done; with this handler in
        # place that re-raise is a no-op, so a SIGTERM shutdown ends with exit code 0.
        previous = signal.signal(signal.SIGTERM, _log_terminated)
        freeze_startup_heap()  # this process is core's own (`core serve`)
        try:
            server.run()
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        async_engine.shutdown(30.0)  # idempotent; also after the engine core died
    if not server.started:
        logger.error("the server did not start (is port %d on %s free?)", args.port, args.host)
        return 1
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server, starting the grace countdown when the exit signal arrives."""

    def __init__(self, config, grace: ShutdownGrace):
        super().__init__(config)
        self._grace = grace

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        try:
            self._grace.begin(asyncio.get_running_loop())
        except RuntimeError:  # no loop yet (a signal during start-up): nothing is open
            pass


def _log_terminated(signum: int, frame) -> None:
    logger.info("shut down after signal %d", signum)
