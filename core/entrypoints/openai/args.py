"""Command-line flags of ``core serve`` and the frozen settings they become."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from core.entrypoints.engine_flags import add_engine_flags
from core.entrypoints.openai.generation_config import FILE_NAME, OFF
from core.entrypoints.openai.served import ServedModel
from core.pooling import POOLING_TYPES

TASKS = ("generate", "embed")


@dataclass(frozen=True)
class ServerArgs:
    """HTTP-side settings (the engine's are :class:`~core.engine_args.EngineArgs`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    """When set, /v1/* requires ``Authorization: Bearer <key>``; /health and /metrics stay open."""
    served_model_name: tuple[str, ...] | None = None
    """The names clients may pass as ``model`` (the first answers in responses and labels
    metrics); None = the model file or directory name."""
    task: str = "generate"
    """'generate' (completions and chat) or 'embed' (also /v1/embeddings)."""
    pooling_type: str = "last"
    """With --task embed: 'last' (the last prompt token's hidden state) or 'mean'."""
    generation_config: str = "auto"
    """Sampling defaults: 'auto' (the model's generation_config.json), 'vllm'/'none' (off),
    or a folder holding a generation_config.json (see generation_config.py)."""
    chat_template: str | None = None
    """A Jinja chat template (text) replacing the tokenizer's."""
    shutdown_grace_period: float = 30.0
    """Seconds in-flight requests get to finish after SIGTERM; then each open stream gets a
    final error event and ``[DONE]``, and each waiting non-streamed request a 503."""
    disable_log_requests: bool = False
    log_prompts: bool = False
    uvicorn_log_level: str = "warning"
    # ---- limits (every one refuses with an error naming it; see docs/serving.md) ----
    max_request_body_bytes: int = 8 * 1024 * 1024
    """Larger bodies get 413 (before they are read when Content-Length says so)."""
    max_prompt_chars: int | None = None
    """Longest text prompt (characters, all prompts / messages of a request together) taken
    to the tokenizer; None = 16 x max_model_len. Longer ones get 400 before tokenization."""
    timeout_keep_alive: float = 5.0
    """Seconds an idle keep-alive connection stays open after a response."""
    timeout_header: float = 30.0
    """Seconds a connection has to send a complete request head (new, or after a response)."""
    timeout_body: float = 60.0
    """Seconds a request has to send its whole body once the head arrived (then 408)."""
    max_header_bytes: int = 64 * 1024
    """Largest request head (request line and headers) h11 buffers; bigger ones get 400."""
    # ---- exposure ----
    allowed_hosts: tuple[str, ...] | None = None
    """Host header values answered; None = loopback names for a loopback bind, else any."""
    enable_docs: bool = False
    """Serve /docs and /redoc even with an API key (they are always on without one)."""
    # ---- structured output, tools, reasoning (docs/structured_output.md) ----
    tool_call_parser: str | None = None
    """Parser of the model's tool-call markup for ``tool_choice: auto``; None = guessed from
    the chat template."""
    reasoning_parser: str | None = None
    """Splits ``<think>`` reasoning into ``reasoning_content``; None = off."""

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_header_bytes", "port"):
            _require(name, getattr(self, name), 1 if name != "port" else 0, "an integer")
        _require("max_prompt_chars", self.max_prompt_chars, 1, "an integer", optional=True)
        for name in ("timeout_keep_alive", "timeout_header", "timeout_body"):
            _require(name, getattr(self, name), 0.001, "a number of seconds", real=True)
        _require("shutdown_grace_period", self.shutdown_grace_period, 0, "a number of seconds", real=True)
        if self.task not in TASKS:
            raise ValueError(f"--task {self.task!r} is invalid: must be one of {list(TASKS)}")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"--pooling-type {self.pooling_type!r} is invalid: must be one of {list(POOLING_TYPES)}")
        if self.served_model_name is not None:
            ServedModel(self.served_model_name)  # refuses empty or repeated names before the model loads
        if self.generation_config not in ("auto", *OFF) and not (Path(self.generation_config) / FILE_NAME).is_file():
            raise ValueError(f"--generation-config {self.generation_config!r}: no {FILE_NAME} in that folder; "
                             "name a folder that holds one, or pass 'auto' (the model's own) or 'vllm' (none)")
        if self.allowed_hosts is not None and not any(h.strip() for h in self.allowed_hosts):
            raise ValueError("--allowed-hosts is empty; name at least one host, or '*' for any")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        return cls(
            host=ns.host,
            port=ns.port,
            api_key=ns.api_key,
            served_model_name=tuple(ns.served_model_name) if ns.served_model_name else None,
            generation_config=getattr(ns, "generation_config", "auto"),
            task=getattr(ns, "task", "generate"),
            pooling_type=getattr(ns, "pooling_type", "last"),
            chat_template=read_chat_template(ns.chat_template),
            shutdown_grace_period=ns.shutdown_grace_period,
            disable_log_requests=ns.disable_log_requests,
            log_prompts=getattr(ns, "log_prompts", False),
            uvicorn_log_level=ns.uvicorn_log_level,
            max_request_body_bytes=ns.max_request_body_bytes,
            max_prompt_chars=ns.max_prompt_chars,
            timeout_keep_alive=ns.timeout_keep_alive,
            timeout_header=ns.timeout_header,
            timeout_body=ns.timeout_body,
            max_header_bytes=ns.max_header_bytes,
            allowed_hosts=_hosts(ns.allowed_hosts),
            enable_docs=ns.enable_docs,
            tool_call_parser=getattr(ns, "tool_call_parser", None),
            reasoning_parser=getattr(ns, "reasoning_parser", None),
        )


