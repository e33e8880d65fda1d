"""The offline API: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from core.engine import LLMEngine
from core.engine_args import EngineArgs
from core.outputs import RequestOutput
from core.sampling_params import SamplingParams

Message = dict[str, Any]


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
        """Outputs in the order of ``prompts``; prompts may be strings or token-id lists."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts; pass one or one per prompt")
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(None, p, sp, final_only=True))
        except BaseException:  # all or nothing: a refused prompt leaves none of the batch queued
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
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]
