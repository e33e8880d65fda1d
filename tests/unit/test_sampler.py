"""Sampler tests against independent references.

Penalties and warpers are compared with HF transformers' logits processors applied row by
row; presence/frequency with a naive Python OpenAI formula; logprobs with log_softmax.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from core.sampler import Sampler, prompt_logprobs
from core.sampling_params import SamplingParams
from core.scheduler import ScheduledSequence

EOS = 2


def row(params: SamplingParams, prompt=(), output=(), output_index=None) -> ScheduledSequence:
    output = tuple(output)
    return ScheduledSequence(
        seq_id=0,
        request_id="req",
        token_ids=(1,),
        start_pos=0,
        block_table=(0,),
        sample=True,
        params=params,
        output_index=len(output) if output_index is None else output_index,
        prompt_token_ids=tuple(prompt),
        output_token_ids=output,
    )


def hf_distribution(logits: torch.Tensor, p: SamplingParams, history=()) -> torch.Tensor:
    """HF transformers' processors in generate()'s order, for one row."""
    scores = logits[None].clone()
    ids = torch.tensor([list(history) or [0]])
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    if p.greedy:
        return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1])[0].float()
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return torch.softmax(scores, dim=-1)[0]


def assert_same_distribution(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(ours > 0, ref > 0), (
        f"surviving tokens differ: ours {int((ours > 0).sum())}, reference {int((ref > 0).sum())}"
    )
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-7)


WARPER_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.7, top_k=7),
    SamplingParams(top_k=1),
    SamplingParams(top_p=0.9),
    SamplingParams(temperature=0.8, top_p=0.5),
    SamplingParams(temperature=1.3, top_k=40, top_p=0.8),
    SamplingParams(top_k=300, top_p=0.95),
    SamplingParams(min_p=0.05),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.1),
    SamplingParams(temperature=2.0, top_p=0.97, min_p=0.01),
]


@pytest.mark.parametrize("candidates", [0, 256])
@pytest.mark.parametrize("scale", [0.5, 3.0])
@pytest.mark.parametrize("vocab", [50, 3000])
def test_warpers_match_hf(scale: float, vocab: int, candidates: int) -> None:
    # scale 0.5 over 3000 tokens makes nuclei larger than the top-p candidate window,
    # so the full-sort fallback is exercised as well as the candidate path;
    # candidates=0 always sorts.
    gen = torch.Generator().manual_seed(int(scale * 10) + vocab)
    logits = torch.randn(len(WARPER_PARAMS), vocab, generator=gen) * scale
    rows = [row(p) for p in WARPER_PARAMS]
    ours = Sampler(seed=0, top_p_candidates=candidates).distribution(logits, rows)
    for i, p in enumerate(WARPER_PARAMS):
        assert_same_distribution(ours[i], hf_distribution(logits[i], p))


def test_top_p_over_many_rows_mixes_candidate_and_sorted_rows() -> None:
    # 40 rows: peaked ones are settled among the candidates, flat ones need full sorts,
    # which run in blocks of rows; every row must still match HF exactly.
    gen = torch.Generator().manual_seed(9)
    vocab = 3000
    logits = torch.randn(40, vocab, generator=gen) * torch.tensor([0.3, 4.0] * 20)[:, None]
    params = [SamplingParams(temperature=0.5 + i / 40, top_p=0.5 + i / 90) for i in range(40)]
    ours = Sampler(seed=0).distribution(logits, [row(p) for p in params])
    for i, p in enumerate(params):
        assert_same_distribution(ours[i], hf_distribution(logits[i], p))


def test_repetition_penalty_matches_hf() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = 400
    logits = torch.randn(4, vocab, generator=gen) * 2
    histories = [
        ((3, 9, 9, 100), (7, 3)),
        ((1,), ()),
        (tuple(range(0, 400, 3)), (399, 0, 0)),
        ((5, 6), (5,)),
    ]
    params = [
        SamplingParams(repetition_penalty=1.3, temperature=0.7),
        SamplingParams(repetition_penalty=0.8, top_k=20),
        SamplingParams(repetition_penalty=2.0, top_p=0.9),
        SamplingParams(repetition_penalty=1.5, temperature=0.0),
    ]
    rows = [row(p, prompt, out) for p, (prompt, out) in zip(params, histories)]
    ours = Sampler(seed=0).distribution(logits, rows)
    for i, p in enumerate(params):
        prompt, out = histories[i]
        assert_same_distribution(ours[i], hf_distribution(logits[i], p, prompt + out))


def naive_processed(logits: torch.Tensor, r: ScheduledSequence, eos: int) -> torch.Tensor:
    """min_tokens, logit_bias, repetition, then OpenAI presence/frequency, one token at a time."""
    x = logits.tolist()
    p = r.params
    if r.output_index < p.min_tokens:
        for t in set(p.stop_token_ids) | ({eos} if not p.ignore_eos else set()):
            x[t] = -math.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(r.prompt_token_ids) | set(r.output_token_ids):
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, count in collections.Counter(r.output_token_ids).items():
        x[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return torch.tensor(x)


def test_penalties_bias_min_tokens_match_naive_openai_formula() -> None:
    gen = torch.Generator().manual_seed(2)
    vocab = 300
    cases = [
        (SamplingParams(presence_penalty=0.7), (4, 5), (10, 10, 11, 10)),
        (SamplingParams(frequency_penalty=1.1), (4,), (10, 10, 11, 12, 12, 12)),
        (SamplingParams(presence_penalty=-1.5, frequency_penalty=-0.4), (1,), (3, 3, 3)),
        (SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), (1,), ()),
        (
            SamplingParams(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2),
            (8, 9, 10),
            (10, 20, 20),
        ),
        (SamplingParams(logit_bias={0: 5.0, 299: -30.0, 17: 100.0}), (), ()),
        (SamplingParams(min_tokens=3, stop_token_ids=(7, 8)), (), (1, 1)),
        (SamplingParams(min_tokens=3, stop_token_ids=(7,), ignore_eos=True), (), (1,)),
        (SamplingParams(min_tokens=2, stop_token_ids=(7,)), (), (1, 1)),  # reached: no mask
    ]
    rows = [row(p, prompt, out) for p, prompt, out in cases]
    logits = torch.randn(len(rows), vocab, generator=gen) * 3
    ours = Sampler(frozenset({EOS}), seed=0).distribution(logits, rows)
    for i, r in enumerate(rows):
        ref = torch.softmax(naive_processed(logits[i], r, EOS), dim=-1)
        assert_same_distribution(ours[i], ref)
    assert ours[6, [EOS, 7, 8]].sum() == 0 and ours[7, EOS] > 0 and ours[7, 7] == 0
    assert ours[8, [EOS, 7]].min() > 0


def test_greedy_is_argmax_of_raw_or_processed_logits() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(33, 5000, generator=gen)
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(33)]
    out = Sampler(seed=0)(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    # Mixed with random rows and processing, greedy rows take the processed argmax.
    top = logits.argmax(-1)
    rows[0] = row(SamplingParams(temperature=0.0, logit_bias={int(top[0]): -100.0}))
    rows[1] = row(SamplingParams(temperature=0.9, top_p=0.5))
    out = Sampler(seed=0)(logits, rows)
    masked = logits[0].clone()
    masked[top[0]] = -1e9
    assert out.token_ids[0] == int(masked.argmax())
    assert out.token_ids[2:] == top[2:].tolist()


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    gen = torch.Generator().manual_seed(4)
    vocab = 1000
    logits = torch.randn(5, vocab, generator=gen) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=1.5, logprobs=3),
        SamplingParams(temperature=0.5, top_k=10, repetition_penalty=1.5),
        SamplingParams(temperature=3.0, logprobs=0),
        SamplingParams(temperature=5.0, logprobs=2, logit_bias={11: -100.0, 12: 100.0}),
    ]
    rows = [row(p, prompt=(1, 2), output=(3,)) for p in params]
    out = Sampler(seed=7)(logits, rows)
    ref = torch.log_softmax(logits, dim=-1)
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(float(ref[i, tok]), abs=1e-5)
        k = params[i].logprobs
        if k is None:
            assert out.top_logprobs[i] is None
            continue
        d = out.top_logprobs[i]
        order = ref[i].argsort(descending=True).tolist()
        for rank, t in enumerate(order[:k], start=1):
            assert d[t].rank == rank and d[t].logprob == pytest.approx(float(ref[i, t]), abs=1e-5)
        assert d[tok].rank == order.index(tok) + 1
        assert set(d) == set(order[:k]) | {tok}
    assert out.token_ids[4] == 12  # bias changes what is drawn, not the reported logprob


def test_prompt_logprobs_helper() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 200, generator=gen)
    nxt = torch.randint(0, 200, (6,), generator=gen)
    ref = torch.log_softmax(logits, dim=-1)
    for k in (0, 4):
        out = prompt_logprobs(logits, nxt, k)
        assert len(out) == 6
        for i, d in enumerate(out):
            order = ref[i].argsort(descending=True).tolist()
            t = int(nxt[i])
            assert d[t].logprob == pytest.approx(float(ref[i, t]), abs=1e-5)
            assert d[t].rank == order.index(t) + 1
            assert set(d) == set(order[:k]) | {t}
    assert prompt_logprobs(torch.empty(0, 200), torch.empty(0, dtype=torch.long), 3) == []


def test_seeded_row_is_independent_of_the_batch() -> None:
    gen = torch.Generator().manual_seed(6)
    vocab = 2000
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(top_k=5, seed=99),
        SamplingParams(temperature=0.5, top_p=0.5, min_p=0.2),
        SamplingParams(repetition_penalty=1.4, frequency_penalty=0.5),
        SamplingParams(top_k=1000, top_p=0.99),
        SamplingParams(logit_bias={5: 10.0}, logprobs=3),
        SamplingParams(min_p=0.3, temperature=2.0),
    ] * 2
    alone_sampler, batch_sampler = Sampler(seed=1), Sampler(seed=2)
    alone_tokens, batch_tokens, history = [], [], []
    for step in range(25):
        logits = torch.randn(17, vocab, generator=gen) * 2.5
        pos = step % 17
        batch_rows = [row(p, (1, 2, 3), history) for p in others]
        batch_rows.insert(pos, row(seeded, (1, 2, 3), history))
        alone = alone_sampler(logits[pos : pos + 1].clone(), [row(seeded, (1, 2, 3), history)])
        batch = batch_sampler(logits, batch_rows)
        alone_tokens.append(alone.token_ids[0])
        batch_tokens.append(batch.token_ids[pos])
        history = (*history, alone.token_ids[0])
    assert alone_tokens == batch_tokens
    assert len(set(alone_tokens)) > 5  # really sampled, not stuck on one token


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


def test_sampling_frequencies_follow_the_distribution() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 10000
    logits = torch.tensor(probs).log().expand(n, 4).contiguous()
    sampler = Sampler(seed=0)
    unseeded = sampler(logits, [row(SamplingParams())] * n).token_ids
    seeded = sampler(logits, [row(SamplingParams(seed=i)) for i in range(n)]).token_ids
    steps = sampler(logits, [row(SamplingParams(seed=42), output_index=i) for i in range(n)])
    # 3 degrees of freedom: P(chi2 > 25) < 2e-5; the seeds make the outcome fixed anyway.
    for tokens in (unseeded, seeded, steps.token_ids):
        counts = collections.Counter(tokens)
        assert chi_square([counts[t] for t in range(4)], probs) < 25
    top2 = sampler(logits, [row(SamplingParams(top_k=2, seed=i)) for i in range(n)]).token_ids
    counts = collections.Counter(top2)
    assert set(counts) == {2, 3}
    assert chi_square([counts[2], counts[3]], [3 / 7, 4 / 7]) < 20


def test_sampling_across_chunks_and_tail() -> None:
    # Mass on tokens straddling the 1024-token chunks and the ragged tail.
    vocab = 3000
    support = [0, 1023, 1024, 2047, 2048, 2999]
    probs = [0.05, 0.15, 0.2, 0.1, 0.3, 0.2]
    logits = torch.full((1, vocab), -math.inf)
    logits[0, support] = torch.tensor(probs).log()
    n = 8000
    out = Sampler(seed=3)(logits.expand(n, vocab).contiguous(), [row(SamplingParams())] * n)
    counts = collections.Counter(out.token_ids)
    assert set(counts) <= set(support)
    assert chi_square([counts[t] for t in support], probs) < 30  # 5 dof


def test_padded_vocab_columns_are_never_sampled() -> None:
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 130, generator=gen)
    logits[:, 100:] = 50.0  # LM-head padding that must be ignored
    rows = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=2.0)),
        row(SamplingParams(top_p=0.99, seed=1)),
        row(SamplingParams(logprobs=2)),
    ]
    out = Sampler(seed=0)(logits, rows, vocab_size=100)
    assert all(t < 100 for t in out.token_ids)
    ref = torch.log_softmax(logits[:, :100], dim=-1)
    assert out.logprobs[0] == pytest.approx(float(ref[0].max()), abs=1e-5)


def test_errors_name_the_problem() -> None:
    logits = torch.randn(2, 50)
    with pytest.raises(ValueError, match=r"shape \(2, 50\) for 3 rows"):
        Sampler()(logits, [row(SamplingParams())] * 3)
    with pytest.raises(ValueError, match=r"logit_bias contains token id\(s\) \[77\]"):
        Sampler()(logits, [row(SamplingParams(logit_bias={77: 1.0}))] * 2)
    with pytest.raises(ValueError, match="scheduler must fill"):
        Sampler()(logits, [row(SamplingParams(presence_penalty=1.0), output_index=3)] * 2)
    with pytest.raises(ValueError, match="vocab_size 60 is larger"):
        Sampler()(logits, [row(SamplingParams())] * 2, vocab_size=60)
    assert Sampler()(torch.empty(0, 50), []).token_ids == []


def test_extreme_penalty_and_top_p_do_not_crash():
    """Found by schemathesis against the server: denormal top_p and repetition_penalty
    overflowed the logits and left top-p with no candidate."""
    torch.manual_seed(0)
    logits = torch.randn(2, 300) * 3
    p = SamplingParams(temperature=1.0, top_p=5e-324, repetition_penalty=5e-324)
    rows = [row(p, prompt=(1, 2, 3)), row(p, prompt=(4, 5))]
    out = Sampler()(logits, rows)
    assert all(0 <= t < 300 for t in out.token_ids)
    # with top_p this small only the single most likely (penalised) token may be drawn
    for i, row_tokens in enumerate([(1, 2, 3), (4, 5)]):
        work = logits[i].clone()
        for t in row_tokens:
            work[t] = work[t] / 5e-324 if work[t] > 0 else work[t] * 5e-324
        work = torch.nan_to_num(work, nan=float("-inf"), posinf=torch.finfo(work.dtype).max)
        assert out.token_ids[i] == int(work.argmax())


def test_sample_tensors_equals_the_call() -> None:
    """The read-back-free entry point draws what __call__ draws (same generator state)."""
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.2, top_p=0.8, min_p=0.01),
        SamplingParams(seed=5),
    ]
    rows = [row(p, output_index=2) for p in params]
    logits = torch.randn(len(rows), 500, generator=torch.Generator().manual_seed(3)) * 2
    out = Sampler(seed=9)(logits, rows)
    tokens, logprobs = Sampler(seed=9).sample_tensors(logits, rows)
    assert tokens.tolist() == out.token_ids
    torch.testing.assert_close(logprobs.double(), torch.tensor(out.logprobs, dtype=torch.double))
    want = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, want)


@pytest.mark.parametrize("vocab", [4097, 3000, 1024])
def test_largest_uniform_draws_a_token_with_weight(vocab: int) -> None:
    """u = 1 - 2**-53 (the largest draw) with all the weight in the first chunk and empty
    chunks after it: the pick must be the last token that has weight, never a later one
    (an empty chunk, or padding columns past the vocabulary)."""
    from core.sampler.draw import inverse_cdf as _inverse_cdf

    g = torch.Generator().manual_seed(vocab)
    p = torch.zeros(3, vocab)
    p[:, :700] = torch.rand(3, 700, generator=g) + 0.1
    u = torch.full((3,), 1.0 - 2.0**-53, dtype=torch.float64)
    tokens = _inverse_cdf(p, u)
    assert bool((tokens < vocab).all()), tokens
    assert bool((p.gather(1, tokens[:, None]) > 0).all()), tokens
    last = p.gt(0).cumsum(dim=-1).argmax(dim=-1)  # the last token with weight
    assert tokens.tolist() == last.tolist()


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
     SamplingParams(top_k=5, min_p=0.1)],
    ids=["t1", "top_p", "top_k+min_p"],
)
def test_an_infinite_logit_is_drawn_not_an_index_past_the_vocabulary(params) -> None:
    """A +inf logit (e.g. an fp16 overflow upstream) leaves no finite weights; the row must
    still get a real token — the infinite one — and the other rows their normal draws."""
    logits = torch.randn(3, 3000, generator=torch.Generator().manual_seed(5))
    logits[1, 2] = float("inf")
    rows = [row(params, output_index=1) for _ in range(3)]
    out = Sampler(seed=1)(logits, rows)
    assert out.token_ids[1] == 2
    finite = logits.clone()
    finite[1] = 0.0
    ref = Sampler(seed=1)(finite, rows)
    assert [out.token_ids[0], out.token_ids[2]] == [ref.token_ids[0], ref.token_ids[2]]
