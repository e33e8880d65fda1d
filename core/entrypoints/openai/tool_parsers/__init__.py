"""Tool-call parsers: model output text -> OpenAI ``tool_calls`` (whole, and streamed).

One module per output format, a registry by ``--tool-call-parser`` name, a best guess from a
chat template's text, and (``forced``) what ``tool_choice: required`` / a named function
hands to the grammar compiler. The server picks them per request in ``chat_output.py``
(docs/structured_output.md).
"""

from __future__ import annotations

from core.entrypoints.openai.tool_parsers.base import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    ToolParser,
)
from core.entrypoints.openai.tool_parsers.forced import (
    forced_tool_parser,
    named_function,
    tool_choice_schema,
)
from core.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from core.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from core.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}
"""``--tool-call-parser`` names (vLLM's names for the same formats)."""

# Markers each format's chat templates contain, most specific first: a Qwen template that
# mentions <tool_call> must not be taken for Llama because it also says "ipython".
_TEMPLATE_MARKERS = (
    ("[TOOL_CALLS]", "mistral"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
    ('"parameters": d', "llama3_json"),  # Llama 3.x: {"name": ..., "parameters": dict}
)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class for ``--tool-call-parser NAME``.

    :raises ValueError: for an unknown name, listing the known ones.
    """
    if name not in TOOL_PARSERS:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {sorted(TOOL_PARSERS)} for --tool-call-parser"
        )
    return TOOL_PARSERS[name]


def guess_tool_parser(chat_template: str | None) -> str | None:
    """The parser name a chat template's text points to, or None when it shows no known format
    (the server then asks for ``--tool-call-parser``)."""
    for marker, name in _TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return name
    return None


__all__ = [
    "TOOL_PARSERS",
    "DeltaFunctionCall",
    "DeltaMessage",
    "DeltaToolCall",
    "FunctionCall",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ToolCall",
    "ToolParser",
    "forced_tool_parser",
    "get_tool_parser",
    "guess_tool_parser",
    "named_function",
    "tool_choice_schema",
]
