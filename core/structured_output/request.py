"""The request fields that ask for structured output, mapped to one :class:`GrammarSpec`.

OpenAI's ``response_format``, vLLM's ``structured_outputs`` and its older ``guided_*`` fields,
and a forcing ``tool_choice`` all say the same thing in different words; a request may use
one of them. Everything is checked here, in the API process, so that a client hears about a
malformed or conflicting request as a 400 naming the field, never as output that quietly
ignored it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.entrypoints.openai.tool_parsers.forced import tool_choice_schema
from core.structured_output.spec import GrammarError, GrammarSpec

_SO_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_BACKENDS = (None, "auto", "guidance", "llguidance")


def _response_format(value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.of("json_object", field="response_format")
    if kind == "json_schema":
        body = value.get("json_schema")
        if not isinstance(body, Mapping) or "schema" not in body:
            raise GrammarError("response_format.json_schema.schema is required for type 'json_schema'")
        return GrammarSpec.of(
            "json_schema", body["schema"], strict=bool(body.get("strict", False)),
            field="response_format.json_schema.schema",
        )
    raise GrammarError(
        f"response_format.type {kind!r} is not one of 'text', 'json_object', 'json_schema'"
    )


def _structured_outputs(value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise GrammarError(f"structured_outputs must be an object, got {type(value).__name__}")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(_SO_KINDS) - {"json_object"})
    if unknown:
        raise GrammarError(
            f"structured_outputs.{unknown[0]} is not supported; use one of "
            f"{sorted([*_SO_KINDS, 'json_object'])}"
        )
    if len(given) > 1:
        raise GrammarError(f"structured_outputs sets {sorted(given)}; set exactly one")
    if not given:
        return None
    (key, spec), = given.items()
    if key == "json_object":
        return GrammarSpec.of("json_object", field="structured_outputs.json_object")
    return GrammarSpec.of(_SO_KINDS[key], spec, field=f"structured_outputs.{key}")


def _guided(fields: Mapping[str, Any]) -> list[tuple[str, GrammarSpec]]:
    backend = fields.get("guided_decoding_backend")
    if backend not in _BACKENDS:
        raise GrammarError(
            f"guided_decoding_backend {backend!r} is not available; this server uses llguidance "
            f"(omit the field, or pass 'auto')"
        )
    if fields.get("guided_whitespace_pattern") is not None:
        raise GrammarError("guided_whitespace_pattern is not supported: JSON is generated with ', ' and ': ' separators")
    return [
        (name, GrammarSpec.of(kind, fields[name], field=name))
        for name, kind in _GUIDED.items()
        if fields.get(name) is not None
    ]


def spec_from_request(fields: Mapping[str, Any]) -> GrammarSpec | None:
    """The grammar a request's fields ask for, or None for unconstrained output.

    :param fields: the request body (or the model's fields as a dict).
    :raises GrammarError: a malformed field, or two fields that both constrain the output,
        named in the message.
    """
    found: list[tuple[str, GrammarSpec]] = []
    for name, parse in (("response_format", _response_format), ("structured_outputs", _structured_outputs)):
        spec = parse(fields.get(name))
        if spec is not None:
            found.append((name, spec))
    found += _guided(fields)
    try:
        schema = tool_choice_schema(fields.get("tools"), fields.get("tool_choice"))
    except ValueError as e:
        raise GrammarError(str(e)) from None
    if schema is not None:
        # Closed objects: a forced call carries the declared arguments only (OpenAI's strict
        # function calling), and a walk cannot wander into invented keys until max_tokens.
        found.append(("tool_choice", GrammarSpec.of("json_schema", schema, strict=True, field="tools")))
    if len(found) > 1:
        raise GrammarError(
            f"{found[0][0]} and {found[1][0]} both constrain the output; send only one of them"
        )
    return found[0][1] if found else None
