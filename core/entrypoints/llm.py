"""The offline API: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from core.engine import LLMEngine
from core.engine_args import EngineArgs
from core.outputs import RequestOutput
from core.sampling_params import SamplingParams

Message = dict[str, Any]


def _prompt_list(prompts: Any) -> list[str | list[int]]:
    """``prompts`` as a list of prompts, or a TypeError / ValueError naming what is wrong."""
    if isinstance(prompts, str):
        prompts = [prompts]
    elif isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], numbers.Number):
        prompts = [prompts]  # one token-id prompt (its ids are checked below)
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes | bytearray):
        raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; got "
                        f"{type(prompts).__name__}" + (" (pass the prompt text itself)" if isinstance(prompts, dict) else ""))
    if not prompts:
        raise ValueError("prompts is empty; pass at least one prompt")
    out: list[str | list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, Sequence) and not isinstance(p, bytes | bytearray):
            bad = next((t for t in p if not _is_token_id(t)), None)
            if bad is not None or not p:
                what = "is empty" if not p else f"holds {bad!r} ({type(bad).__name__})"
                raise ValueError(f"prompts[{i}] {what}; a token-id prompt is a non-empty list of ints >= 0")
            out.append(list(p))
        else:
            raise TypeError(f"prompts[{i}] is a {type(p).__name__}; each prompt must be a string or a list of token ids")
    return out


def _is_token_id(x: Any) -> bool:
    # bool is an int subclass, and 1.0 is not a token id: both are callers' mistakes.
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _params_list(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, Sequence) or not all(isinstance(p, SamplingParams) for p in params):
        hint = " (build one with SamplingParams(**your_dict))" if isinstance(params, dict) else ""
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them; got "
                        f"{type(params).__name__}{hint}")
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts; pass one or one per prompt")
    return list(params)


class LLM:
    """Run a batch of prompts through the engine and return one output per prompt.

    ``LLM()`` with no model uses the embedded SmolLM2-135M-Instruct. Keyword arguments are
    :class:`~core.engine_args.EngineArgs` fields (platform, dtype, max_model_len, ...).
    """

    def __init__(self, model: str | None = None, **engine_args: Any):
        self.engine = LLMEngine.from_args(EngineArgs(model=model, **engine_args))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``; prompts may be strings or token-id lists.

        Every argument is checked before anything is queued, and a prompt the engine refuses
        takes the ones queued before it out again: a failed call leaves the engine as it was.
        """
        prompts = _prompt_list(prompts)
        params = _params_list(sampling_params, len(prompts))
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(None, p, sp, final_only=True))
        except BaseException:  # all or nothing: a refused prompt leaves none of the batch queued
            # A dead engine cannot take them back; its own error (raised below) says why.
            with contextlib.suppress(Exception):
                for rid in ids:
                    self.engine.abort_request(rid, report=False)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the chat template (the model's, or ``chat_template``) and generate.

        ``messages`` is one conversation (a list of {"role", "content"} dicts) or a list of them.
        """
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.apply_chat_template(c, chat_template, add_generation_prompt) for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self, conversation: Sequence[Message], chat_template: str | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        tok = self.engine.tokenizer
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError(
                "this model's tokenizer has no chat template; pass chat_template=... (a Jinja "
                "template) or use generate() with a plain prompt"
            )
        return list(
            tok.apply_chat_template(
                list(conversation),
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
        )

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:  # their final outputs are nobody's: the next call must not get them
                if rid not in done:
                    self.engine.abort_request(rid, report=False)
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]
