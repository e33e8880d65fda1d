"""Sampling features through the whole engine (issue 3): n > 1 block sharing, seeded
reproducibility inside a batch, stop strings, and logprobs against HF transformers."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from core import LLM, SamplingParams
from tests.helpers import tiny_llama_dir

BS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tiny_llama_dir(tmp_path_factory.mktemp("sampling"), seed=21))


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model=model, platform="cpu", dtype="float32", block_size=BS, max_model_len=256)


def _all_free(llm):
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_n4_shares_the_prompt_blocks_then_frees_everything(llm):
    eng = llm.engine
    prompt = list(range(10, 10 + 3 * BS + 5))  # 3 full blocks + a partial one
    rid = eng.add_request(None, prompt, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6))
    req = eng.scheduler.get_request(rid)
    outs = []
    while not req.forked:
        outs += eng.step()
    tables = [eng.block_manager.block_table(s.seq_id) for s in req.seqs]
    assert len(tables) == 4
    shared = tables[0][:3]
    assert all(t[:3] == shared for t in tables)  # the 3 full prompt blocks, computed once
    assert [eng.block_manager.ref_count(b) for b in shared] == [4, 4, 4]
    while eng.has_unfinished_requests():
        outs += eng.step()
    final = [o for o in outs if o.finished][0]
    assert len(final.outputs) == 4 and all(len(c.token_ids) == 6 for c in final.outputs)
    # seeded samples differ from each other (seed + index per sample) but are reproducible
    assert len({c.token_ids for c in final.outputs}) > 1
    again = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6), use_tqdm=False)
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in final.outputs]
    _all_free(llm)


def test_seeded_request_is_identical_alone_and_in_a_batch(llm):
    rng = random.Random(3)
    target = [rng.randrange(3, 512) for _ in range(20)]
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([target], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 40))] for _ in range(16)]
    params = [SamplingParams(temperature=rng.choice([0, 0.7, 1.3]), top_k=rng.choice([-1, 5]),
                             max_tokens=rng.randint(5, 30), ignore_eos=True) for _ in others]
    batch = llm.generate(others[:8] + [target] + others[8:], params[:8] + [sp] + params[8:], use_tqdm=False)
    assert batch[8].outputs[0].token_ids == alone
    _all_free(llm)


def test_stop_string_split_across_tokens_is_trimmed(llm):
    tok = llm.get_tokenizer()
    base = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    text = base[0].outputs[0].text
    ids = base[0].outputs[0].token_ids
    # choose a stop string that spans the boundary between two generated tokens
    first = tok.decode(ids[:3])
    second = tok.decode(ids[:4])
    assert len(second) > len(first) >= 1
    stop = first[-1:] + second[len(first):len(first) + 1]
    assert stop in text
    cut = text.index(stop)
    out = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:cut]
    kept = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                                        include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: cut + len(stop)]
    _all_free(llm)


def test_logprobs_equal_hf_log_softmax(llm, model):
    prompt = [5, 77, 300, 12, 99, 450, 8]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    gen = list(out.outputs[0].token_ids)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + gen])).logits[0].double(), -1)
    # generated tokens: position len(prompt)-1+i predicts gen[i]
    for i, (tok_id, lps) in enumerate(zip(gen, out.outputs[0].logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert lps[tok_id].logprob == pytest.approx(float(row[tok_id]), abs=1e-4)
        top = torch.topk(row, 3).indices.tolist()
        assert set(top) <= set(lps)
        assert lps[top[0]].rank == 1
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(float(ref[len(prompt) - 1 + i, t]) for i, t in enumerate(gen)), abs=1e-3)
    # prompt logprobs: entry p holds log P(prompt[p] | prompt[:p]); the first is None
    assert out.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        assert out.prompt_logprobs[p][prompt[p]].logprob == pytest.approx(float(ref[p - 1, prompt[p]]), abs=1e-4)
    _all_free(llm)


def test_chat_turns_generation_prompt_and_user_template(llm):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "quick fox"}]
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    # the model's template, with and without the generation prompt
    for add in (True, False):
        ids = tok.apply_chat_template(chat, add_generation_prompt=add, tokenize=True, return_dict=False)
        want = llm.generate([list(ids)], sp, use_tqdm=False)[0].outputs[0].token_ids
        got = llm.chat(chat, sp, add_generation_prompt=add, use_tqdm=False)[0]
        assert list(got.prompt_token_ids) == list(ids) and got.outputs[0].token_ids == want
    # a user-supplied template replaces the model's
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    out = llm.chat(chat, sp, chat_template=template, use_tqdm=False)[0]
    text = "[system] Be brief.\n[user] Hello\n[assistant] Hi!\n[user] quick fox\n"
    assert list(out.prompt_token_ids) == tok.encode(text, add_special_tokens=False)