def _add_structured_args(parser: argparse.ArgumentParser) -> None:
    from core.entrypoints.openai.reasoning import REASONING_PARSERS
    from core.entrypoints.openai.tool_parsers import TOOL_PARSERS

    g = parser.add_argument_group("tools and reasoning")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="format of the model's tool calls, for tool_choice 'auto' (default: guessed from the "
                        "chat template; 'required' and named functions need none)")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="return the model's <think> block as reasoning_content (qwen3: the model writes the "
                        "tags; deepseek_r1: the prompt opens the block)")


def _require(name: str, value, low: float, kind: str, real: bool = False, optional: bool = False) -> None:
    """``value`` must be an int (a real when ``real``) >= ``low``; the error names the flag."""
    if optional and value is None:
        return
    flag = "--" + name.replace("_", "-")
    ok_type = isinstance(value, (int, float) if real else int) and not isinstance(value, bool)
    if not ok_type or value < low or (real and value != value):
        raise ValueError(f"{flag} {value!r} is invalid: must be {kind} >= {low:g}")


def _hosts(value: str | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(h.strip() for h in value.split(","))


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template`` takes a file path or the template text itself."""
    if value is None:
        return None
    if os.path.sep in value or value.endswith((".jinja", ".j2", ".txt")):
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"--chat-template {value!r} looks like a path but no such file exists")
        return path.read_text()
    return value


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Add the HTTP flags and the engine flags to ``parser``."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on (checked before the model loads)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
                        "(/health and /metrics stay open)")
    g.add_argument("--served-model-name", default=None, nargs="+", action="extend", metavar="NAME",
                   help="model name(s) clients may send; all are listed in /v1/models, the first answers "
                        "in responses and labels metrics; repeating the flag adds names (default: the "
                        "model's file or directory name)")
    g.add_argument("--task", default="generate", choices=list(TASKS),
                   help="'embed' also serves /v1/embeddings (pooled hidden states of a decoder model)")
    g.add_argument("--pooling-type", default="last", choices=list(POOLING_TYPES),
                   help="with --task embed: 'last' = the last prompt token's hidden state (e5-mistral, "
                        "gte-Qwen style), 'mean' = the average over the prompt")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults for requests that leave them out: 'auto' = the model's "
                        "generation_config.json (as vLLM), 'vllm' or 'none' = off, or a folder holding a "
                        "generation_config.json")
    g.add_argument("--chat-template", default=None, help="Jinja chat template: a file path or the template text")
    g.add_argument("--shutdown-grace-period", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    g.add_argument("--disable-log-requests", action="store_true", help="do not log each request at INFO")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of the HTTP layer (info and below also log each access)")
    g.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host header values to answer ('*' = any, '*.example.com'); "
                        "default: localhost, 127.0.0.1, [::1] for a loopback --host (DNS-rebinding "
                        "defence), any otherwise")
    g.add_argument("--enable-docs", action="store_true", help="serve /docs and /redoc even with --api-key")
    _add_structured_args(parser)
    lim = parser.add_argument_group("limits")
    lim.add_argument("--max-request-body-bytes", type=int, default=ServerArgs.max_request_body_bytes,
                     help="largest request body in bytes; bigger ones get 413 (default 8 MiB)")
    lim.add_argument("--max-prompt-chars", type=int, default=None,
                     help="longest text prompt in characters, checked before tokenization "
                          "(default: 16 x max_model_len)")
    lim.add_argument("--timeout-keep-alive", type=float, default=ServerArgs.timeout_keep_alive,
                     help="seconds an idle keep-alive connection is kept after a response")
    lim.add_argument("--timeout-header", type=float, default=ServerArgs.timeout_header,
                     help="seconds a connection has to send its request line and headers")
    lim.add_argument("--timeout-body", type=float, default=ServerArgs.timeout_body,
                     help="seconds a request has to send its body once the headers arrived (then 408)")
    lim.add_argument("--max-header-bytes", type=int, default=ServerArgs.max_header_bytes,
                     help="largest request line plus headers in bytes")
    add_engine_flags(parser)
