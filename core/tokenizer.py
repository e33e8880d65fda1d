"""Tokenizer loading through ``transformers`` (chat templates included) and EOS ids."""

from __future__ import annotations

import json
import os
from typing import Any


def load_tokenizer(tokenizer_path: str, gguf_file: str | None = None, cache_dir: str | None = None) -> Any:
    """Load a fast HF tokenizer from a local directory, or from a GGUF file's metadata.

    :param tokenizer_path: directory with tokenizer files (for GGUF: the file's directory).
    :param gguf_file: the GGUF file (absolute, or relative to ``tokenizer_path``); its
        vocabulary, merges, special tokens and chat template are used.
    :param cache_dir: where to keep the tokenizer derived from a GGUF file (None: no cache).
    """
    from transformers import AutoTokenizer

    if not os.path.isdir(tokenizer_path):
        raise FileNotFoundError(
            f"tokenizer path {tokenizer_path!r} is not a directory; pass a local directory "
            f"with tokenizer files to --tokenizer"
        )
    if gguf_file is not None:
        from core.gguf_file import load_gguf_tokenizer

        path = gguf_file if os.path.isabs(gguf_file) else os.path.join(tokenizer_path, gguf_file)
        return load_gguf_tokenizer(path, cache_dir)
    return AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def eos_token_ids(tokenizer: Any, hf_config: Any, model_path: str | None = None) -> frozenset[int]:
    """Every token id that ends generation.

    The union of the tokenizer's EOS, the model config's ``eos_token_id`` (an int or a
    list) and, when ``model_path`` has a ``generation_config.json``, its ``eos_token_id``
    (instruct models often list their end-of-turn token only there). By default
    ``model_path`` is the tokenizer's own directory.
    """
    ids = _ids(getattr(tokenizer, "eos_token_id", None))
    ids |= _ids(getattr(hf_config, "eos_token_id", None))
    path = model_path if model_path is not None else getattr(tokenizer, "name_or_path", None)
    gen_file = os.path.join(path, "generation_config.json") if path else None
    if gen_file and os.path.isfile(gen_file):
        with open(gen_file) as f:
            ids |= _ids(json.load(f).get("eos_token_id"))
    return frozenset(ids)
