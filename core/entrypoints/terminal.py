"""Replies streamed to a terminal, for ``core generate`` and ``core chat``.

A reply is one engine request driven step by step. After each step the request's text so
far is compared with what is already on screen and only the new part is written and
flushed, so tokens appear as they are sampled. The detokenizer holds back the bytes of a
multi-byte character until it is whole, so each piece written is complete text.

Ctrl-C while a reply streams stops that reply. The SIGINT handler installed for the reply
only counts the signal; the loop sees the count between engine steps and aborts the
request there (its KV blocks are freed at once), never in the middle of a forward pass,
so the engine stays usable for the next turn. A second Ctrl-C during the same reply raises
KeyboardInterrupt, for a step that does not come back.
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass
from typing import TextIO

from core.sampling_params import SamplingParams


@dataclass(frozen=True)
class Reply:
    text: str
    """Everything written to the terminal for this reply."""
    finish_reason: str | None
    """stop | length | abort (abort: the user pressed Ctrl-C)."""
    num_tokens: int


class _SigintCounter:
    """While entered (in the main thread), SIGINT increments ``count`` instead of raising;
    the second one raises KeyboardInterrupt as usual."""

    def __init__(self) -> None:
        self.count = 0
        self._previous = None

    def _handler(self, signum, frame) -> None:
        self.count += 1
        if self.count > 1:
            raise KeyboardInterrupt

    def __enter__(self) -> _SigintCounter:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def stream_reply(engine, prompt: str | list[int], params: SamplingParams, out: TextIO | None = None) -> Reply:
    """Generate a reply to ``prompt`` (text or token ids) on ``engine`` (an ``LLMEngine``
    with no other requests), writing its text to ``out`` (default stdout) as it grows."""
    out = out or sys.stdout
    rid = engine.add_request(None, prompt, params)
    shown = ""
    final = None
    aborted = False
    with _SigintCounter() as sigint:
        while final is None:
            if sigint.count and not aborted:
                engine.abort_request(rid)  # its final output comes with the next step
                aborted = True
            for o in engine.step():
                if o.request_id != rid:
                    continue
                text = o.outputs[0].text
                # text only grows while streaming; anything else (never expected) is not redrawn
                if len(text) > len(shown) and text.startswith(shown):
                    out.write(text[len(shown):])
                    out.flush()
                    shown = text
                if o.finished:
                    final = o.outputs[0]
    return Reply(shown, final.finish_reason, len(final.token_ids))
