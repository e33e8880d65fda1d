"""Command-line flags of ``core serve`` and the frozen settings they become."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from core.engine_args import EngineArgs


@dataclass(frozen=True)
class ServerArgs:
    """HTTP-side settings (the engine's are :class:`~core.engine_args.EngineArgs`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    """When set, /v1/* requires ``Authorization: Bearer <key>``; /health and /metrics stay open."""
    served_model_name: str | None = None
    """The name clients pass as ``model``; None = the model file or directory name."""
    chat_template: str | None = None
    """A Jinja chat template (text) replacing the tokenizer's."""
    shutdown_grace_period: float = 30.0
    """Seconds in-flight requests get to finish after SIGTERM before they are cancelled."""
    disable_log_requests: bool = False
    log_prompts: bool = False
    uvicorn_log_level: str = "warning"

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        return cls(
            host=ns.host,
            port=ns.port,
            api_key=ns.api_key,
            served_model_name=ns.served_model_name,
            chat_template=read_chat_template(ns.chat_template),
            shutdown_grace_period=ns.shutdown_grace_period,
            disable_log_requests=ns.disable_log_requests,
            log_prompts=getattr(ns, "log_prompts", False),
            uvicorn_log_level=ns.uvicorn_log_level,
        )


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
                   help="require 'Authorization: Bearer KEY' on /v1/* (/health and /metrics stay open)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients send (default: the model's file or directory name)")
    g.add_argument("--chat-template", default=None, help="Jinja chat template: a file path or the template text")
    g.add_argument("--shutdown-grace-period", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    g.add_argument("--disable-log-requests", action="store_true", help="do not log each request at INFO")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of the HTTP layer (info and below also log each access)")
    EngineArgs.add_cli_args(parser)
