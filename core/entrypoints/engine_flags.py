"""The engine's command-line flags, derived from :class:`core.engine_args.EngineArgs`.

One source: a field's name, type and default and the docstring written below it in
``EngineArgs`` make its flag, so a flag cannot drift from the field it sets. The rules:

* ``max_num_seqs`` -> ``--max-num-seqs``; its type (``int``, ``float``, else a string the
  engine parses) and its default are the field's; ``CHOICES`` in core.engine_args gives
  the allowed values where there is a fixed set;
* a ``bool`` field that is off by default is an on switch (``--enforce-eager``); one that is
  on by default is an off switch, ``--no-`` plus the name without ``enable_``
  (``enable_prefix_caching`` -> ``--no-prefix-caching``); one whose default is None gets
  both (``--async-scheduling`` / ``--no-async-scheduling``; unset: the engine decides);
* the help text is the field's docstring (``core serve --help`` shows the default after it).

Used by ``core generate/chat/serve/bench`` (core.entrypoints.cli) and the OpenAI server's
parser (core.entrypoints.openai.args).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any

from core.engine_args import CHOICES, EngineArgs

ALIASES = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",), "quantization": ("-q",)}
"""Short spellings kept from earlier releases."""


@dataclass(frozen=True)
class EngineFlag:
    """One engine flag: what ``parser.add_argument(*options, **kwargs)`` is given."""

    field: str
    options: tuple[str, ...]
    kwargs: dict[str, Any]


def field_docs(cls: type) -> dict[str, str]:
    """The docstring below each field of a dataclass (the string literal that follows its
    annotated assignment), whitespace collapsed."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _value_type(hint: Any) -> type:
    """The Python type a flag's text becomes: int or float when the field is only that
    (besides None), bool for switches, else str (the engine parses e.g. sizes itself)."""
    parts = set(typing.get_args(hint)) - {type(None)} if isinstance(hint, types.UnionType) else {hint}
    return parts.pop() if len(parts) == 1 and parts <= {int, float, bool, str} else str


def _flag(f: dataclasses.Field, hint: Any, doc: str) -> EngineFlag:
    dashed = f.name.replace("_", "-")
    kind = _value_type(hint)
    if kind is bool:
        if f.default is None:  # three states: --name, --no-name, or unset (the engine decides)
            return EngineFlag(f.name, (f"--{dashed}",), dict(
                dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=doc))
        if f.default:  # on by default: the flag turns it off
            name = "--no-" + dashed.removeprefix("enable-")
            return EngineFlag(f.name, (name,), dict(dest=f.name, action="store_false", help=doc))
        return EngineFlag(f.name, (f"--{dashed}",), dict(dest=f.name, action="store_true", help=doc))
    kwargs: dict[str, Any] = dict(dest=f.name, default=f.default, help=doc)
    if kind in (int, float):
        kwargs["type"] = kind
    if f.name in CHOICES:
        kwargs["choices"] = list(CHOICES[f.name])
    return EngineFlag(f.name, (f"--{dashed}", *ALIASES.get(f.name, ())), kwargs)


@functools.cache
def engine_flags() -> tuple[EngineFlag, ...]:
    """Every EngineArgs field's flag, in field order.

    :raises TypeError: a field without a docstring (its flag would have no help).
    """
    docs = field_docs(EngineArgs)
    hints = typing.get_type_hints(EngineArgs)
    missing = [f.name for f in dataclasses.fields(EngineArgs) if not docs.get(f.name)]
    if missing:
        raise TypeError(
            f"EngineArgs fields {missing} have no docstring; write one below each field in "
            "core/engine_args.py: it is the flag's --help text"
        )
    return tuple(_flag(f, hints[f.name], docs[f.name]) for f in dataclasses.fields(EngineArgs))


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Add every engine flag to ``parser`` (an ``engine`` group)."""
    group = parser.add_argument_group("engine")
    for flag in engine_flags():
        group.add_argument(*flag.options, **flag.kwargs)
