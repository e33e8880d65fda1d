"""Engine flags derived from EngineArgs (core/entrypoints/engine_flags.py): every field has
one flag in every parser that takes engine flags, its help is the field's docstring, the
defaults agree, and a value given on the command line reaches the field with its type."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from core.engine_args import CHOICES, EngineArgs
from core.entrypoints import cli
from core.entrypoints.engine_flags import engine_flags, field_docs
from core.entrypoints.openai.args import add_server_args

FIELDS = [f.name for f in dataclasses.fields(EngineArgs)]


def _parsers() -> dict[str, argparse.ArgumentParser]:
    top = cli.build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices
    server = argparse.ArgumentParser()
    add_server_args(server)
    return {"generate": sub["generate"], "chat": sub["chat"], "serve": sub["serve"], "server": server}


def _required(name: str) -> list[str]:
    return ["hello"] if name == "generate" else []


@pytest.mark.parametrize("name", ["generate", "chat", "serve", "server"])
def test_every_field_has_one_flag_with_its_docstring_as_help(name):
    parser = _parsers()[name]
    docs = field_docs(EngineArgs)
    by_dest: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        by_dest.setdefault(action.dest, []).append(action)
    for field in FIELDS:
        actions = [a for a in by_dest.get(field, []) if a.option_strings]
        assert len(actions) == 1, f"{name}: field {field} has flags {[a.option_strings for a in actions]}"
        assert actions[0].help == docs[field] and docs[field], field


@pytest.mark.parametrize("name", ["generate", "chat", "serve", "server"])
def test_no_flags_give_the_dataclass_defaults(name):
    ns = _parsers()[name].parse_args(_required(name))
    assert EngineArgs.from_cli_args(ns) == EngineArgs()


def _other_value(flag) -> tuple[list[str], object]:
    """A command line giving ``flag``'s field a value other than its default, and that value."""
    field = flag.field
    default = getattr(EngineArgs(), field)
    if flag.kwargs.get("action") in ("store_true", "store_false"):
        return [flag.options[0]], not default
    if flag.kwargs.get("action") is argparse.BooleanOptionalAction:  # default None: on and off
        return ["--no-" + flag.options[0].removeprefix("--")], False
    if field in CHOICES:
        value = next(c for c in CHOICES[field] if c != default)
        return [flag.options[0], value], value
    kind = flag.kwargs.get("type", str)
    value = {int: 3, float: 0.5, str: "4GiB" if field == "kv_cache_memory" else "x"}[kind]
    return [flag.options[0], str(value)], value


@pytest.mark.parametrize("flag", engine_flags(), ids=lambda f: f.field)
def test_a_value_on_the_command_line_reaches_its_field(flag):
    argv, value = _other_value(flag)
    ns = _parsers()["generate"].parse_args(["hello", *argv])
    args = EngineArgs.from_cli_args(ns)
    assert getattr(args, flag.field) == value and type(getattr(args, flag.field)) is type(value)
    others = {f: getattr(args, f) for f in FIELDS if f != flag.field}
    assert others == {f: getattr(EngineArgs(), f) for f in others}


def test_switch_names_follow_the_default():
    names = {f.field: f.options for f in engine_flags()}
    assert names["enable_prefix_caching"] == ("--no-prefix-caching",)
    assert names["enable_chunked_prefill"] == ("--no-chunked-prefill",)
    assert names["enforce_eager"] == ("--enforce-eager",)
    assert names["async_scheduling"] == ("--async-scheduling",)  # BooleanOptionalAction adds --no-
    assert names["tensor_parallel_size"] == ("--tensor-parallel-size", "-tp")


def test_field_docs_reads_the_docstring_below_each_field():
    @dataclasses.dataclass
    class Sample:
        documented: int = 1
        """says   what it is"""
        bare: int = 2

    assert field_docs(Sample) == {"documented": "says what it is"}
