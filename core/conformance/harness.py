"""What the conformance checks share: a paged-cache driver with logical K/V, tolerances.

:class:`PagedCase` holds one layer's cache for a platform's backend and sequences whose
keys, values and queries are drawn from a seeded generator (normal, never zeros). Blocks
are handed out from a shuffled pool, so block tables are non-contiguous and unordered;
block 0 is never handed out (it is the null block that padded table entries point to).
Every cache starts filled with :data:`SENTINEL`, so a read of a slot nobody wrote shows in
the output and a stray write shows in :meth:`PagedCase.sentinel_count`.

The expected output of a step is :func:`core.attention.reference_attention` over the
sequence's logical K/V — never anything the backend produced.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from core.attention import AttentionBackend, AttentionSpec, reference_attention
from core.batch_shape import BatchShaper, HostStep
from core.platform import Platform

SENTINEL = 100.0
"""Poison value of unwritten cache elements: exact in fp32/bf16/fp16 and far outside the
range of the standard-normal data the checks write."""

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
"""(atol, rtol) of a backend's output against the float64 reference rounded to the dtype.
fp32 is tight (different summation order only); fp16/bf16 allow a few units in the last
place of the inputs' precision (bf16 keeps 8 mantissa bits, fp16 11), since kernels may
keep probabilities or partial sums in the low-precision type."""

HEAD_CONFIGS: dict[str, tuple[int, int]] = {"gqa": (8, 2), "mha": (4, 4)}
"""name -> (query heads, KV heads) the attention checks run with."""

HEAD_SIZE = 64
"""Head size of the checks: one that every paged kernel we know of supports."""


def seeded(*parts: object) -> torch.Generator:
    """A CPU generator seeded from the parts (stable across runs and processes)."""
    text = "/".join(str(p) for p in parts)
    return torch.Generator().manual_seed(sum((i + 1) * ord(c) for i, c in enumerate(text)))


def make_spec(dtype: torch.dtype, block_size: int, heads: str = "gqa", window: int | None = None):
    num_heads, num_kv_heads = HEAD_CONFIGS[heads]
    return AttentionSpec(num_heads, num_kv_heads, HEAD_SIZE, dtype, block_size, sliding_window=window)


@dataclass
class Seq:
    """One sequence: logical K/V/queries of all its tokens and the blocks holding them."""

    keys: torch.Tensor  # [L, kvh, D] on CPU
    values: torch.Tensor  # [L, kvh, D] on CPU
    queries: torch.Tensor  # [L, H, D] on CPU
    blocks: list[int]
    cached: int = 0
    """Tokens already written to the cache."""


@dataclass
class StepResult:
    output: torch.Tensor
    """Backend output, on CPU."""
    expected: torch.Tensor
    """Reference output, on CPU."""
    label: str


@dataclass
class PagedCase:
    """One layer's paged cache on one platform plus the sequences living in it."""

    platform: Platform
    spec: AttentionSpec
    num_blocks: int
    gen: torch.Generator
    backend: AttentionBackend = field(init=False)
    device: torch.device = field(init=False)
    cache: torch.Tensor = field(init=False)
    free: list[int] = field(init=False)
    shaper: BatchShaper | None = field(init=False)
    """The platform's batch shaper (None: exact shapes); every step goes through it, as
    in the engine, so a static-shape backend is checked on the metadata it receives."""

    def __post_init__(self) -> None:
        self.backend = self.platform.attention_backend_class(self.spec)(self.spec)
        self.shaper = self.platform.batch_shaper(self.spec.block_size)
        self.device = self.platform.device(0)
        self.cache = self.new_cache()
        self.free = list(range(1, self.num_blocks))
        random.Random(int(torch.randint(0, 2**31, (1,), generator=self.gen))).shuffle(self.free)

    def new_cache(self, num_blocks: int | None = None, device=None) -> torch.Tensor:
        cache = self.backend.allocate_kv_cache(num_blocks or self.num_blocks, device or self.device)
        return cache.fill_(SENTINEL)

    def randn(self, *shape: int, offset: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) + offset).to(self.spec.dtype)

    def new_seq(self, length: int) -> Seq:
        s = self.spec
        need = -(-length // s.block_size)
        if need > len(self.free):
            raise ValueError(f"case needs {need} more blocks but {len(self.free)} are free")
        blocks = [self.free.pop() for _ in range(need)]
        return Seq(
            self.randn(length, s.num_kv_heads, s.head_size),
            self.randn(length, s.num_kv_heads, s.head_size),
            self.randn(length, s.num_heads, s.head_size),
            blocks,
        )

    def slots(self, seq: Seq, start: int, stop: int, blocks: list[int] | None = None) -> list[int]:
        bs, table = self.spec.block_size, blocks or seq.blocks
        return [table[p // bs] * bs + p % bs for p in range(start, stop)]

    def sentinel_count(self, cache: torch.Tensor | None = None) -> int:
        return int(((self.cache if cache is None else cache) == SENTINEL).sum())

    # ---- writing and attending --------------------------------------------------------
    def write(self, seq: Seq, stop: int, cache: torch.Tensor | None = None) -> None:
        """Store tokens [cached, stop) of ``seq`` with the backend's ``write_kv``."""
        slots = torch.tensor(self.slots(seq, seq.cached, stop), dtype=torch.int64)
        rows = slice(seq.cached, stop)
        self.backend.write_kv(
            seq.keys[rows].to(self.device),
            seq.values[rows].to(self.device),
            self.cache if cache is None else cache,
            slots.to(self.device),
        )
        seq.cached = stop

    def step(
        self,
        prefills: list[tuple[Seq, int]],
        decodes: list[Seq] = (),
        tables: dict[int, list[int]] | None = None,
        cache: torch.Tensor | None = None,
        label: str = "",
    ) -> StepResult:
        """One forward: each prefill adds its given number of tokens, each decode one.

        :param tables: optional ``id(seq) -> blocks`` to attend through other block ids.
        """
        entries = [*prefills, *[(d, 1) for d in decodes]]
        tables = tables or {}
        md, q, k, v = self._batch(entries, len(prefills), tables)
        with torch.inference_mode():
            out = self.backend.forward(q, k, v, self.cache if cache is None else cache, md)
        real = sum(n for _, n in entries)  # a shaped step's padding rows come after them
        expected = reference_attention(
            q.cpu()[:real],
            [s.keys[: s.cached + n] for s, n in entries],
            [s.values[: s.cached + n] for s, n in entries],
            [n for _, n in entries],
            self.spec.softmax_scale,
            self.spec.sliding_window,
        )
        for s, n in entries:
            s.cached += n
        return StepResult(out.cpu()[:real], expected, label)

    def _batch(self, entries, num_prefills: int, tables: dict[int, list[int]]):
        """Metadata and q/k/v of a step, shaped by the platform's batch shaper if it has
        one (padding rows of q/k/v are zeros: never written, their output is dropped)."""
        q, k, v, slots, ctx, qlens, rows = [], [], [], [], [], [], []
        for s, n in entries:
            new = slice(s.cached, s.cached + n)
            q.append(s.queries[new])
            k.append(s.keys[new])
            v.append(s.values[new])
            blocks = tables.get(id(s), s.blocks)
            slots += self.slots(s, s.cached, s.cached + n, blocks)
            ctx.append(s.cached)
            qlens.append(n)
            rows.append(blocks[: -(-(s.cached + n) // self.spec.block_size)])
        width = max(len(r) for r in rows) + 1  # one extra null column, as runners pad
        table = np.zeros((len(rows), width), dtype=np.int32)
        for i, r in enumerate(rows):
            table[i, : len(r)] = r
        none = np.zeros(len(slots), dtype=np.int64)  # ids, positions: not read here
        step = HostStep(
            none, none, np.asarray(slots, dtype=np.int64), none, np.asarray(qlens, dtype=np.int64),
            np.asarray(ctx, dtype=np.int64), table, num_prefills,
        )
        if self.shaper is not None:
            step = self.shaper.shape(step)
        md = step.upload(self.device, self.spec.block_size)[3]
        padded = []
        for t in (q, k, v):
            flat = torch.cat(t)
            pad = flat.new_zeros(md.slot_mapping.shape[0] - flat.shape[0], *flat.shape[1:])
            padded.append(torch.cat([flat, pad]).to(self.device))
        return md, *padded


# ---- comparing and reporting ----------------------------------------------------------------


def mismatch(result: StepResult, dtype: torch.dtype) -> str | None:
    """None if the output matches the reference within the dtype's tolerance, else why."""
    atol, rtol = TOLERANCES[dtype]
    out, exp = result.output.double(), result.expected.double()
    if out.shape != exp.shape:
        return f"{result.label}: output shape {tuple(out.shape)}, expected {tuple(exp.shape)}"
    bad = ~torch.isclose(out, exp, atol=atol, rtol=rtol)
    if not bool(bad.any()):
        return None
    err = (out - exp).abs().nan_to_num(float("inf"))
    row = int(bad.any(-1).any(-1).nonzero()[0])
    return (
        f"{result.label}: {int(bad.sum())}/{bad.numel()} elements differ from the reference "
        f"(max |diff| {float(err.max()):.3g}, atol {atol}, rtol {rtol}; first bad token row {row})"
    )


class Failures:
    """Collects failures over a check's cases so one run reports all of them."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.cases = 0

    def case(self) -> None:
        self.cases += 1

    def expect(self, ok: bool, message: str) -> None:
        if not ok:
            self.items.append(message)

    def compare(self, result: StepResult, dtype: torch.dtype) -> None:
        problem = mismatch(result, dtype)
        if problem:
            self.items.append(problem)

    def raise_if_any(self, what: str) -> None:
        if self.items:
            shown = "\n  ".join(self.items[:20])
            more = f"\n  ... and {len(self.items) - 20} more" if len(self.items) > 20 else ""
            raise AssertionError(
                f"{what}: {len(self.items)} failure(s) over {self.cases} case(s):\n  {shown}{more}"
            )


def case_grid(platform: Platform) -> list[tuple[torch.dtype, int, str]]:
    """(dtype, block size, head config) covering every supported dtype x block size.

    The preferred (first) dtype runs every head config at every block size; the other
    dtypes alternate head configs over the block sizes (each still sees both when the
    platform has two or more block sizes), which keeps the suite fast on a CPU.
    """
    dtypes, sizes, heads = platform.supported_dtypes(), platform.supported_block_sizes(), list(HEAD_CONFIGS)
    grid = [(dtypes[0], bs, h) for bs in sizes for h in heads]
    for i, dtype in enumerate(dtypes[1:]):
        grid += [(dtype, bs, heads[(i + j) % len(heads)]) for j, bs in enumerate(sizes)]
    return grid


def describe(dtype: torch.dtype, block_size: int, heads: str) -> str:
    return f"{str(dtype).removeprefix('torch.')}/block {block_size}/{heads}"
