"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from core.pooling import PoolingParams
from core.structured_output.spec import GrammarSpec

_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request (the fields vLLM and the OpenAI API users know).

    Every field is checked when the object is built; a bad value raises ``ValueError``
    naming the field, the value and the allowed range.
    """

    n: int = 1
    """Number of independent samples; the prompt is computed once and its blocks shared."""
    temperature: float = 1.0
    """0 means greedy."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) disables."""
    top_p: float = 1.0
    """Keep the smallest set whose probability mass reaches top_p; 1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's; 0 disables."""
    repetition_penalty: float = 1.0
    """HF-style: divide positive / multiply negative logits of seen tokens (prompt+output)."""
    presence_penalty: float = 0.0
    """OpenAI-style: subtract once from every token that appeared in the output."""
    frequency_penalty: float = 0.0
    """OpenAI-style: subtract count-times from every token in the output."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of the given token ids (OpenAI: -100..100)."""
    seed: int | None = None
    """Per-request seed: same seed, same tokens, whatever else is in the batch."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to max_model_len."""
    min_tokens: int = 0
    """EOS and stop tokens are masked until this many tokens were generated."""
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    """Stop strings; the output ends before them (see include_stop_str_in_output)."""
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    """Return this many top logprobs per generated token (plus the sampled one)."""
    prompt_logprobs: int | None = None
    """Return this many top logprobs per prompt token (plus the prompt token itself)."""
    skip_special_tokens: bool = True
    detokenize: bool = True
    pooling: PoolingParams | None = None
    """Set for an embedding request: pool the prompt's hidden states (core/pooling.py)."""
    structured: GrammarSpec | None = None
    """Constrain the output to a grammar (a JSON schema, a regex, a choice, ...): build one
    with ``GrammarSpec.of`` or :func:`core.structured_output.json_schema` and its siblings.
    The engine compiles it off its loop and masks every token the grammar forbids."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """Opaque per-request data for plugins; ignored by core."""

    def __post_init__(self) -> None:
        # Normalise sequence-typed fields so the object is hashable-ish and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        self._validate()

    def _validate(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            _check(_is_int(getattr(self, name)), name, getattr(self, name), "an integer")
        for name in ("max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or _is_int(value), name, value, "an integer or None")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            value = getattr(self, name)
            _check(_is_real(value), name, value, "a number")
        _check(self.n >= 1, "n", self.n, "an integer >= 1")
        _check(
            self.temperature >= 0 and math.isfinite(self.temperature),
            "temperature",
            self.temperature,
            "a finite number >= 0 (0 = greedy)",
        )
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "-1 (off) or >= 1")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "(0, 1]")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "[0, 1]")
        _check(
            self.repetition_penalty > 0,
            "repetition_penalty",
            self.repetition_penalty,
            "> 0 (1 = off)",
        )
        _check(
            -2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "[-2, 2]"
        )
        _check(
            -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            self.frequency_penalty,
            "[-2, 2]",
        )
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            self.max_tokens,
            ">= 1 or None",
        )
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"<= max_tokens ({self.max_tokens})",
        )
        _check(
            self.logprobs is None or self.logprobs >= 0, "logprobs", self.logprobs, ">= 0 or None"
        )
        _check(
            self.prompt_logprobs is None or self.prompt_logprobs >= 0,
            "prompt_logprobs",
            self.prompt_logprobs,
            ">= 0 or None",
        )
        _check(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
            "seed",
            self.seed,
            "an integer in [0, 2**63)",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings"
        )
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "non-negative token ids",
        )
        _check(
            self.structured is None or isinstance(self.structured, GrammarSpec),
            "structured",
            self.structured,
            "a GrammarSpec (e.g. GrammarSpec.of('json_schema', schema)) or None",
        )
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                _check(
                    _is_int(tok) and tok >= 0, "logit_bias", tok, "non-negative token ids as keys"
                )
                _check(
                    _is_real(bias) and -100 <= bias <= 100,
                    "logit_bias",
                    bias,
                    "[-100, 100] per token",
                )

    @functools.cached_property  # read per row per step, like the two below
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @functools.cached_property
    def changes_logits(self) -> bool:
        """Whether a logits processor may touch a row with these params: penalties, a
        logit bias, or ``min_tokens`` (while the row is below it)."""
        return self.needs_token_history or bool(self.logit_bias) or self.min_tokens > 0

    @functools.cached_property
    def kernel_fields(self) -> tuple[float, float, float, float, float, float, int]:
        """What a fused sampling kernel reads of these params, in the order of
        ``core.sampler.kernel``'s packed row: temperature (0.0 when greedy), top_p, min_p,
        the repetition, frequency and presence penalties, and top_k (capped at 2**31 - 1, which
        is more than any vocabulary, so that it stays exact in the kernel's float64 row)."""
        return (0.0 if self.greedy else self.temperature, self.top_p, self.min_p, self.repetition_penalty,
                self.frequency_penalty, self.presence_penalty, min(self.top_k, 2**31 - 1))

    @functools.cached_property  # read several times per row per step; fields never change
    def needs_token_history(self) -> bool:
        """Whether the sampler needs the sequence's prompt/output ids (penalties)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in the params must exist in the model's vocabulary."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", self.logit_bias or {}),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(
                    f"{name} contains token id(s) {bad[:5]} but the vocabulary has {vocab_size} "
                    f"tokens (ids 0..{vocab_size - 1}); remove them"
                )


def _is_int(x: object) -> bool:
    # bool is an int subclass, but True as a count or a token id is a caller's mistake.
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: must be {allowed}")


def as_tuple(x: str | Sequence[str] | None) -> tuple[str, ...]:
    if x is None:
        return ()
    return (x,) if isinstance(x, str) else tuple(x)
