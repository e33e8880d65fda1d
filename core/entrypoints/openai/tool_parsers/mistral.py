"""Mistral tool calls (``--tool-call-parser mistral``), in both of its tokenizers' forms::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (v3 and older)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}    (v11 and newer)

``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens: the front end must detokenize with
special tokens kept. Text before the first ``[TOOL_CALLS]`` is content; so is text after the
calls, and a ``[TOOL_CALLS]`` that is followed by neither form. A ``[CALL_ID]id`` between
name and ``[ARGS]`` (newer templates) is skipped: the server issues its own ids, 9 letters
or digits as Mistral's templates require.
"""

from __future__ import annotations

from core.entrypoints.openai.tool_parsers.base import (
    CallEmitter,
    DeltaMessage,
    ToolParser,
    held_prefix,
    random_mistral_id,
)
from core.entrypoints.openai.tool_parsers.json_scan import CallObjectScan

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_WRAP = '{"arguments":'  # the [ARGS] value is scanned as the value of this synthetic object


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def __init__(self, id_factory=None):
        super().__init__(id_factory or random_mistral_id)
        self._mode = "text"
        self._body = ""
        self._scan = CallObjectScan()
        self._call: CallEmitter | None = None

    def _consume(self, final: bool) -> list[DeltaMessage]:
        steps = {
            "text": self._outside, "tag": self._after_tag, "array": self._array,
            "object": self._object, "name": self._name, "args": self._args,
            "after_args": self._after_args,
        }
        out: list[DeltaMessage] = []
        while True:  # until a pass changes nothing
            before = (self._mode, len(self._pending), len(self._body))
            out += steps.get(self._mode, self._rest)(final)
            if (self._mode, len(self._pending), len(self._body)) == before:
                return out

    def _outside(self, final: bool) -> list[DeltaMessage]:
        text = self._pending
        at = text.find(TOOL_CALLS)
        if at >= 0:
            self._pending, self._mode = text[at + len(TOOL_CALLS):], "tag"
            return self._text(text[:at])
        keep = 0 if final else held_prefix(text, TOOL_CALLS)
        self._pending = text[len(text) - keep:] if keep else ""
        return self._text(text[: len(text) - keep])

    def _after_tag(self, final: bool) -> list[DeltaMessage]:
        rest = self._pending.lstrip()
        if not rest:
            if final:  # a bare tag at the end: keep it visible as content
                self._pending, self._mode = TOOL_CALLS + self._pending, "rest"
            return []
        if rest.startswith("["):
            self._pending, self._mode = rest[1:], "array"
        else:
            self._pending, self._mode, self._body = rest, "name", ""
        return []

    def _array(self, final: bool) -> list[DeltaMessage]:
        rest = self._pending.lstrip(" \t\r\n,")
        if not rest:
            self._pending = ""
            return []
        if rest.startswith("]"):
            self._pending, self._mode = rest[1:], "rest"
        elif rest.startswith("{"):
            self._pending, self._mode, self._body = rest, "object", ""
            self._scan, self._call = CallObjectScan(), self._new_call()
        else:
            self._pending, self._mode = rest, "rest"
        return []

    def _object(self, final: bool) -> list[DeltaMessage]:
        self._body += self._pending
        self._pending = ""
        scan, call = self._scan, self._call
        scan.advance(self._body)
        over = final or scan.done or scan.error is not None
        deltas = call.progress(scan, self._body, final=over and scan.error is None)
        out = [DeltaMessage(tool_calls=deltas)] if deltas else []
        if over:
            ok = call.started and scan.done
            self._drop_uncommitted(call)
            self._pending = self._body[scan.end:] if ok else self._body[0 if not call.started else scan.pos:]
            self._mode, self._body, self._call = ("array" if ok else "rest"), "", None
        return out

    def _name(self, final: bool) -> list[DeltaMessage]:
        self._body += self._pending
        self._pending = ""
        text = self._body
        cut = min((i for i in (text.find(ARGS), text.find(CALL_ID)) if i >= 0), default=-1)
        if cut < 0 or text.find(ARGS) < 0:
            if final:  # never reached [ARGS]: the tag and the text are content
                self._pending, self._mode, self._body = TOOL_CALLS + text, "rest", ""
            return []
        name = text[:cut].strip()
        self._scan, self._call = CallObjectScan(), self._new_call()
        self._scan.name = name  # the name came before [ARGS], outside any JSON
        self._pending = text[text.find(ARGS) + len(ARGS):]
        self._mode, self._body = "args", _WRAP
        return []

    def _args(self, final: bool) -> list[DeltaMessage]:
        self._body += self._pending
        self._pending = ""
        scan, call = self._scan, self._call
        scan.advance(self._body)
        ended = scan.args_end is not None  # the value closed; the synthetic object never does
        over = final or ended or scan.error is not None
        deltas = call.progress(scan, self._body, final=over and scan.error is None)
        out = [DeltaMessage(tool_calls=deltas)] if deltas else []
        if over:
            self._pending = self._body[scan.args_end if ended else scan.pos:]
            self._mode, self._body, self._call = ("after_args" if ended else "rest"), "", None
        return out

    def _after_args(self, final: bool) -> list[DeltaMessage]:
        rest = self._pending.lstrip()
        if rest.startswith(TOOL_CALLS):
            self._pending, self._mode = rest[len(TOOL_CALLS):], "tag"
        elif rest and not (TOOL_CALLS.startswith(rest) and not final):
            self._pending, self._mode = rest, "rest"
        elif final:
            self._pending, self._mode = rest, "rest"
        return []

    def _rest(self, final: bool) -> list[DeltaMessage]:
        text, self._pending = self._pending, ""
        return self._text(text)
