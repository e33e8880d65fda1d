"""Structured output: grammars that constrain sampling (JSON object / schema, regex, choice,
Lark or GBNF grammar), built on llguidance.

The engine builds one :class:`GrammarCompiler` per tokenizer, compiles each request's
:class:`GrammarSpec` off its loop (``submit`` returns a future), gives each sequence a
:class:`GrammarMatcher`, fills one bitmask row per constrained sequence each step
(:func:`fill_bitmasks`) and the sampler applies them with the platform's ``grammar_bitmask``
op (:func:`apply_bitmask_default`, or :func:`apply_bitmask_host` where the device cannot). The engine core's side is
:mod:`core.structured_output.engine`; docs/structured_output.md says how it is wired.
"""

from core.structured_output.bitmask import (
    allocate_bitmask,
    apply_bitmask,
    apply_bitmask_compiled,
    apply_bitmask_default,
    apply_bitmask_host,
    apply_bitmask_numpy,
    unpack_bitmask,
)
from core.structured_output.compiler import CompiledGrammar, GrammarCompiler
from core.structured_output.matcher import GrammarMatcher, fill_bitmasks
from core.structured_output.spec import KINDS, GrammarError, GrammarSpec, close_objects

__all__ = [
    "KINDS",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "GrammarSpec",
    "allocate_bitmask",
    "apply_bitmask",
    "apply_bitmask_compiled",
    "apply_bitmask_default",
    "apply_bitmask_host",
    "apply_bitmask_numpy",
    "close_objects",
    "fill_bitmasks",
    "unpack_bitmask",
]
