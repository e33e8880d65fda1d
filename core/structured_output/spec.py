"""What a request asks the output to match, checked and turned into an llguidance grammar.

A :class:`GrammarSpec` is the cache key: ``kind`` plus the spec's canonical text (and the
``strict`` flag for schemas). ``field`` names the request field the spec came from, so an
error can point at it; it is not part of the key.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
"""``json_object`` (any JSON object), ``json_schema`` (a JSON Schema), ``regex``, ``choice``
(one of a list of strings), ``grammar`` (Lark, or llama.cpp GBNF / EBNF, which llguidance
converts to Lark)."""

COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON layout the grammar allows: ``json.dumps``'s separators and no free whitespace. Free
whitespace lets a model (or a random walk) emit newlines forever inside an object."""


class GrammarError(ValueError):
    """A spec the grammar library refuses; the message names the request field."""


@dataclass(frozen=True)
class GrammarSpec:
    """One structured-output request, hashable (see the module docstring).

    :param kind: one of :data:`KINDS`.
    :param text: the spec as text: the schema as JSON (``json_schema``), the pattern, the
        choices as a JSON list, the grammar; empty for ``json_object``.
    :param strict: ``json_schema`` only: object schemas without ``additionalProperties``
        are closed (OpenAI's ``strict: true``); False keeps JSON Schema's open default.
    :param field: the request field, for error messages (not part of the cache key).
    """

    kind: str
    text: str = ""
    strict: bool = True
    field: str = field(default="", compare=False)

    @staticmethod
    def of(kind: str, spec: Any = None, *, strict: bool = True, field: str = "") -> GrammarSpec:
        """Build from a request value: a schema as a dict or JSON text, a pattern, a list of
        choices, a grammar text.

        :raises GrammarError: an unknown kind or a value of the wrong type or shape.
        """
        where = field or kind
        if kind not in KINDS:
            raise GrammarError(f"{where}: unknown structured-output kind {kind!r}; expected one of {list(KINDS)}")
        if kind == "json_object":
            return GrammarSpec(kind, "", True, field)
        if kind == "json_schema":
            return GrammarSpec(kind, _schema_text(spec, where), bool(strict), field)
        if kind == "choice":
            if not isinstance(spec, list | tuple) or not spec or not all(isinstance(c, str) for c in spec):
                raise GrammarError(f"{where}: choice must be a non-empty list of strings, got {spec!r}")
            return GrammarSpec(kind, json.dumps(list(spec)), True, field)
        if not isinstance(spec, str) or not spec:
            raise GrammarError(f"{where}: {kind} must be a non-empty string, got {spec!r}")
        return GrammarSpec(kind, spec, True, field)

    def to_llguidance(self) -> str:
        """The llguidance grammar text (not yet validated against a tokenizer)."""
        from llguidance import LLMatcher, grammar_from

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=COMPACT_JSON)
        if self.kind == "json_schema":
            schema = json.loads(self.text)
            if self.strict:
                schema = close_objects(schema)
            return LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT_JSON)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.text)
        try:
            return grammar_from("choice" if self.kind == "choice" else "grammar", self.text)
        except ValueError as e:  # GBNF that does not convert to Lark
            raise GrammarError(f"{self.field or self.kind}: {e}") from None


def _schema_text(spec: Any, where: str) -> str:
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise GrammarError(f"{where}: the schema is not valid JSON ({e})") from None
    if not isinstance(spec, dict):
        raise GrammarError(f"{where}: a JSON schema must be an object, got {type(spec).__name__}")
    return json.dumps(spec)  # key order kept: it is the order the properties are generated in


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema with ``properties`` and no
    ``additionalProperties`` gets ``additionalProperties: false``: strict mode's meaning (and
    what OpenAI's SDK sends for a pydantic model) in a form the grammar can enforce."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        if not isinstance(node, dict):
            continue
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())  # name -> schema: the map itself is no schema
            elif key not in ("enum", "const", "default", "examples"):
                stack.append(value)
    return schema


_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
