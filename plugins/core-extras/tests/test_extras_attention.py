"""cpu_naive: its layout and kernels against core's float64 reference, and its selection
through ``--attention-backend cpu_naive`` (offline API and command line)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from core_extras.naive_attention import NaiveCpuAttentionBackend
from extras_testkit import engine_kv_caches

import core
from core.attention import AttentionSpec, build_metadata, reference_attention


def test_write_kv_layout_and_padding():
    spec = AttentionSpec(4, 2, 8, torch.float32, 16)
    backend = NaiveCpuAttentionBackend(spec)
    cache = backend.allocate_kv_cache(4, "cpu")
    assert cache.shape == (4, 16, 2, 2, 8)
    g = torch.Generator().manual_seed(1)
    key, value = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g)
    backend.write_kv(key, value, cache, torch.tensor([2 * 16 + 5, -1, 3 * 16 + 15]))
    assert torch.equal(cache[2, 5, 0], key[0]) and torch.equal(cache[2, 5, 1], value[0])
    assert torch.equal(cache[3, 15, 0], key[2]) and torch.equal(cache[3, 15, 1], value[2])
    assert int((cache != 0).sum()) == 2 * 2 * 2 * 8  # two real tokens; the padding row nowhere


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize(("heads", "kv_heads", "block_size"), [(8, 2, 16), (4, 4, 32)])
def test_mixed_batch_matches_the_reference(heads, kv_heads, block_size, window):
    spec = AttentionSpec(heads, kv_heads, 32, torch.float32, block_size, sliding_window=window)
    backend = NaiveCpuAttentionBackend(spec)
    g = torch.Generator().manual_seed(heads * block_size)
    cache = backend.allocate_kv_cache(30, "cpu").normal_(generator=g)  # stale data everywhere
    free = list(range(1, 30))
    random.Random(block_size).shuffle(free)
    chunks = [(0, 40), (21, 13), (17, 1), (48, 1)]  # (cached, new): 2 prefills, 2 decodes
    keys, values, queries, tables, new_slots = [], [], [], [], []
    for ctx, new in chunks:
        n = ctx + new
        k, v = torch.randn(n, kv_heads, 32, generator=g), torch.randn(n, kv_heads, 32, generator=g)
        table = [free.pop() for _ in range(-(-n // block_size))]
        slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
        backend.write_kv(k[:ctx], v[:ctx], cache, torch.tensor(slots[:ctx], dtype=torch.long))
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(new, heads, 32, generator=g))
        tables.append(table + [0] * (6 - len(table)))
        new_slots += slots[ctx:]
    md = build_metadata([n for _, n in chunks], [c for c, _ in chunks], tables, block_size,
                        num_prefills=2, slot_mapping=new_slots)
    q = torch.cat(queries)
    out = backend.forward(q, torch.cat([k[c:] for k, (c, _) in zip(keys, chunks)]),
                          torch.cat([v[c:] for v, (c, _) in zip(values, chunks)]), cache, md)
    want = reference_attention(q, keys, values, [n for _, n in chunks], spec.softmax_scale, window)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_copy_and_swap_blocks():
    g = torch.Generator().manual_seed(4)
    caches = [torch.randn(6, 16, 2, 2, 8, generator=g) for _ in range(2)]
    before = [c.clone() for c in caches]
    NaiveCpuAttentionBackend.copy_blocks(caches, torch.tensor([[1, 4], [4, 5]]))
    for c, b in zip(caches, before):
        assert torch.equal(c[4], b[1]) and torch.equal(c[5], b[4]) and torch.equal(c[:4], b[:4])
    host = torch.zeros(3, 16, 2, 2, 8)
    NaiveCpuAttentionBackend.swap_blocks(caches[0], host, torch.tensor([[2, 0], [3, 2]]))
    assert torch.equal(host[0], caches[0][2]) and torch.equal(host[2], caches[0][3])
    assert int((host[1] != 0).sum()) == 0


PROMPTS = ["Hello world", "ka lo mi ne su ta ri po the and ing er on " * 3]
GREEDY = core.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE = dict(platform="cpu", dtype="float32", max_model_len=256, kv_cache_memory="8MiB", block_size=16)


@pytest.fixture(scope="module")
def default_backend_outputs(tiny_llama):
    llm = core.LLM(model=str(tiny_llama), **ENGINE)
    return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_engine_selects_it_by_name(tiny_llama, default_backend_outputs, no_override):
    llm = core.LLM(model=str(tiny_llama), attention_backend="cpu_naive", **ENGINE)
    caches = engine_kv_caches(llm)
    assert caches[0].shape[1:] == (16, 2, 1, 64)  # [blocks, block, K|V, kv_heads, head]: ours
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in default_backend_outputs]


def test_unknown_backend_name_is_refused(tiny_llama):
    with pytest.raises(ValueError, match=r"attention backend 'cpu_fancy' is not built into platform 'cpu'"):
        core.LLM(model=str(tiny_llama), attention_backend="cpu_fancy", **ENGINE)


def test_command_line_flag(tiny_llama, default_backend_outputs):
    core_script = Path(sys.executable).with_name("core")
    assert core_script.exists(), f"the `core` command is not installed next to {sys.executable}"
    cmd = [str(core_script), "generate", PROMPTS[0], "--model", str(tiny_llama), "--platform", "cpu",
           "--attention-backend", "cpu_naive", "--no-chat-template", "--max-tokens", "10",
           "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8MiB"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CORE_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    text = run.stdout.rstrip("\n")
    assert text and default_backend_outputs[0].outputs[0].text.startswith(text)
