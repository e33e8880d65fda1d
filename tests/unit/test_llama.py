"""Our Llama against HF transformers on tiny random checkpoints (fp32, CPU).

Each configuration runs a mixed schedule over a paged KV cache — prompts of different
lengths, one prompt prefilled in two chunks while others decode, then several decode steps —
and every logits row must equal HF's full-sequence forward at the same position.
"""

from __future__ import annotations

import pytest
import torch

from core.model_loader import load_model
from core.models import ModelRegistry
from tests.helpers import (
    LLAMA3_ROPE,
    PagedSession,
    cpu_context,
    hf_logits,
    load_tiny,
    model_config_for,
    run_ranks,
    run_schedule,
    tiny_llama_dir,
)

CONFIGS = {
    "gqa-untied": {},
    "mha-tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "mqa-llama3-rope": dict(num_key_value_heads=1, rope_parameters=dict(LLAMA3_ROPE)),
    "head-dim-and-biases": dict(head_dim=32, attention_bias=True, mlp_bias=True, rms_norm_eps=1e-6),
    "linear-rope-theta": dict(
        rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_chunks_and_decode_match_transformers(tmp_path, name):
    path = tiny_llama_dir(tmp_path, seed=len(name), **CONFIGS[name])
    model = load_tiny(path, block_size=4)
    results = run_schedule(model, vocab=512)
    reference = hf_logits(path, {s: toks for s, (toks, _) in results.items()})
    for s, (toks, ours) in results.items():
        assert ours.shape == (len(toks), 512), s
        torch.testing.assert_close(ours, reference[s], rtol=1e-4, atol=1e-4, msg=f"{name}/{s}")


def test_attention_specs_describe_each_layer(tmp_path):
    path = tiny_llama_dir(tmp_path, head_dim=32)
    specs = load_tiny(path, block_size=4).attention_specs()
    assert len(specs) == 2
    assert {(s.num_heads, s.num_kv_heads, s.head_size, s.block_size, s.dtype) for s in specs} == {
        (4, 2, 32, 4, torch.float32)
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_ranks_equal_one_rank(tmp_path, tp):
    """vocab 510 is not a multiple of 4 (padded vocabulary shards); 2 KV heads on 4 ranks
    are replicated; tied embeddings share the sharded embedding."""
    path = tiny_llama_dir(tmp_path, vocab_size=510, tie_word_embeddings=True)
    single = run_schedule(load_tiny(path), vocab=510, decode_steps=2)

    def rank(comm):
        return run_schedule(load_tiny(path, comm=comm), vocab=510, decode_steps=2)

    for r, result in enumerate(run_ranks(tp, rank)):
        for s, (toks, logits) in result.items():
            assert toks == single[s][0]
            torch.testing.assert_close(
                logits, single[s][1], rtol=1e-5, atol=1e-5, msg=f"rank {r} seq {s}"
            )


def test_dummy_weights_give_finite_logits_and_depend_on_the_seed(tmp_path):
    path = tiny_llama_dir(tmp_path)
    outs = []
    for seed in (0, 0, 1):
        cfg = model_config_for(path, load_format="dummy", seed=seed)
        model = load_model(cfg, cpu_context(), ModelRegistry())
        assert not model.training
        (logits,) = PagedSession(model).step([("a", [5, 6, 7, 8, 9])])
        assert logits.shape == (5, 512) and logits.dtype == torch.float32
        assert torch.isfinite(logits).all()
        outs.append(logits)
        norm = model.model.norm.weight
        assert torch.equal(norm, torch.ones_like(norm))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert not torch.allclose(outs[0], outs[2])


def test_tiny_llama_fixture_builds_loadable_variants(tiny_llama):
    from transformers import AutoTokenizer

    a, b = tiny_llama(), tiny_llama(num_key_value_heads=4, seed=1)
    assert a != b
    tok = AutoTokenizer.from_pretrained(a)
    assert (
        len(tok) == 512
        and tok.decode(tok.encode("Hello world!"), skip_special_tokens=True) == "Hello world!"
    )
    assert load_tiny(b).attention_specs()[0].num_kv_heads == 4
