"""The JSON-schema suite for structured output: tests drive a grammar matcher through each
schema with random tokens and validate the result with ``jsonschema``; the library benchmark
(docs/benchmarks/structured_output_libs.py) compiles the same schemas.

Every string has a ``maxLength``, ``pattern``, ``enum`` or ``format`` and every array a
``maxItems``, so a random walk through the grammar ends in a bounded number of tokens.
"""

from __future__ import annotations

S = {"type": "string", "maxLength": 12}

SCHEMAS: dict[str, dict] = {
    "flat_required": {
        "type": "object",
        "properties": {"name": S, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "nick": S, "email": S},
        "required": ["id"],
        "additionalProperties": False,
    },
    "nested_object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": S, "address": {
                    "type": "object",
                    "properties": {"city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"],
                    "additionalProperties": False,
                }},
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "array_of_ints": {"type": "array", "items": {"type": "integer"}, "maxItems": 5},
    "array_bounds": {"type": "array", "items": S, "minItems": 2, "maxItems": 4},
    "array_of_objects": {
        "type": "array",
        "maxItems": 3,
        "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"],
            "additionalProperties": False,
        },
    },
    "string_enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    "mixed_enum": {"enum": ["auto", 1, 2.5, True, None]},
    "const": {
        "type": "object",
        "properties": {"kind": {"const": "event"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["kind", "n"],
        "additionalProperties": False,
    },
    "int_bounds": {
        "type": "object",
        "properties": {"score": {"type": "integer", "minimum": -50, "maximum": 150}},
        "required": ["score"],
        "additionalProperties": False,
    },
    "exclusive_bounds": {
        "type": "object",
        "properties": {"p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}},
        "required": ["p"],
        "additionalProperties": False,
    },
    "number_bounds": {
        "type": "object",
        "properties": {"temp": {"type": "number", "minimum": -40.5, "maximum": 60}},
        "required": ["temp"],
        "additionalProperties": False,
    },
    "pattern_phone": {"type": "string", "pattern": "^\\+[0-9]{2} [0-9]{3}-[0-9]{4}$"},
    "pattern_word": {
        "type": "object",
        "properties": {"slug": {"type": "string", "pattern": "^[a-z]+(-[a-z]+){0,2}$", "maxLength": 20}},
        "required": ["slug"],
        "additionalProperties": False,
    },
    "string_length": {"type": "string", "minLength": 3, "maxLength": 6},
    "boolean_and_null": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
        "required": ["ok", "note"],
        "additionalProperties": False,
    },
    "nullable": {
        "type": "object",
        "properties": {"middle": {"type": ["string", "null"], "maxLength": 8}},
        "required": ["middle"],
        "additionalProperties": False,
    },
    "any_of": {
        "anyOf": [
            {"type": "object", "properties": {"cat": S}, "required": ["cat"], "additionalProperties": False},
            {"type": "object", "properties": {"dog": {"type": "integer"}}, "required": ["dog"], "additionalProperties": False},
        ]
    },
    "defs_ref": {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "date_format": {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"}},
        "required": ["day"],
        "additionalProperties": False,
    },
    "nested_arrays": {
        "type": "array",
        "maxItems": 3,
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "tool_call_required": {
        "type": "array",
        "minItems": 1,
        "maxItems": 2,
        "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"enum": ["get_weather"]}, "parameters": {"type": "object", "properties": {"city": S}, "required": ["city"], "additionalProperties": False}}, "required": ["name", "parameters"], "additionalProperties": False},
            {"type": "object", "properties": {"name": {"enum": ["get_time"]}, "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}, "required": ["name", "parameters"], "additionalProperties": False},
        ]},
    },
    "pydantic_like": {
        "title": "Invoice",
        "type": "object",
        "properties": {
            "number": {"title": "Number", "type": "string", "pattern": "^INV-[0-9]{4}$"},
            "status": {"title": "Status", "enum": ["draft", "paid", "void"], "type": "string"},
            "lines": {"title": "Lines", "type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/Line"}},
            "total": {"title": "Total", "type": "number", "minimum": 0},
        },
        "required": ["number", "status", "lines", "total"],
        "additionalProperties": False,
        "$defs": {"Line": {"title": "Line", "type": "object", "properties": {"text": S, "amount": {"type": "integer", "minimum": 0, "maximum": 1000}}, "required": ["text", "amount"], "additionalProperties": False}},
    },
}


def bounded_numbers(schema: dict, limit: int = 10**6) -> dict:
    """A copy of ``schema`` whose integers and numbers without bounds get ``[-limit, limit]``.

    For runs through a real (random) model: the grammar allows numbers of any length, and a
    random model's greedy loop can write digits until ``max_tokens`` (an honest
    ``finish_reason: length``, but no JSON to validate). Random walks need no bounds."""
    import copy

    out = copy.deepcopy(schema)
    stack: list = [out]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        if node.get("type") in ("integer", "number") and "enum" not in node and "const" not in node:
            if "maximum" not in node and "exclusiveMaximum" not in node:
                node["maximum"] = limit
            if "minimum" not in node and "exclusiveMinimum" not in node:
                node["minimum"] = -limit
        for key, value in node.items():
            if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
                stack.extend(value.values())
            elif key not in ("enum", "const", "default", "examples"):
                stack.append(value)
    return out
