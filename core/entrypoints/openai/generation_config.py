"""``--generation-config``: the model's sampling defaults for requests that leave them out.

A checkpoint's ``generation_config.json`` says how its authors meant it to be sampled
(Llama 3: temperature 0.6, top_p 0.9; Qwen3: top_k 20 ...). vLLM applies those values to
every request field the client did not send (its ``--generation-config auto``, the default);
``core serve`` does the same:

* ``auto`` (default): read ``generation_config.json`` beside the model (a model directory,
  or the directory holding a ``.gguf`` file); no file there means no defaults;
* ``vllm`` or ``none``: no defaults (core's own: temperature 1, top_p 1, no top_k ...);
* a folder path: read ``generation_config.json`` from that folder (it must exist).

Only the sampling fields are taken: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, and ``max_new_tokens`` (the default ``max_tokens`` of a request that
sets none; an explicit ``max_tokens`` is never lowered). A value the client sends always wins.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("core.entrypoints.openai")

FILE_NAME = "generation_config.json"
OFF = ("vllm", "none")
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens")


@dataclass(frozen=True)
class GenerationDefaults:
    """Defaults for the request fields a client left out (empty = none)."""

    sampling: dict[str, float | int] = field(default_factory=dict)
    """request field name -> default value (only fields in ``_SAMPLING_FIELDS``)."""
    max_tokens: int | None = None
    """``max_new_tokens`` of the file: the default for a request that sets no max_tokens."""
    source: str | None = None
    """The file the values came from (for the log and docs)."""

    def apply(self, req: Any) -> Any:
        """``req`` (a pydantic request) with every default field it did not set filled in;
        the request itself when there is nothing to fill."""
        update = {k: v for k, v in self.sampling.items() if getattr(req, k, None) is None}
        return req.model_copy(update=update) if update else req

    def max_tokens_for(self, req: Any, max_tokens: int | None) -> int | None:
        """The max_tokens to use: the client's when it set one, else the file's (if any)."""
        if self.max_tokens is None or any(f in req.model_fields_set for f in _MAX_TOKENS_FIELDS):
            return max_tokens
        return self.max_tokens


def load_generation_defaults(setting: str, model: str) -> GenerationDefaults:
    """The defaults ``--generation-config setting`` gives for the model at ``model``.

    :raises ValueError: a folder was named but holds no readable generation_config.json, or
        the file has a value of the wrong type (the message names it and the fix)
    """
    if setting in OFF:
        return GenerationDefaults()
    if setting == "auto":
        folder = _model_folder(model)
        if folder is None or not (folder / FILE_NAME).is_file():
            logger.info("no %s beside the model: no sampling defaults (--generation-config auto)", FILE_NAME)
            return GenerationDefaults()
    else:
        folder = Path(setting)
        if not (folder / FILE_NAME).is_file():
            raise ValueError(f"--generation-config {setting!r}: no {FILE_NAME} in that folder; name a folder "
                             f"that holds one, or pass 'auto' (the model's own) or 'vllm' (none)")
    defaults = parse_generation_config(folder / FILE_NAME)
    if defaults.sampling or defaults.max_tokens is not None:
        shown = {**defaults.sampling, **({"max_tokens": defaults.max_tokens} if defaults.max_tokens else {})}
        logger.info("sampling defaults from %s (for requests that leave them out): %s; "
                    "--generation-config vllm turns them off", defaults.source, shown)
    return defaults


def parse_generation_config(path: Path) -> GenerationDefaults:
    """The sampling defaults a generation_config.json sets (keys it lacks are no default)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--generation-config: cannot read {path}: {e}; fix the file or pass "
                         "--generation-config vllm to ignore it") from e
    if not isinstance(data, dict):
        raise ValueError(f"--generation-config: {path} holds {type(data).__name__}, not a JSON object; fix the "
                         "file or pass --generation-config vllm to ignore it")
    sampling: dict[str, float | int] = {}
    for key in _SAMPLING_FIELDS:
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"--generation-config: {path} sets {key}={value!r}, not a number; fix the file "
                             "or pass --generation-config vllm to ignore it")
        sampling[key] = int(value) if key == "top_k" else float(value)
    if sampling.get("top_k") == 0:  # transformers' "no top-k"; the API spells it -1
        sampling["top_k"] = -1
    _check_bounds(path, sampling)
    max_new = data.get("max_new_tokens")
    if max_new is not None and (isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1):
        raise ValueError(f"--generation-config: {path} sets max_new_tokens={max_new!r}; it must be an "
                         "integer >= 1 (fix the file or pass --generation-config vllm)")
    return GenerationDefaults(sampling, max_new, str(path))


def _check_bounds(path: Path, sampling: dict[str, float | int]) -> None:
    """A default a request could not send (temperature 5) would fail every request: refuse
    it at start-up, with the request model's own bounds."""
    from pydantic import ValidationError

    from core.entrypoints.openai.protocol import SamplingRequest

    try:
        SamplingRequest.model_validate(sampling)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        raise ValueError(f"--generation-config: {path} sets {key}={err.get('input')!r}, which a request may "
                         f"not ({err['msg']}); fix the file or pass --generation-config vllm") from None


def _model_folder(model: str) -> Path | None:
    p = Path(model)
    if p.is_dir():
        return p
    if p.is_file():  # a .gguf file: its directory may carry the original generation_config.json
        return p.parent
    return None
