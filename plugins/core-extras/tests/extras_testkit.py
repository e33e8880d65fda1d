"""Builders and references shared by the core-extras tests (uniquely named so several
plugins' suites can share one pytest session)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_OLMO = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    attention_bias=True,
    clip_qkv=1.5,  # below the projections' spread at initializer_range 0.2: clipping happens
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    initializer_range=0.2,
)


def build_tiny_olmo(path: Path, seed: int = 0, **overrides) -> Path:
    """A seeded random transformers OLMo saved as safetensors, with a matching tokenizer.
    Biases (zeros in a fresh HF model) get random values, so loading them wrongly shows."""
    from transformers import OlmoConfig, OlmoForCausalLM

    from core.conformance.tiny_model import build_tokenizer

    config = OlmoConfig(**{**TINY_OLMO, **overrides})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = OlmoForCausalLM(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.2)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    build_tokenizer(config.vocab_size, seed).save_pretrained(path)
    return path


def hf_greedy(path: Path, prompts: list[list[int]], max_tokens: int):
    """transformers' own greedy continuation (full recompute per token, fp32) and the
    log-softmax row of every chosen token: ``[(tokens, logprobs)]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids, chosen = torch.tensor([prompt]), []
            for _ in range(max_tokens):
                logprobs = model(ids).logits[0, -1].float().log_softmax(-1)
                nxt = int(logprobs.argmax())
                chosen.append(float(logprobs[nxt]))
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            results.append((ids[0, len(prompt):].tolist(), chosen))
    return results


def engine_ops(llm):
    """The op table one LLM's model runs with. core has no public accessor for it, so this
    reaches through the in-process executor (UniExecutor -> ModelRunner -> RunnerSetup)."""
    return llm.engine.executor.runner.setup.ops


def engine_kv_caches(llm):
    """The per-layer KV-cache tensors of one LLM (same reach-through as :func:`engine_ops`)."""
    return llm.engine.executor.runner.kv_caches
