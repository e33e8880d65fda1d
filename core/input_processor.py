"""The front end's request intake: tokenize the prompt, check it and the sampling parameters
against the model, and build the :class:`~core.engine_core.types.EngineRequest` the engine
core takes. Runs in the front end (the API process, or the offline ``LLM``'s), never in the
engine core's loop, so a huge prompt cannot stall generation."""

from __future__ import annotations

import dataclasses
import numbers
import time
from typing import Any

from core.engine_core.types import EngineRequest
from core.sampling_params import SamplingParams


class InputProcessor:
    """:param tokenizer: a transformers tokenizer (only ``encode`` is used)
    :param vocab_size: the model's vocabulary size (prompt and parameter ids must be below)
    :param max_model_len: prompt plus generated tokens must fit this
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def process(
        self,
        request_id: str,
        prompt: str | list[int] | tuple[int, ...] | None,
        params: SamplingParams | None,
        priority: int = 0,
        arrival_time: float | None = None,
        exact_max_tokens: bool = False,
    ) -> tuple[EngineRequest, str | None]:
        """The engine request and the prompt text (None for token ids).

        ``max_tokens`` beyond the room the prompt leaves in max_model_len is capped to that
        room (a default is a cap), or, with ``exact_max_tokens`` (a client asked for exactly
        that many, as OpenAI's API means it), refused.

        :raises ValueError: an empty prompt, ids outside the vocabulary, a prompt that leaves
            no room in max_model_len, parameters naming unknown token ids.
        """
        arrival = time.monotonic() if arrival_time is None else arrival_time  # TTFT includes tokenizing
        params = params or SamplingParams()
        text, ids = self._tokenize(prompt)
        params = self._check_params(params, len(ids), exact_max_tokens)
        return EngineRequest(request_id, tuple(ids), params, priority, arrival), text

    def _tokenize(self, prompt: str | list[int] | tuple[int, ...] | None) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            text = prompt
        elif prompt is None or isinstance(prompt, (list, tuple)):
            ids, text = list(prompt or []), None
        else:
            raise ValueError(
                f"the prompt must be a string or a list of token ids, not {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        # bool is an int subclass and 3.0 == 3, but neither is a token id a caller meant.
        not_ids = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if not_ids:
            raise ValueError(f"prompt token ids must be integers; got {not_ids[:5]!r}")
        ids = [int(t) for t in ids]  # numpy integers too; the wire carries plain ints
        bad = [t for t in ids if not (0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return text, ids

    def _check_params(self, params: SamplingParams, prompt_len: int, exact_max_tokens: bool) -> SamplingParams:
        max_len = self.max_model_len
        if prompt_len >= max_len:
            raise ValueError(
                f"the prompt has {prompt_len} tokens but max_model_len is {max_len} (prompt plus "
                f"at least one generated token must fit); shorten the prompt or raise --max-model-len"
            )
        params.check_vocab(self.vocab_size)
        room = max_len - prompt_len
        if exact_max_tokens and params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"max_tokens={params.max_tokens} does not fit: max_model_len is {max_len} tokens and "
                f"the prompt has {prompt_len}, so at most {room} can be generated; lower max_tokens"
            )
        if params.max_tokens is None or params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room)
        if params.min_tokens > params.max_tokens:
            params = dataclasses.replace(params, min_tokens=params.max_tokens)
        return params
