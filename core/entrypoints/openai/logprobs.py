"""Engine logprobs (token id -> Logprob per position) in the two OpenAI layouts."""

from __future__ import annotations

import math
from collections.abc import Sequence

from core.entrypoints.openai.protocol import CompletionLogprobs, TokenLogprob, TopLogprob
from core.outputs import TokenLogprobs

_FLOOR = -9999.0
"""Stand-in for -inf / NaN, which JSON cannot carry (OpenAI uses the same value)."""


def _finite(x: float) -> float:
    return x if math.isfinite(x) else _FLOOR


def _text(texts: Sequence[str], tid: int) -> str:
    return texts[tid] if 0 <= tid < len(texts) else ""


def _top(entry: TokenLogprobs, k: int) -> list[tuple[int, float]]:
    """The k likeliest (token id, logprob) pairs of a position, likeliest first."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
    return [(tid, _finite(lp.logprob)) for tid, lp in ranked[:k]]


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs],
    positions: range,
    k: int,
    texts: Sequence[str],
    offset: int,
) -> CompletionLogprobs:
    """Legacy completions layout for ``positions``; ``offset`` is where the first token's
    text starts in the returned text. ``top_logprobs`` holds the top k plus the sampled token."""
    out = CompletionLogprobs()
    for pos in positions:
        if pos >= len(logprobs):
            break
        tid, entry = token_ids[pos], logprobs[pos]
        tok = _text(texts, tid)
        chosen = entry.get(tid)
        out.tokens.append(tok)
        out.token_logprobs.append(_finite(chosen.logprob) if chosen is not None else None)
        out.text_offset.append(offset)
        offset += len(tok)
        top: dict[str, float] = {}
        for t, lp in _top(entry, k):
            top.setdefault(_text(texts, t), lp)  # tokens with the same text: keep the likelier
        if chosen is not None:
            top.setdefault(tok, _finite(chosen.logprob))
        out.top_logprobs.append(top)
    return out


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs],
    positions: range,
    k: int,
    texts: Sequence[str],
) -> list[TokenLogprob]:
    """Chat layout: per token its text, logprob, UTF-8 bytes and the top k alternatives."""
    out = []
    for pos in positions:
        if pos >= len(logprobs):
            break
        tid, entry = token_ids[pos], logprobs[pos]
        tok = _text(texts, tid)
        chosen = entry.get(tid)
        top = [TopLogprob(token=_text(texts, t), logprob=lp, bytes=list(_text(texts, t).encode()))
               for t, lp in _top(entry, k)]
        out.append(TokenLogprob(token=tok, logprob=_finite(chosen.logprob) if chosen is not None else _FLOOR,
                                bytes=list(tok.encode()), top_logprobs=top))
    return out
