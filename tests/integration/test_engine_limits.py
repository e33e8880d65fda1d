"""The offline engine refuses what can never run, with the numbers (issue 16 item 3), and a
reply cut at max_tokens mid-character does not end in U+FFFD (tiny random Llama, CPU)."""

from __future__ import annotations

import pytest

from core.entrypoints.llm import LLM
from core.sampling_params import SamplingParams
from tests.helpers import tiny_llama_dir


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tiny_llama_dir(tmp_path_factory.mktemp("limits"))
    # 16 usable KV blocks of 16 tokens: one 256-token sequence, or 20 blocks' worth never.
    return LLM(model=str(path), max_model_len=256, dtype="float32", platform="cpu", block_size=16,
               num_blocks_override=17)


def test_n_samples_that_can_never_fit_the_cache_are_a_value_error(llm):
    with pytest.raises(ValueError, match=r"5 sample\(s\) of up to \d+ tokens need 20 KV blocks of 16 tokens "
                                         r"but the cache has 16; lower max_tokens or n"):
        llm.generate("hello there", SamplingParams(n=5, max_tokens=50), use_tqdm=False)
    with pytest.raises(ValueError, match="n=300 samples but max_num_seqs is 256; raise --max-num-seqs"):
        llm.generate("hello there", SamplingParams(n=300), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_a_refused_prompt_leaves_none_of_its_batch_queued(llm):
    ok, bad = SamplingParams(max_tokens=3), SamplingParams(n=5, max_tokens=50)
    with pytest.raises(ValueError, match="need 20 KV blocks"):
        llm.generate(["first", "second", "third"], [ok, ok, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    s = llm.engine.scheduler.stats()
    assert (s.num_running, s.num_waiting, s.kv_cache_usage) == (0, 0, 0.0)
    outs = llm.generate(["next"], ok, use_tqdm=False)
    assert len(outs) == 1 and outs[0].prompt == "next"


def test_a_reply_cut_mid_character_has_no_replacement_character(llm):
    tok = llm.get_tokenizer()
    lead = tok.convert_tokens_to_ids(chr(0xC3))  # byte-level BPE: the lone byte 0xC3 ("é" starts so)
    assert tok.decode([lead]) == "\ufffd"  # what a naive decode would return
    params = SamplingParams(temperature=0, max_tokens=1, logit_bias={lead: 100.0})
    out = llm.generate("force a partial character", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == (lead,) and out.finish_reason == "length"
    assert out.text == ""
