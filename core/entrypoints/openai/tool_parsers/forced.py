"""``tool_choice: "required"`` and a named function: the JSON schema the grammar enforces, and
the parsers for the output it forces.

Under a forced choice the model does not write its native tool-call markup: the grammar makes
it write JSON directly (vLLM does the same), so these outputs are parsed here, not by the
``--tool-call-parser``:

* a named function: the output *is* the arguments object (the schema is its ``parameters``);
* ``required``: the output is ``[{"name": ..., "parameters": {...}}, ...]`` with at least one
  item, each item one of the request's tools.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.entrypoints.openai.tool_parsers.base import (
    CallEmitter,
    DeltaMessage,
    ToolCall,
    ToolParser,
    random_call_id,
)
from core.entrypoints.openai.tool_parsers.json_scan import CallObjectScan
from core.entrypoints.openai.tool_parsers.mistral import TOOL_CALLS, MistralToolParser

_NO_PARAMETERS = {"type": "object", "properties": {}}


def _functions(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """name -> function definition, checking the shape OpenAI documents."""
    out = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise ValueError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}; got {tool!r}"
            )
        out[fn["name"]] = fn
    return out


def named_function(tool_choice: Any) -> str | None:
    """The function a ``tool_choice`` names, or None for ``"auto"`` / ``"none"`` / ``"required"``."""
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(
                f"tool_choice {tool_choice!r} must be 'auto', 'none', 'required' or "
                f"{{'type': 'function', 'function': {{'name': NAME}}}}"
            )
        return fn["name"]
    if tool_choice not in (None, "auto", "none", "required"):
        raise ValueError(f"tool_choice {tool_choice!r} must be 'auto', 'none', 'required' or a named function")
    return None


def tool_choice_schema(tools: list[dict[str, Any]] | None, tool_choice: Any) -> dict[str, Any] | None:
    """The JSON schema to hand to the grammar compiler for ``tool_choice``; None when the
    choice forces nothing (``auto``, ``none``, absent).

    :raises ValueError: ``required`` without tools, or a named function not among the tools.
    """
    functions = _functions(tools)
    name = named_function(tool_choice)
    if name is not None:
        if name not in functions:
            raise ValueError(
                f"tool_choice names function {name!r}, which is not in tools "
                f"(tools define {sorted(functions) or 'nothing'})"
            )
        return functions[name].get("parameters") or _NO_PARAMETERS
    if tool_choice != "required":
        return None
    if not functions:
        raise ValueError("tool_choice 'required' needs at least one entry in tools")
    items = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [n]}, "parameters": fn.get("parameters") or _NO_PARAMETERS},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for n, fn in functions.items()
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": items}}


class NamedToolParser(ToolParser):
    """Output forced to be the arguments of one named function: one call, streamed."""

    name = "named"

    def __init__(self, function_name: str, id_factory: Callable[[], str] | None = None):
        super().__init__(id_factory)
        self._scan = CallObjectScan()
        self._scan.name = function_name
        self._body = '{"arguments":'  # scan the output as this synthetic object's value
        self._call: CallEmitter | None = None

    def _consume(self, final: bool) -> list[DeltaMessage]:
        if self._call is None:
            self._call = self._new_call()
        self._body += self._pending
        self._pending = ""
        self._scan.advance(self._body)
        over = final or self._scan.args_end is not None
        deltas = self._call.progress(self._scan, self._body, final=over)
        return [DeltaMessage(tool_calls=deltas)] if deltas else []


class RequiredToolParser:
    """Output forced to be ``[{"name": ..., "parameters": ...}, ...]``: the array form of the
    Mistral parser, without its leading tag, with OpenAI-style ids."""

    name = "required"

    def __init__(self, id_factory: Callable[[], str] | None = None):
        self._inner = MistralToolParser(id_factory or random_call_id)
        self._inner.feed(TOOL_CALLS)  # the forced array stands where Mistral's tag would

    def feed(self, delta: str) -> list[DeltaMessage]:
        return self._inner.feed(delta)

    def finish(self) -> list[DeltaMessage]:
        return self._inner.finish()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        pieces = self._inner.feed(text) + self._inner.finish()
        content = "".join(p.content for p in pieces if p.content)
        return content or None, [c.tool_call() for c in self._inner._calls if c.started]


def forced_tool_parser(tool_choice: Any, id_factory: Callable[[], str] | None = None):
    """The parser for a forcing ``tool_choice``, or None when the native parser applies."""
    name = named_function(tool_choice)
    if name is not None:
        return NamedToolParser(name, id_factory)
    return RequiredToolParser(id_factory) if tool_choice == "required" else None
