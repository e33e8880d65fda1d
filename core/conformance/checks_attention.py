"""Conformance checks: ``forward`` against the reference for every kind of step.

Each check runs over every supported dtype and block size, with grouped-query (8 query /
2 KV heads) and multi-head (4 / 4) attention. Lengths are chosen around the block size
so that sequences end inside blocks and steps cross block boundaries; block tables are
shuffled. Every step's output is compared, not just the last.
"""

from __future__ import annotations

from collections.abc import Callable

from core.conformance.harness import (
    Failures,
    PagedCase,
    StepResult,
    case_grid,
    describe,
    make_spec,
    seeded,
)
from core.platform import Platform

NUM_BLOCKS = 40


def _prefill(case: PagedCase) -> list[StepResult]:
    """Prompts with no cached context, one of them a single token."""
    bs = case.spec.block_size
    seqs = [case.new_seq(n) for n in (bs + 3, 1, 2 * bs - 1)]
    return [case.step([(s, len(s.keys)) for s in seqs], label="prefill")]


def _chunked(case: PagedCase) -> list[StepResult]:
    """Prompts prefilled in chunks over their own cached context; chunk edges fall
    inside blocks and chunks cross block boundaries."""
    bs = case.spec.block_size
    a, b = case.new_seq(2 * bs + 5), case.new_seq(bs + 8)
    chunks = [((bs + 2, 3), "chunk 1"), ((bs - 1, bs + 4), "chunk 2"), ((4, 1), "chunk 3")]
    return [case.step([(a, na), (b, nb)], label=label) for (na, nb), label in chunks]


def _decode(case: PagedCase) -> list[StepResult]:
    """Decode steps over contexts stored with write_kv (the mixed scenario covers contexts
    stored by forward); one context fills its block exactly so the next token starts a
    new block."""
    bs = case.spec.block_size
    lens = (bs - 1, 2 * bs + 1, 5, bs)
    seqs = [case.new_seq(n + 3) for n in lens]
    for s, n in zip(seqs, lens):
        case.write(s, n)
    return [case.step([], seqs, label=f"decode step {i + 1}") for i in range(3)]


def _mixed(case: PagedCase) -> list[StepResult]:
    """Batches mixing a fresh prompt, a chunk over cached context, and decodes."""
    bs = case.spec.block_size
    a, b, c, d, e = (case.new_seq(n) for n in (bs + 7, bs + 9, 2 * bs + 1, 5, bs + 2))
    f = case.new_seq(10)
    results = [case.step([(b, bs + 1), (c, 2 * bs - 1), (d, 3), (e, bs)], label="setup prefill")]
    results.append(case.step([(a, bs + 5), (b, 7)], [c, d, e], label="mixed step 1"))
    results.append(case.step([(f, 9)], [a, b, c, d, e], label="mixed step 2"))
    return results


SCENARIOS: dict[str, Callable[[PagedCase], list[StepResult]]] = {
    "prefill": _prefill,
    "chunked prefill": _chunked,
    "decode": _decode,
    "mixed batch": _mixed,
}


def _run(platform: Platform, scenarios: list[str], what: str, window_blocks: float | None) -> None:
    f = Failures()
    for dtype, bs, heads in case_grid(platform):
        window = None if window_blocks is None else int(bs * window_blocks) + 3
        spec = make_spec(dtype, bs, heads, window)
        for name in scenarios:
            f.case()
            case = PagedCase(platform, spec, NUM_BLOCKS, seeded(what, name, dtype, bs, heads))
            prefix = describe(dtype, bs, heads) + (f"/window {window}" if window else "")
            for result in SCENARIOS[name](case):
                result.label = f"{prefix}/{name}/{result.label}"
                f.compare(result, dtype)
    f.raise_if_any(what)


def test_forward_prefill(core_platform: Platform) -> None:
    """forward on prompts with no cached context matches the reference."""
    _run(core_platform, ["prefill"], "prefill", None)


def test_forward_chunked_prefill(core_platform: Platform) -> None:
    """forward on prompt chunks over cached context matches the reference at every chunk."""
    _run(core_platform, ["chunked prefill"], "chunked prefill", None)


def test_forward_decode(core_platform: Platform) -> None:
    """forward on decode batches (one token per sequence) matches the reference."""
    _run(core_platform, ["decode"], "decode", None)


def test_forward_mixed_batch(core_platform: Platform) -> None:
    """forward on batches of prefills followed by decodes matches the reference."""
    _run(core_platform, ["mixed batch"], "mixed batch", None)


def test_forward_sliding_window(core_platform: Platform) -> None:
    """With a sliding window shorter than the contexts, chunked prefill and mixed batches
    (fresh prompts, chunks over context, decodes) match the reference."""
    _run(core_platform, ["chunked prefill", "mixed batch"], "sliding window", 0.5)
