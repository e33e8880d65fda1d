"""An incremental scanner for one tool-call JSON object, fed a growing text.

Streaming needs to know, before the object is complete, the function name (once its string
closes) and where the arguments value starts and how far it has come, so the argument text
can be sent as it arrives. ``json.loads`` only answers for a complete text, so this scans the
object's top level by hand: keys, and each value's extent (nested brackets and strings with
escapes), resuming where the previous call stopped. Values are not validated beyond their
extent; the name is decoded with ``json.loads`` once its string is complete.
"""

from __future__ import annotations

import json

_WS = " \t\r\n"


class CallObjectScan:
    """Scan state of one ``{"name": ..., "arguments": {...}}``-shaped object.

    :param name_keys: keys whose string value is the function name.
    :param args_keys: keys whose value is the arguments (an object, or a JSON string of one).

    After each :meth:`advance`: ``name`` (None until its string closes), ``args_start`` /
    ``args_end`` (offsets of the arguments value in the text; ``args_end`` None while it is
    still open), ``args_is_string``, ``done`` with ``end`` (offset after the closing brace)
    and ``error`` (a message when the text is not such an object; scanning stops there).
    """

    def __init__(self, name_keys=("name",), args_keys=("arguments", "parameters")):
        self.name_keys, self.args_keys = name_keys, args_keys
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.args_is_string = False
        self.done = False
        self.end: int | None = None
        self.error: str | None = None
        self.pos = 0
        self._state = "start"
        self._key_start = 0
        self._key = ""
        self._value_start = 0
        self._depth = 0
        self._in_string = False
        self._escape = False

    def advance(self, text: str) -> None:
        """Scan ``text`` (the previous text plus more) from where the last call stopped."""
        while self.pos < len(text) and not (self.done or self.error):
            self._char(text, text[self.pos])

    def _fail(self, what: str) -> None:
        self.error = f"{what} at offset {self.pos}"

    def _char(self, text: str, c: str) -> None:
        state = self._state
        if state == "value":
            self._value_char(text, c)
            return
        if state == "key":
            self._string_char(c)
            if not self._in_string:
                self._key = _decode(text[self._key_start : self.pos + 1])
                self._state = "colon"
            self.pos += 1
            return
        if c in _WS:
            self.pos += 1
            return
        if state == "start":
            self._expect(c, "{", "key_or_end", "expected '{'")
        elif state == "key_or_end":
            if c == "}":
                self._close()
            elif c == '"':
                self._key_start, self._in_string, self._state = self.pos, True, "key"
                self.pos += 1
            else:
                self._fail(f"expected a key, found {c!r}")
        elif state == "colon":
            self._expect(c, ":", "value_start", "expected ':'")
        elif state == "value_start":
            self._start_value(c)
        elif state == "after_value":
            if c == "}":
                self._close()
            else:
                self._expect(c, ",", "key_or_end", "expected ',' or '}'")

    def _expect(self, c: str, want: str, then: str, what: str) -> None:
        if c != want:
            self._fail(f"{what}, found {c!r}")
            return
        self._state = then
        self.pos += 1

    def _close(self) -> None:
        self.pos += 1
        self.done, self.end = True, self.pos

    def _string_char(self, c: str) -> None:
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == '"':
            self._in_string = False

    def _start_value(self, c: str) -> None:
        self._value_start, self._state, self._depth = self.pos, "value", 0
        if self._key in self.args_keys:
            self.args_start, self.args_is_string = self.pos, c == '"'
        if c in "{[":
            self._depth = 1
        elif c == '"':
            self._in_string = True
        elif c in ",}]":
            self._fail(f"expected a value, found {c!r}")
            return
        self.pos += 1

    def _value_char(self, text: str, c: str) -> None:
        if self._in_string:
            self._string_char(c)
            self.pos += 1
            if not self._in_string and self._depth == 0:
                self._end_value(text)
            return
        if self._depth == 0:  # a bare literal (number, true, false, null) ends at a delimiter
            if c in _WS or c in ",}":
                self._end_value(text)
            else:
                self.pos += 1
            return
        if c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
        self.pos += 1
        if self._depth == 0:
            self._end_value(text)

    def _end_value(self, text: str) -> None:
        raw = text[self._value_start : self.pos]
        if self._key in self.args_keys:
            self.args_end = self.pos
        elif self._key in self.name_keys and raw.startswith('"'):
            self.name = _decode(raw)
        self._state = "after_value"


def _decode(raw: str) -> str:
    """A complete JSON string literal as text; a bad escape keeps the raw text (the key or
    name then matches nothing, and the arguments are sent as written)."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw
