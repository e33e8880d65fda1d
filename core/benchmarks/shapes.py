"""Model directories of a known shape for benchmarks with ``--load-format dummy``.

``python -m core.benchmarks.shapes llama3-8b DIR`` writes an HF ``config.json`` of that
shape and a word-level tokenizer covering its whole vocabulary (token ``i`` is the word
``t<i>``), so the engine starts with random weights and no download: the speed of a model
depends on its shape, not on its weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SHAPES = {
    "llama3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, rope_theta=500000.0,
    ),
    # MoE shapes (issue 21): every expert's weights, bf16 ~93 GB / ~61 GB, one H200 each.
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral",
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
        rope_theta=1e6, sliding_window=None,
    ),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        vocab_size=151936, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
    ),
    # Same vocabulary and head layout in miniature: checks the pipeline on a CPU.
    "llama3-tiny": dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=128256,
        max_position_embeddings=8192, rope_theta=500000.0,
    ),
}


def write_model_dir(shape: str, path: str | Path) -> Path:
    """Write config.json and tokenizer files for ``shape`` (a key of :data:`SHAPES`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    dims = SHAPES[shape]
    vocab = dims["vocab_size"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": vocab - 256, "eos_token_id": vocab - 255, **dims,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": f"t{vocab - 256}", "eos_token": f"t{vocab - 255}",
    }))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("path")
    ns = p.parse_args(argv)
    print(write_model_dir(ns.shape, ns.path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
