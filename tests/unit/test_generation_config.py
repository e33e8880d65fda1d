"""--generation-config: which values a generation_config.json supplies, that a client's own
value always wins, and the start-up refusals (each names the file, the value and the fix)."""

from __future__ import annotations

import json

import pytest

from core.entrypoints.openai.args import ServerArgs
from core.entrypoints.openai.generation_config import (
    load_generation_defaults,
    parse_generation_config,
)
from core.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from core.entrypoints.openai.served import ServedModel


def _write(folder, data) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(data))


def test_only_sampling_fields_are_taken(tmp_path):
    _write(tmp_path, {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "eos_token_id": [2, 3],
                      "max_new_tokens": 64, "repetition_penalty": 1.1, "min_p": 0})
    d = parse_generation_config(tmp_path / "generation_config.json")
    assert d.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "min_p": 0.0}
    assert d.max_tokens == 64


def test_client_values_win_and_gaps_are_filled(tmp_path):
    _write(tmp_path, {"temperature": 0.6, "top_k": 0, "max_new_tokens": 64})
    defaults = load_generation_defaults(str(tmp_path), "ignored")
    assert defaults.sampling["top_k"] == -1  # transformers' 0 = off is the API's -1
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "top_k": 5})
    filled = defaults.apply(req)
    assert (filled.temperature, filled.top_k) == (0.6, 5)
    assert defaults.max_tokens_for(req, None) == 64
    explicit = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                     "temperature": 1.5, "max_completion_tokens": 200})
    assert defaults.apply(explicit).temperature == 1.5
    assert defaults.max_tokens_for(explicit, 200) == 200
    completion = CompletionRequest.model_validate({"prompt": "x"})  # max_tokens 16 is OpenAI's default, not set
    assert defaults.max_tokens_for(completion, 16) == 64


def test_auto_reads_beside_the_model_and_off_reads_nothing(tmp_path):
    _write(tmp_path / "model", {"temperature": 0.3})
    assert load_generation_defaults("auto", str(tmp_path / "model")).sampling == {"temperature": 0.3}
    gguf = tmp_path / "model" / "m.gguf"
    gguf.write_bytes(b"")
    assert load_generation_defaults("auto", str(gguf)).sampling == {"temperature": 0.3}
    assert load_generation_defaults("auto", str(tmp_path / "elsewhere")).sampling == {}
    for off in ("vllm", "none"):
        assert load_generation_defaults(off, str(tmp_path / "model")).sampling == {}


@pytest.mark.parametrize("data,fragment", [
    ({"temperature": "hot"}, "temperature='hot', not a number"),
    ({"temperature": 5.0}, "temperature=5.0, which a request may not"),
    ({"top_p": 0}, "top_p=0"),
    ({"max_new_tokens": 0}, "max_new_tokens=0; it must be an integer >= 1"),
    ([1, 2], "not a JSON object"),
])
def test_bad_files_are_refused_at_start_up(tmp_path, data, fragment):
    _write(tmp_path, data)
    with pytest.raises(ValueError, match="--generation-config") as e:
        load_generation_defaults(str(tmp_path), "m")
    assert fragment in str(e.value) and "--generation-config vllm" in str(e.value)


def test_a_folder_without_the_file_is_refused_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="no generation_config.json in that folder"):
        ServerArgs(generation_config=str(tmp_path))


@pytest.mark.parametrize("names,fragment", [(("a", "a"), "names a model twice"), (("a", " "), "non-empty")])
def test_served_names_are_checked(names, fragment):
    with pytest.raises(ValueError, match=fragment):
        ServerArgs(served_model_name=names)
    assert ServedModel(("x", "y")).primary == "x"
