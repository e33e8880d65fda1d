"""A tiny random Llama with a locally trained tokenizer, for the end-to-end check.

Self-contained (the suite runs in a vendor's repository, where our ``tests/`` does not
exist) and offline: the weights are seeded random ``transformers`` weights saved as
safetensors, the tokenizer a byte-level BPE trained on a fixed synthetic corpus with the
``tokenizers`` library. Head size 64 so that paged kernels with a fixed set of head sizes
can run it.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

TINY_LLAMA = dict(
    vocab_size=384,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    # Larger than HF's 0.02 so logits are spread out and greedy picks are not near-ties
    # that different (correct) summation orders could flip.
    initializer_range=0.2,
)
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    parts = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "the", "and", "ing", "er", "on"]
    words = ["".join(rng.choices(parts, k=rng.randint(1, 3))) for _ in range(200)]
    words += ["Hello", "world", "The", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]
    return [" ".join(rng.choices(words, k=10)) + rng.choice(".!?,") for _ in range(300)]


def build_tokenizer(vocab_size: int, seed: int = 0, chat_template: str | None = None):
    """A byte-level BPE ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` tokens that
    prepends ``<s>`` (every string encodes, every id decodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer)
    if tok.get_vocab_size() < vocab_size:  # a small corpus may yield fewer merges
        tok.add_tokens([f"<extra_{i}>" for i in range(vocab_size - tok.get_vocab_size())])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=chat_template,
    )


def build_tiny_llama(path: Path, seed: int = 0) -> Path:
    """Write the seeded random Llama and its tokenizer to ``path``; return ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng():  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)  # safetensors
    build_tokenizer(TINY_LLAMA["vocab_size"], seed).save_pretrained(path)
    return path


def hf_greedy(path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations by ``transformers`` itself (full recompute each step, fp32)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path).float().eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            for _ in range(max_tokens):
                nxt = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            outputs.append(ids[0, len(prompt) :].tolist())
    return outputs
