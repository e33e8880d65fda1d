"""SamplingParams: validation at construction, normalisation, derived properties."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.sampling_params import SamplingParams


def test_defaults_are_valid_and_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_k, p.top_p, p.min_p) == (1, 1.0, -1, 1.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.stop) == (16, 0, None, ())
    assert not p.greedy and not p.needs_token_history


@pytest.mark.parametrize(
    ("kwargs", "field", "allowed"),
    [
        ({"n": 0}, "n", ">= 1"),
        ({"n": 1.5}, "n", "an integer"),
        ({"n": True}, "n", "an integer"),
        ({"temperature": -0.1}, "temperature", ">= 0"),
        ({"temperature": math.inf}, "temperature", "finite"),
        ({"temperature": math.nan}, "temperature", "finite"),
        ({"temperature": "hot"}, "temperature", "a number"),
        ({"top_k": -2}, "top_k", "-1 (off) or >= 1"),
        ({"top_k": 2.5}, "top_k", "an integer"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.01}, "top_p", "(0, 1]"),
        ({"top_p": math.nan}, "top_p", "(0, 1]"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"min_p": 1.5}, "min_p", "[0, 1]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": -2.1}, "frequency_penalty", "[-2, 2]"),
        ({"max_tokens": 0}, "max_tokens", ">= 1 or None"),
        ({"max_tokens": 3.0}, "max_tokens", "an integer or None"),
        ({"min_tokens": -1}, "min_tokens", ">= 0"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "<= max_tokens (4)"),
        ({"logprobs": -1}, "logprobs", ">= 0 or None"),
        ({"prompt_logprobs": -3}, "prompt_logprobs", ">= 0 or None"),
        ({"seed": -1}, "seed", "[0, 2**63)"),
        ({"seed": 2**63}, "seed", "[0, 2**63)"),
        ({"stop": ["ok", ""]}, "stop", "non-empty strings"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids", "non-negative"),
        ({"logit_bias": {"12": 1.0}}, "logit_bias", "non-negative token ids"),
        ({"logit_bias": {12: 101.0}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {12: math.nan}}, "logit_bias", "[-100, 100]"),
    ],
)
def test_invalid_values_name_field_value_and_range(kwargs, field, allowed) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    msg = str(err.value)
    assert f"SamplingParams.{field}=" in msg and allowed in msg, msg


def test_normalisation() -> None:
    p = SamplingParams(stop="###", stop_token_ids=[5, 6], top_k=0)
    assert p.stop == ("###",) and p.stop_token_ids == (5, 6) and p.top_k == -1
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(top_k=np.int64(4), seed=np.int64(9)).top_k == 4  # numpy ints are ints


def test_greedy_and_history_flags() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    for kw in ({"repetition_penalty": 1.1}, {"presence_penalty": 0.1}, {"frequency_penalty": -0.1}):
        assert SamplingParams(**kw).needs_token_history
    assert not SamplingParams(logit_bias={1: 2.0}, top_k=3).needs_token_history


def test_check_vocab_reports_out_of_range_ids() -> None:
    SamplingParams(stop_token_ids=(9,), logit_bias={9: 1.0}).check_vocab(10)
    with pytest.raises(
        ValueError, match=r"stop_token_ids contains token id\(s\) \[10\].*10 tokens"
    ):
        SamplingParams(stop_token_ids=(10,)).check_vocab(10)
    with pytest.raises(ValueError, match=r"logit_bias contains token id\(s\) \[12\]"):
        SamplingParams(logit_bias={12: 1.0}).check_vocab(10)


def test_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]
