"""Accuracy of the CPU's faster numeric options against the float32 reference, on the
embedded SmolLM2-135M-Instruct (Q4_1 GGUF) and a fixed set of chat prompts.

The float32 dense engine (token-identical to HF transformers, see test_smollm2_gguf.py)
generates ``N_TOKENS`` greedy tokens per chat. Each option then replays exactly those
tokens one decode step at a time (teacher forcing, so one early difference does not derail
the rest) and is scored on:

* top-1 agreement: the fraction of steps whose argmax equals the reference's;
* logit error: max and mean |logit - reference logit| over every step and vocabulary entry.

Measured on an AMD EPYC (Zen 4, AVX512-BF16), 6 chats x 48 tokens (docs/benchmarks/cpu.md):

================  =========  ===========  ============
option            agreement  max |dlog|   mean |dlog|
================  =========  ===========  ============
bfloat16 dense    0.976      1.76         0.120
bfloat16 + int4   0.983      0.84         0.107
bfloat16 + int8   0.965      1.56         0.188
================  =========  ===========  ============

The thresholds below leave room for other CPUs' kernels (summation order, no AVX-512) but
fail on a real defect: a wrong scale, a transposed group or a lost residual drops the
agreement far below 0.9 and moves logits by whole units on average.
"""

from __future__ import annotations

import pytest
import torch

from core import LLM, SamplingParams
from core.scheduler import ScheduledSequence, SchedulerOutput

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Explain photosynthesis in two sentences."}],
    [{"role": "user", "content": "Give me three tips for learning Python."}],
    [{"role": "user", "content": "What is 17 times 23?"}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and German."}],
]
SYSTEM = (
    "You are a patient assistant for a public library. Answer in plain English, keep every answer "
    "short and exact, say so when you do not know something, never invent titles, authors or "
    "opening hours, and offer to look things up in the catalogue when a question is about a book. "
    "The library opens at nine in the morning and closes at six in the evening on weekdays; on "
    "Saturdays it closes at one. Members may borrow up to twelve items for three weeks each."
)
LONG_CHATS = [[{"role": "system", "content": SYSTEM}, *chat] for chat in CHATS]
"""The same questions behind a system prompt: every prompt is over 64 tokens, so prompts take the
many-row kernels (more rows than ``GROUPED_MAX_ROWS``) rather than the decode-size ones."""
N_TOKENS = 48
OPTIONS = {
    # name: (engine arguments, min top-1 agreement, max |dlogit|, max mean |dlogit|)
    "bf16-dense": (dict(dtype="bfloat16"), 0.95, 3.0, 0.25),
    "bf16-int4": (dict(dtype="bfloat16", weight_format="int4"), 0.95, 3.0, 0.25),
    "bf16-int8": (dict(dtype="bfloat16", weight_format="int8"), 0.94, 3.0, 0.30),
    # The default where the CPU lacks native bf16 (AVX2, Arm): float32 activations, int4 / int8
    # codes in groups of 32 through csrc/cpu quant_linear (int8 activations), exact int8 LM head.
    "f32-int4": (dict(dtype="float32", weight_format="int4"), 0.95, 3.0, 0.25),
    "f32-int8": (dict(dtype="float32", weight_format="int8"), 0.95, 3.0, 0.25),
}
ENGINE = dict(max_model_len=512, kv_cache_memory="32MiB")


def teacher_forced_logits(llm: LLM, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Logits [len(continuation), vocab] predicting each continuation token: the prompt as
    one prefill step, then one decode step per token (the path decoding takes)."""
    runner = llm.engine.executor.runner
    ids = prompt + continuation
    blocks = tuple(range(1, 2 + len(ids) // runner.block_size))  # block 0 is reserved
    params = SamplingParams(temperature=0, max_tokens=1)

    def step(tokens: list[int], start: int) -> torch.Tensor:
        seq = ScheduledSequence(seq_id=0, request_id="tf", token_ids=tuple(tokens), start_pos=start,
                                block_table=blocks, sample=True, params=params, output_index=0)
        sched = SchedulerOutput(scheduled=(seq,), num_prefills=int(len(tokens) > 1),
                                num_batched_tokens=len(tokens))
        input_ids, positions, md = runner.prepare_inputs(sched)
        hidden = runner.model(input_ids, positions, runner.kv_caches, md)
        return runner.model.compute_logits(hidden[-1:])[0]

    with torch.inference_mode():
        rows = [step(prompt, 0)]
        rows += [step([ids[t]], t) for t in range(len(prompt), len(ids) - 1)]
    return torch.stack(rows)


def greedy(llm: LLM, chats) -> list[tuple[list[int], list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    outs = llm.chat(chats, params, use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(dtype="float32", weight_format="dense", **ENGINE)
    out = {}
    for key, chats in (("short", CHATS), ("long", LONG_CHATS)):
        runs = greedy(llm, chats)
        out[key] = runs, [teacher_forced_logits(llm, p, c) for p, c in runs]
    llm.engine.shutdown()
    assert min(len(p) for p, _ in out["long"][0]) > 64  # the long prompts are long
    return out


@pytest.mark.slow
@pytest.mark.parametrize("chats", ["short", "long"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_tracks_the_float32_reference(reference, name: str, chats: str) -> None:
    args, min_agree, max_err, max_mean = OPTIONS[name]
    runs, ref_logits = reference[chats]
    llm = LLM(**args, **ENGINE)
    agree = steps = 0
    worst = total = 0.0
    for (prompt, cont), ref in zip(runs, ref_logits):
        got = teacher_forced_logits(llm, prompt, cont)
        assert got.shape == ref.shape and got.dtype == torch.float32
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        steps += len(ref)
        diff = (got - ref).abs()
        worst = max(worst, float(diff.max()))
        total += float(diff.mean()) * len(ref)
    llm.engine.shutdown()
    agreement, mean = agree / steps, total / steps
    summary = f"{name}, {chats} prompts: agreement {agreement:.4f}, max |dlogit| {worst:.3f}, mean |dlogit| {mean:.4f}"
    print(summary)
    assert agreement >= min_agree, summary
    assert worst <= max_err, summary
    assert mean <= max_mean, summary
