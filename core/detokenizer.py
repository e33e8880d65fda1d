"""Incremental detokenization and stop-string matching for streamed output.

Invariant: the deltas returned by :meth:`IncrementalDetokenizer.add_tokens` followed by
:meth:`IncrementalDetokenizer.finish` concatenate to exactly
``tokenizer.decode(output_ids, skip_special_tokens=...)``, and no delta ever ends inside a
multi-byte character.

How: a token's text is not always known when it arrives. A byte-level BPE or byte-fallback
token may carry only part of a UTF-8 character (decoded as U+FFFD until the rest comes), and
a SentencePiece-style decoder drops the leading space of whatever is decoded first. So each
step decodes a small window that starts one emission back (``prefix_offset``), and the new
text is what the window adds beyond the part already emitted (``read_offset``). Window starts
always sit on character boundaries, so the window's decoding agrees with the full decoding.

Byte-fallback tokenizers (``<0xNN>`` pieces) need one more rule: their decoder turns a whole
run of byte pieces into text at once, and if the run is not valid UTF-8 *every* byte of it
becomes U+FFFD, including characters that looked complete earlier. So text is held back
while the sequence ends in a byte piece, and released when the run is closed by any other
token (or by :meth:`IncrementalDetokenizer.finish`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class IncrementalDetokenizer:
    """Turns a sequence's output token ids into text deltas, one step at a time.

    :param tokenizer: a transformers tokenizer (``decode``, ``convert_ids_to_tokens`` and
        ``all_special_ids`` are used)
    :param prompt_token_ids: the request's prompt. The text is defined as the decoding of
        the *output* ids alone (what ``tokenizer.decode(output_ids)`` returns), so the prompt
        is not used as decoding context; it is kept for :attr:`prompt_token_ids`.
    :param skip_special_tokens: passed to every ``decode``
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self._skipped = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self._backend_decode = exact_backend_decode(tokenizer)
        self.token_ids: list[int] = []
        """All output ids so far."""
        self._text = ""
        self._prefix_offset = 0
        """Start of the decoding window: the first token of the previous emission."""
        self._read_offset = 0
        """Tokens before this are in ``text``; those after it are held back."""

    @property
    def text(self) -> str:
        """All text emitted so far (never ends inside a multi-byte character)."""
        return self._text

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append tokens and return the text they complete ("" while a character is still
        partial: a trailing U+FFFD is held back until the next tokens resolve it)."""
        self.token_ids.extend(token_ids)
        if not token_ids or self._in_byte_run():
            return ""
        prefix, window = self._decode_window()
        if window.endswith(_REPLACEMENT) or not window.startswith(prefix):
            return ""
        delta = window[len(prefix) :]
        self._advance(delta)
        return delta

    def finish(self, drop_partial: bool = False) -> str:
        """Flush what is held back. After this, ``text`` equals the full decoding for
        every prefix-stable decoder (byte-level BPE, byte fallback, SentencePiece without
        ``clean_up_tokenization_spaces``); a decoder that rewrites text across token
        boundaries gets the windowed continuation instead, as streamed text cannot be
        taken back.

        :param drop_partial: a trailing character whose bytes never completed (a reply cut
            at max_tokens mid-character) is dropped instead of emitted as U+FFFD; the text
            then equals :func:`decode_complete` of the ids.
        """
        if self._read_offset == len(self.token_ids):
            return ""
        ids = self.token_ids
        if drop_partial:
            ids = _complete_prefix(self._decode, ids, self._read_offset)
        full = self._decode(ids)
        if full.startswith(self._text):
            delta = full[len(self._text) :]
        else:  # a decoder that rewrites across windows; continue the window's view
            prefix, window = self._decode_window()
            delta = window[len(prefix) :] if window.startswith(prefix) else ""
            if drop_partial:
                delta = delta.rstrip(_REPLACEMENT)
        self._advance(delta)
        return delta

    def _decode_window(self) -> tuple[str, str]:
        ids = self.token_ids
        prefix = self._decode(ids[self._prefix_offset : self._read_offset])
        return prefix, self._decode(ids[self._prefix_offset :])

    def _advance(self, delta: str) -> None:
        self._text += delta
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)

    def _in_byte_run(self) -> bool:
        """Whether the last token the decoder sees (skipped special tokens are invisible
        to it, so they do not close a run) is a byte piece."""
        for token_id in reversed(self.token_ids):
            if token_id not in self._skipped:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                return isinstance(piece, str) and _BYTE_PIECE.fullmatch(piece) is not None
        return False

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def exact_backend_decode(tokenizer: Any) -> Callable[..., str] | None:
    """The Rust tokenizer's own ``decode`` where ``tokenizer.decode`` returns exactly its
    text, else None.

    That holds for a transformers fast tokenizer whose class keeps the stock ``decode`` and
    ``_decode`` (they only convert the ids and pass them on) and that does not clean up
    spaces afterwards. Every streamed token costs two decodes of a few ids; through
    transformers each was ~2.5 us, of which the decoding itself is 0.5-1 us.
    """
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    stock = (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerBase.decode
             and cls._decode is PreTrainedTokenizerFast._decode)
    if stock and isinstance(backend, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend.decode
    return None


_MAX_CHAR_TOKENS = 4
"""A UTF-8 character has at most 4 bytes, so at most 4 tokens can hold an unfinished one."""


def _complete_prefix(decode, ids: Sequence[int], keep: int = 0) -> Sequence[int]:
    """``ids`` without the trailing tokens (at most 4, never below ``keep``) that only make
    up part of a character: the longest such prefix whose decoding does not end in U+FFFD."""
    end = len(ids)
    while end > keep and end > len(ids) - _MAX_CHAR_TOKENS and decode(ids[:end]).endswith(_REPLACEMENT):
        end -= 1
    if decode(ids[:end]).endswith(_REPLACEMENT):
        return ids  # the replacement character is real text, not half a character
    return ids[:end]


def decode_complete(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """``tokenizer.decode(ids)`` without a trailing character whose bytes are incomplete."""

    def decode(part: Sequence[int]) -> str:
        return tokenizer.decode(list(part), skip_special_tokens=skip_special_tokens) if part else ""

    return decode(_complete_prefix(decode, ids))


class StopChecker:
    """Finds the first stop string in streamed text, even when it spans token boundaries.

    A match is searched only where it can be new: it must end inside the latest delta, so
    the search covers that delta plus ``len(stop) - 1`` characters before it. When several
    stops match, the one that ends first wins (ties: the longer one), which is the stop a
    character-by-character stream would have hit first, whatever the tokenization.

    :param stop: the stop strings (empty strings are ignored)
    :param include_stop_str_in_output: keep the matched stop string in the text
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool):
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)

    def check(self, text: str, new_delta_len: int) -> tuple[str | None, int]:
        """Look for a stop string ending in the last ``new_delta_len`` characters of
        ``text``.

        :return: (the matched stop string or None, how many leading characters of ``text``
            to keep: up to the start of the match, or its end with
            ``include_stop_str_in_output``; ``len(text)`` when nothing matched)
        """
        best: tuple[int, int, str] | None = None  # (end, start, stop): smallest wins
        if new_delta_len > 0:
            delta_start = len(text) - new_delta_len
            for s in self.stop:
                start = text.find(s, max(0, delta_start - len(s) + 1))
                if start < 0:
                    continue
                cand = (start + len(s), start, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is None:
            return None, len(text)
        end, start, s = best
        return s, end if self.include_stop_str_in_output else start

    def streamable_len(self, text: str) -> int:
        """How much of ``text`` may be streamed now: all of it except a tail that could
        still grow into a stop string (a proper prefix of one). Only needed when the stop
        string is cut from the output; with ``include_stop_str_in_output`` all of it."""
        if self.include_stop_str_in_output or not self.stop:
            return len(text)
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        return len(text) - hold
