"""Vectorized sampler: one pass over the whole batch with per-row parameters.

Pipeline for each row (the order vLLM uses; HF transformers applies the same warpers in the
same order):

1. ``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` get ``-inf`` until the
   sequence has generated ``min_tokens`` tokens.
2. ``logit_bias`` is added.
3. Repetition penalty (HF definition, over prompt + output tokens), then presence and
   frequency penalties (OpenAI definition, over output tokens only).
4. Temperature. (Implemented as one division of the whole batch *first*, with the bias and
   penalty amounts divided alike: every step above commutes with a positive scale, and the
   division doubles as the copy that keeps the raw logits intact.)
5. Greedy rows (temperature 0) take the argmax and skip the rest.
6. Top-k, top-p (on the top-k survivors, renormalised) and min-p. Each filter becomes one
   cut-off value per row; a token survives when its scaled logit is at least the row's
   largest cut-off, so ties are always kept or dropped together.
7. One uniform number per row picks the token by inverse CDF over the survivors in
   vocabulary order. A seeded row draws its number from (seed, output_index) only, so the
   token it gets does not depend on what else is in the batch.

Logprobs are ``log_softmax`` of the *raw* model logits (vLLM's default ``raw_logprobs``
mode): what the model thinks, before penalties, bias, temperature and filters.

On an accelerator the sampler does not wait for the device until it reads the result: which
stages run and on which rows is decided from the rows' parameters on the host, and small
host tensors reach the device through pinned memory with non-blocking copies. (Each
``bool(t.any())`` or blocking copy would drain the stream, idling the GPU for a round trip:
at batch 1 on an H200 those waits cost more than the sampling itself.) The exceptions are
the stages that need data-dependent sizes or decisions: token penalties, logit bias,
``min_tokens``, top-p (one read of whether every row's nucleus fits in its candidates),
and requested logprobs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from core.outputs import Logprob
from core.scheduler import ScheduledSequence

_CDF_CHUNK = 1024
"""Inverse CDF works on chunks of this many tokens: a float32 sum per chunk, a float64
cumulative sum over chunks, then a float64 cumulative sum inside the chosen chunk only.
This keeps each token's share exact to ~1e-7 of its chunk's mass without a float64 pass
over the whole vocabulary."""

_TOP_P_CANDIDATES = 256
"""Default for ``Sampler(top_p_candidates=...)``."""

_SORT_ROWS = 16
"""Rows per full sort in the top-p fallback (16 x 128k floats = 8 MB per temporary)."""

_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplerOutput:
    """The sampler's result for one step; lists are in the order of the input rows."""

    token_ids: list[int]
    """The chosen token of each row."""
    logprobs: list[float]
    """log_softmax of the raw model logits at the chosen token (before any processing)."""
    top_logprobs: list[dict[int, Logprob] | None]
    """When ``params.logprobs`` is set: the top-k raw logprobs plus the chosen token, each
    with its rank (1 = most likely); otherwise None."""


class _Scratch:
    """Buffers reused across calls, by role name.

    On CPU a fresh [256, 128k] float32 tensor costs more in page faults (~50 ms) than the
    arithmetic done in it (~7 ms for a subtraction), and the allocator returns such blocks
    to the OS each time; reusing them removes that cost. Roles and lifetimes in one call:
    ``exp`` (logsumexp temporary, then the sampling weights), ``work`` (scaled logits, then
    the logprob rows), ``rows`` (the random rows of ``work``), ``sub`` (row subsets inside
    the filters), ``mask`` (comparison masks). No buffer escapes a call.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(
        self,
        name: str,
        shape: tuple[int, ...],
        like: torch.Tensor,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        dtype = dtype or like.dtype
        n = 1
        for d in shape:
            n *= d
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != like.device:
            buf = torch.empty(n, dtype=dtype, device=like.device)
            self._bufs[name] = buf
        return buf[:n].view(shape)

    def rows(self, name: str, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x[idx]: x itself when idx is every row, else a copy into buffer ``name``."""
        if len(idx) == x.shape[0]:
            return x
        return torch.index_select(x, 0, idx, out=self.get(name, (len(idx), x.shape[1]), x))


def _to_device(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device):
    """Host values as a tensor on ``device``, without waiting for the device: on CUDA (and
    ROCm, whose torch device type is also ``cuda``) through pinned memory and a
    non-blocking copy, since a blocking copy first waits for everything queued on the
    stream; other devices get a plain copy. The caching host allocator keeps the pinned block
    until the copy is done."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    t = t.to(dtype)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass(frozen=True)
class _Batch:
    """Per-row parameters of one step, kept on the host: which rows are greedy and which
    optional stages run are host decisions, never device reads."""

    greedy_rows: list[int]
    random_rows: list[int]
    temperatures: list[float]  # 1 for greedy rows (never used for them)
    top_k: list[int]  # 0 = off
    top_p: list[float]  # 1 = off
    min_p: list[float]  # 0 = off
    scaled: bool  # some row's temperature is not 1
    needs_processing: bool  # any min_tokens mask, logit bias or penalty this step
    device: torch.device

    @staticmethod
    def build(rows: Sequence[ScheduledSequence], vocab_size: int, device: torch.device) -> _Batch:
        ps = [r.params for r in rows]
        greedy = [p.greedy for p in ps]
        temps = [1.0 if g else p.temperature for g, p in zip(greedy, ps)]
        processing = any(
            p.logit_bias or p.needs_token_history or r.output_index < p.min_tokens
            for r, p in zip(rows, ps)
        )
        return _Batch(
            greedy_rows=[i for i, g in enumerate(greedy) if g],
            random_rows=[i for i, g in enumerate(greedy) if not g],
            temperatures=temps,
            top_k=[p.top_k if 0 < p.top_k < vocab_size else 0 for p in ps],
            top_p=[p.top_p for p in ps],
            min_p=[p.min_p for p in ps],
            scaled=any(t != 1.0 for t in temps),
            needs_processing=processing,
            device=device,
        )

    def temperature(self) -> torch.Tensor:
        """[B] float32 on the device."""
        return _to_device(self.temperatures, torch.float32, self.device)

    def index(self, rows: list[int]) -> torch.Tensor:
        return _to_device(rows, torch.int64, self.device)


class Sampler:
    """Turns one step's logits into tokens and logprobs for every scheduled row.

    An instance keeps scratch buffers between calls, so it must not be called from two
    threads at once (the engine calls it from its step loop only).

    :param eos_token_ids: the model's end-of-sequence ids, masked while a row is below its
        ``min_tokens`` (unless the row sets ``ignore_eos``).
    :param seed: seeds the generator used by rows without their own seed; None draws a
        fresh seed from the OS.
    :param top_p_candidates: top-p first looks for its cut-off among this many most likely
        tokens of a row and sorts the whole row only when the nucleus is larger (0: always
        sort, the textbook method). The result is the same either way.
    """

    def __init__(
        self,
        eos_token_ids: frozenset[int] = frozenset(),
        seed: int | None = None,
        top_p_candidates: int = _TOP_P_CANDIDATES,
    ):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.top_p_candidates = top_p_candidates
        self._ws = _Scratch()
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[ScheduledSequence],
        vocab_size: int | None = None,
    ) -> SamplerOutput:
        """Sample one token per row.

        :param logits: [len(rows), V'] float32, one row per sampled sequence, same order
        :param rows: the scheduled sequences with ``sample=True``
        :param vocab_size: the real vocabulary; columns beyond it (padding of the LM head)
            are never sampled. Default: all of ``logits``' columns.
        """
        logits = _check_logits(logits, len(rows), vocab_size)
        if not rows:
            return SamplerOutput([], [], [])
        tokens, logprobs, lse = self._sample(logits, rows)
        ks = [r.params.logprobs for r in rows]
        tops = [None] * len(rows)
        if any(k is not None for k in ks):
            tops = _top_logprobs(logits, lse, tokens, ks, self._ws)
        # One read-back for both (token ids are exact in float64).
        ids, lps = torch.stack((tokens.double(), logprobs.double())).tolist()
        return SamplerOutput([int(t) for t in ids], lps, tops)

    def sample_tensors(
        self,
        logits: torch.Tensor,
        rows: Sequence[ScheduledSequence],
        vocab_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``__call__`` without the read-back: (token ids [B] int64, their raw logprobs [B]
        float32), on the logits' device. Apart from the data-dependent stages named in the
        module docstring it never waits for the device (checked on the GPU with
        ``torch.cuda.set_sync_debug_mode("error")``). Top logprobs are not computed."""
        logits = _check_logits(logits, len(rows), vocab_size)
        tokens, logprobs, _ = self._sample(logits, rows)
        return tokens, logprobs

    def _sample(
        self, logits: torch.Tensor, rows: Sequence[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, raw logprobs of the tokens, logsumexp per row), all on the device."""
        batch = _Batch.build(rows, logits.shape[1], logits.device)
        top, argmax = logits.max(dim=-1)
        lse = _logsumexp(logits, top, self._ws.get("exp", logits.shape, logits))
        if not batch.random_rows and not batch.needs_processing:
            chosen, tokens = top, argmax  # fast path: nothing changes the argmax
        else:
            tokens = self._choose(logits, rows, batch, top, argmax)
            chosen = logits.gather(1, tokens[:, None])[:, 0]
        return tokens, chosen - lse, lse

    def distribution(
        self,
        logits: torch.Tensor,
        rows: Sequence[ScheduledSequence],
        vocab_size: int | None = None,
    ) -> torch.Tensor:
        """The exact distribution each row's token is drawn from: [len(rows), V] float32,
        rows sum to 1 (one-hot at the processed argmax for greedy rows). Same processing as
        ``__call__``; for inspection and tests, not the hot path."""
        logits = _check_logits(logits, len(rows), vocab_size)
        batch = _Batch.build(rows, logits.shape[1], logits.device)
        work = self._scaled(logits, rows, batch)
        out = torch.zeros_like(logits)
        if batch.greedy_rows:
            greedy = batch.index(batch.greedy_rows)
            out[greedy, self._ws.rows("sub", work, greedy).argmax(dim=-1)] = 1.0
        if batch.random_rows:
            w = self._weights(work, batch)
            out[batch.index(batch.random_rows)] = w / w.sum(dim=-1, keepdim=True)
        return out

    def _choose(
        self,
        logits: torch.Tensor,
        rows: Sequence[ScheduledSequence],
        batch: _Batch,
        row_max: torch.Tensor | None = None,
        row_argmax: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tokens of every row. ``row_max`` / ``row_argmax``: the raw logits' row maxima and
        their positions, when scratch ``exp`` still holds ``exp(logits - row_max)`` from the
        logsumexp pass."""
        work = self._scaled(logits, rows, batch)
        if not batch.random_rows:
            return work.argmax(dim=-1)
        tokens = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
        if batch.greedy_rows:
            greedy = batch.index(batch.greedy_rows)
            tokens[greedy] = self._ws.rows("sub", work, greedy).argmax(dim=-1)
        # Unscaled, unprocessed and all rows random: the weights start from exp(logits - max),
        # which the logsumexp pass left in scratch "exp" (the OpenAI defaults take this path).
        reuse = row_max is not None and work is logits and not batch.greedy_rows
        w = self._weights(work, batch, row_max if reuse else None)
        u = self._uniforms([rows[i] for i in batch.random_rows])
        drawn = _inverse_cdf(w, _to_device(u, torch.float64, logits.device))
        if row_argmax is not None:
            # A row with no usable weights (a +inf or NaN logit) takes its raw argmax, which
            # is where an infinite logit sits, instead of an index past the vocabulary.
            raw = row_argmax if not batch.greedy_rows else row_argmax[batch.index(batch.random_rows)]
            drawn = torch.where(drawn >= 0, drawn, raw)
        if not batch.greedy_rows:
            return drawn
        tokens[batch.index(batch.random_rows)] = drawn
        return tokens

    def _scaled(
        self, logits: torch.Tensor, rows: Sequence[ScheduledSequence], batch: _Batch
    ) -> torch.Tensor:
        """``logits / temperature`` (greedy rows count as temperature 1) after min_tokens,
        logit_bias and penalties; ``logits`` itself (never written) when that changes
        nothing."""
        if not batch.scaled and not batch.needs_processing:
            return logits
        work = self._ws.get("work", logits.shape, logits)
        temperature = batch.temperature()
        if batch.scaled:
            torch.div(logits, temperature[:, None], out=work)
        else:
            work.copy_(logits)
        if batch.needs_processing:
            inv_t = temperature.reciprocal()
            _mask_min_tokens(work, rows, self.eos_token_ids)
            _add_logit_bias(work, rows, inv_t)
            _apply_penalties(work, rows, inv_t)
            # Extreme penalties (e.g. repetition_penalty=5e-324) overflow to +inf or NaN:
            # keep such a token the most likely one instead of poisoning the whole row.
            torch.nan_to_num_(work, nan=float("-inf"), posinf=torch.finfo(work.dtype).max, neginf=float("-inf"))
        return work

    def _weights(
        self, work: torch.Tensor, batch: _Batch, row_max: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Unnormalised sampling weights [R, V] of the R non-greedy rows, in row order.
        ``row_max``: ``work``'s row maxima, with ``exp(work - row_max)`` already in scratch
        ``exp`` (only when every row is random)."""
        rand = batch.random_rows
        sub = work if not batch.greedy_rows else self._ws.rows("rows", work, batch.index(rand))
        ready = None if row_max is None else (row_max, self._ws.get("exp", work.shape, work))
        return _filter(
            sub,
            [batch.top_k[i] for i in rand],
            [batch.top_p[i] for i in rand],
            [batch.min_p[i] for i in rand],
            self.top_p_candidates,
            self._ws,
            ready,
        )

    def _uniforms(self, rows: Sequence[ScheduledSequence]) -> torch.Tensor:
        """One uniform in [0, 1) per row: from (seed, output_index) for seeded rows, from
        the sampler's generator for the others."""
        u = torch.rand(len(rows), generator=self._generator, dtype=torch.float64)
        seeded = [i for i, row in enumerate(rows) if row.params.seed is not None]
        if seeded:
            vals = [_seeded_uniform(rows[i].params.seed, rows[i].output_index) for i in seeded]
            u[seeded] = torch.tensor(vals, dtype=torch.float64)
        return u


def _check_logits(logits: torch.Tensor, num_rows: int, vocab_size: int | None) -> torch.Tensor:
    if logits.dim() != 2 or logits.shape[0] != num_rows:
        raise ValueError(
            f"sampler got logits of shape {tuple(logits.shape)} for {num_rows} rows; "
            f"expected [{num_rows}, vocab] (one row per sequence with sample=True)"
        )
    if logits.dtype != torch.float32:
        logits = logits.float()
    if vocab_size is not None:
        if vocab_size > logits.shape[1]:
            raise ValueError(
                f"vocab_size {vocab_size} is larger than the logits' {logits.shape[1]} columns"
            )
        logits = logits[:, :vocab_size]
    return logits


def _logsumexp(logits: torch.Tensor, row_max: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp reusing the row maxima already computed, in the scratch ``buf``."""
    shift = torch.where(torch.isfinite(row_max), row_max, 0.0)
    return torch.sub(logits, shift[:, None], out=buf).exp_().sum(dim=-1).log_().add_(shift)


def _seeded_uniform(seed: int, index: int) -> float:
    """The ``index``-th output of SplitMix64 started at ``seed``, as a float in [0, 1).

    A counter-based draw: token ``index`` of a seeded request gets the same number whatever
    the batch, the step or the process, with no generator state to carry between steps.
    """
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


def _flat_ids(
    rows: Sequence[ScheduledSequence],
    picks: Sequence[int],
    ids_of: Callable[[ScheduledSequence], Sequence[int]],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs, flattened over the picked rows."""
    lists = [ids_of(rows[i]) for i in picks]
    lengths = torch.tensor([len(x) for x in lists], dtype=torch.int64)
    r = torch.repeat_interleave(torch.tensor(picks, dtype=torch.int64), lengths)
    c = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64)
    return r.to(device), c.to(device)


def _check_ids(c: torch.Tensor, vocab_size: int, what: str) -> None:
    if len(c) and (int(c.max()) >= vocab_size or int(c.min()) < 0):
        bad = sorted({int(t) for t in c if t >= vocab_size or t < 0})[:5]
        raise ValueError(
            f"{what} contains token id(s) {bad} outside the vocabulary of {vocab_size} "
            f"tokens (ids 0..{vocab_size - 1})"
        )


def _mask_min_tokens(
    logits: torch.Tensor, rows: Sequence[ScheduledSequence], eos: frozenset[int]
) -> None:
    """EOS and stop tokens cannot be chosen before ``min_tokens`` tokens exist."""

    def stops(row: ScheduledSequence) -> list[int]:
        ids = set(row.params.stop_token_ids)
        if not row.params.ignore_eos:
            ids |= eos
        return sorted(ids)

    picks = [i for i, r in enumerate(rows) if r.output_index < r.params.min_tokens]
    if not picks:
        return
    r, c = _flat_ids(rows, picks, stops, logits.device)
    _check_ids(c, logits.shape[1], "stop_token_ids / eos_token_ids")
    logits[r, c] = float("-inf")


def _add_logit_bias(
    logits: torch.Tensor, rows: Sequence[ScheduledSequence], inv_t: torch.Tensor
) -> None:
    picks = [i for i, r in enumerate(rows) if r.params.logit_bias]
    if not picks:
        return
    r, c = _flat_ids(rows, picks, lambda row: list(row.params.logit_bias), logits.device)
    _check_ids(c, logits.shape[1], "logit_bias")
    bias = [v for i in picks for v in rows[i].params.logit_bias.values()]
    bias_t = torch.tensor(bias, dtype=logits.dtype, device=logits.device) * inv_t[r]
    logits.index_put_((r, c), bias_t, accumulate=True)


def _apply_penalties(
    logits: torch.Tensor, rows: Sequence[ScheduledSequence], inv_t: torch.Tensor
) -> None:
    """Repetition (HF: seen logits > 0 divided, < 0 multiplied; prompt and output), then
    OpenAI presence/frequency (``-= frequency * count + presence * (count > 0)``, output
    only), on logits already scaled by ``inv_t`` per row (the subtracted amounts are
    scaled alike; the repetition penalty is scale-free). Works on the unique (row, token)
    pairs of the history, never the whole vocabulary."""
    vocab, dev = logits.shape[1], logits.device
    _check_history(rows)
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        r, c = _flat_ids(rows, rep, lambda row: row.prompt_token_ids + row.output_token_ids, dev)
        _check_ids(c, vocab, "token history")
        key = torch.unique(r * vocab + c)
        r, c = key // vocab, key % vocab
        penalty = _per_row(rows, "repetition_penalty", dev)[r]
        g = logits[r, c]
        logits[r, c] = torch.where(g > 0, g / penalty, g * penalty)
    pf = [
        i
        for i, row in enumerate(rows)
        if (row.params.presence_penalty or row.params.frequency_penalty) and row.output_token_ids
    ]
    if pf:
        r, c = _flat_ids(rows, pf, lambda row: row.output_token_ids, dev)
        _check_ids(c, vocab, "output token history")
        key, counts = torch.unique(r * vocab + c, return_counts=True)
        r, c = key // vocab, key % vocab
        freq = _per_row(rows, "frequency_penalty", dev)[r]
        pres = _per_row(rows, "presence_penalty", dev)[r]
        logits[r, c] -= (freq * counts + pres) * inv_t[r]


def _per_row(rows: Sequence[ScheduledSequence], name: str, device: torch.device) -> torch.Tensor:
    return torch.tensor([getattr(r.params, name) for r in rows], device=device)


def _check_history(rows: Sequence[ScheduledSequence]) -> None:
    """Penalties need the history the scheduler promises to fill; an empty prompt or an
    output list that disagrees with output_index means it was not filled."""
    for i, row in enumerate(rows):
        if not row.params.needs_token_history:
            continue
        if not row.prompt_token_ids or len(row.output_token_ids) != row.output_index:
            raise ValueError(
                f"row {i} (request {row.request_id!r}) uses penalties but carries "
                f"{len(row.prompt_token_ids)} prompt ids and {len(row.output_token_ids)} output "
                f"ids for output_index {row.output_index}; the scheduler must fill "
                "prompt_token_ids and output_token_ids when params.needs_token_history"
            )


def _filter(
    z: torch.Tensor,
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
    candidates: int,
    ws: _Scratch,
    ready: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Weights ``exp(z - max)`` of scaled logits ``z`` [R, V] with tokens below each
    row's top-k / top-p / min-p cut-off set to 0, in scratch ``exp``. ``z`` is only read;
    the per-row parameters are host lists, so deciding what to run reads nothing back.
    ``ready``: ``(max, exp(z - max))`` when the caller computed them already (the second is
    scratch ``exp`` itself)."""
    dev = z.device
    z_max = z.amax(dim=-1) if ready is None else ready[0]
    k_cut = torch.full((z.shape[0],), float("-inf"), device=dev)
    k_rows = [i for i, k in enumerate(top_k) if k > 0]
    if k_rows:
        idx = _to_device(k_rows, torch.int64, dev)
        ks = _to_device([top_k[i] for i in k_rows], torch.int64, dev)
        kth = ws.rows("sub", z, idx).topk(max(top_k), dim=-1).values
        k_cut[idx] = kth.gather(1, (ks - 1)[:, None])[:, 0]
    cut = k_cut
    if any(m > 0 for m in min_p):
        min_p_t = _to_device(min_p, torch.float32, dev)
        cut = torch.maximum(cut, z_max + torch.log(min_p_t))  # p_i >= min_p * p_max
    if ready is None:
        p = torch.sub(z, z_max[:, None], out=ws.get("exp", z.shape, z)).exp_()
    else:
        p = ready[1]
    p_rows = [i for i, tp in enumerate(top_p) if tp < 1.0]
    if p_rows:
        idx = _to_device(p_rows, torch.int64, dev)
        p_cut = _top_p_cutoff(
            z,
            p,
            idx,
            z_max[idx],
            k_cut[idx],
            [top_k[i] for i in p_rows],
            [top_p[i] for i in p_rows],
            candidates,
            ws,
        )
        cut = cut.index_put((idx,), torch.maximum(cut[idx], p_cut))
    if k_rows or p_rows or any(m > 0 for m in min_p):
        p.masked_fill_(torch.lt(z, cut[:, None], out=ws.get("mask", z.shape, z, torch.bool)), 0.0)
    return p


def _top_p_cutoff(
    z: torch.Tensor,
    p: torch.Tensor,
    idx: torch.Tensor,
    z_max: torch.Tensor,
    k_cut: torch.Tensor,
    top_k_rows: list[int],
    top_p_rows: list[float],
    candidates: int,
    ws: _Scratch,
) -> torch.Tensor:
    """The smallest scaled logit top-p keeps, for the rows ``idx`` of ``z``.

    The top-p set is taken on the distribution after top-k (tokens with z >= ``k_cut``):
    a token is kept while the mass of the tokens above it is below ``top_p``. The cut-off
    is searched among the first ``candidates`` sorted values (at least top_k + 1); rows
    whose nucleus reaches past them are sorted in full.
    """
    vocab, dev = z.shape[1], z.device
    zi = ws.rows("sub", z, idx)
    top_p = _to_device(top_p_rows, torch.float64, dev)
    with_k = _to_device([k > 0 for k in top_k_rows], torch.bool, dev)
    # Rows without top-k normalise over the whole row; rows with top-k over their
    # candidates, which then hold every survivor (checked below).
    mass = torch.where(with_k, float("nan"), _chunk_sums(p).sum(dim=-1)[idx])
    k = min(vocab, max(candidates, max(top_k_rows) + 1))
    if candidates <= 0 or k == vocab:
        every = torch.arange(len(idx), device=z.device)
        return _sorted_cutoffs(zi, every, z_max, k_cut, top_p, mass)
    vals = zi.topk(k, dim=-1).values
    cutoff, kept = _nucleus(vals, z_max, k_cut, top_p, mass)
    covered = (kept < k) & (~with_k | (vals[:, -1] < k_cut))
    if not bool(covered.all()):
        miss = (~covered).nonzero()[:, 0]
        cutoff[miss] = _sorted_cutoffs(zi, miss, z_max[miss], k_cut[miss], top_p[miss], mass[miss])
    return cutoff


def _sorted_cutoffs(
    z: torch.Tensor,
    rows: torch.Tensor,
    z_max: torch.Tensor,
    k_cut: torch.Tensor,
    top_p: torch.Tensor,
    mass: torch.Tensor,
) -> torch.Tensor:
    """Top-p cut-offs of ``z[rows]`` from full sorts (the other tensors are per ``rows``),
    a few rows at a time so that the sort's temporaries stay small enough for the
    allocator to reuse instead of faulting in fresh pages for each."""
    out = torch.empty(len(rows), dtype=z.dtype, device=z.device)
    for start in range(0, len(rows), _SORT_ROWS):
        b = slice(start, start + _SORT_ROWS)
        vals = z.index_select(0, rows[b]).sort(dim=-1, descending=True).values
        out[b] = _nucleus(vals, z_max[b], k_cut[b], top_p[b], mass[b])[0]
    return out


def _nucleus(
    vals: torch.Tensor,
    z_max: torch.Tensor,
    k_cut: torch.Tensor,
    top_p: torch.Tensor,
    mass: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p over descending ``vals`` [n, K] (each row's largest is ``z_max``). ``mass`` is
    each row's total weight ``sum(exp(z - z_max))``, or NaN to use the candidates' own
    (top-k rows). Returns the cut-off value and how many candidates are kept."""
    q = torch.sub(vals, z_max[:, None]).exp_().masked_fill_(vals < k_cut[:, None], 0.0).double()
    cum = q.cumsum(dim=-1)
    total = torch.where(torch.isnan(mass), cum[:, -1], mass)
    above = cum - q  # mass of the more likely candidates
    # >= 1: above[0] == 0, unless top_p * total underflows to 0 (top_p=5e-324): keep the top one
    kept = (above < (top_p * total)[:, None]).sum(dim=-1).clamp_(min=1)
    return vals.gather(1, (kept - 1)[:, None])[:, 0], kept


def _chunk_sums(p: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R, ceil(V / chunk)] float64: float32 sums of consecutive chunks."""
    vocab = p.shape[1]
    whole = vocab // _CDF_CHUNK * _CDF_CHUNK
    parts = []
    if whole:
        parts.append(p[:, :whole].unflatten(1, (whole // _CDF_CHUNK, _CDF_CHUNK)).sum(dim=-1))
    if whole < vocab:
        parts.append(p[:, whole:].sum(dim=-1, keepdim=True))
    return torch.cat(parts, dim=1).double()


def _inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token per row drawn from unnormalised weights ``p`` [R, V] (>= 0): the first token
    whose cumulative weight exceeds ``u * total``, in vocabulary order; -1 for a row whose
    total is not a positive finite number (NaN or infinite logits, nothing left)."""
    vocab = p.shape[1]
    csum = _chunk_sums(p).cumsum(dim=-1)
    target = u * csum[:, -1]  # < total: u <= 1 - 2**-53 and float64 rounds to nearest
    chunk = torch.searchsorted(csum, target[:, None], right=True)[:, 0]
    chunk.clamp_(max=csum.shape[1] - 1)
    base = torch.where(chunk > 0, csum.gather(1, (chunk - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    width = min(_CDF_CHUNK, vocab)  # a small vocabulary is a single, narrower chunk
    cols = chunk[:, None] * _CDF_CHUNK + torch.arange(width, device=p.device)
    inside = cols < vocab
    local = p.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(~inside, 0.0).double()
    lcum = base[:, None] + local.cumsum(dim=-1)
    j = torch.searchsorted(lcum, target[:, None], right=True)[:, 0].clamp_(max=width - 1)
    # Where rounding put the target past the chunk's last positive weight, take that weight.
    # (Computed for every row rather than after a device read of whether any row needs it.)
    bad = local.gather(1, j[:, None])[:, 0] <= 0
    pos = torch.arange(width, device=p.device).expand_as(local)
    ok = (local > 0) & (pos <= j[:, None])
    last = torch.where(ok, pos, -1).amax(dim=-1)
    j = torch.where(bad & (last >= 0), last, j)
    total = csum[:, -1]
    drawn = cols.gather(1, j[:, None])[:, 0]
    return torch.where(torch.isfinite(total) & (total > 0), drawn, -1)


def _top_logprobs(
    logits: torch.Tensor,
    lse: torch.Tensor,
    tokens: torch.Tensor,
    ks: Sequence[int | None],
    ws: _Scratch,
) -> list[dict[int, Logprob] | None]:
    """Per row with k set: the k largest log_softmax entries (ranks 1..k) plus ``tokens``'
    entry with rank 1 + the number of strictly more likely tokens."""
    out: list[dict[int, Logprob] | None] = [None] * len(ks)
    picks = [i for i, k in enumerate(ks) if k is not None]
    idx = torch.tensor(picks, dtype=torch.int64, device=logits.device)
    x = ws.rows("work", logits, idx)
    kmax = min(max(ks[i] for i in picks), x.shape[1])
    top_vals, top_ids = x.topk(kmax, dim=-1)
    top_lp = (top_vals - lse[idx, None]).tolist()
    chosen = x.gather(1, tokens[idx, None])
    ranks = (torch.gt(x, chosen, out=ws.get("mask", x.shape, x, torch.bool)).sum(-1) + 1).tolist()
    chosen_lp = (chosen[:, 0] - lse[idx]).tolist()
    top_ids_l, token_l = top_ids.tolist(), tokens.tolist()
    for n, i in enumerate(picks):
        k = min(ks[i], kmax)
        d = {
            t: Logprob(lp, r + 1) for r, (t, lp) in enumerate(zip(top_ids_l[n][:k], top_lp[n][:k]))
        }
        tok = token_l[i]
        if tok not in d:
            d[tok] = Logprob(chosen_lp[n], ranks[n])
        out[i] = d
    return out


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, k: int
) -> list[dict[int, Logprob]]:
    """Logprobs of a prompt: position i's logits scored against the prompt token i + 1.

    :param logits: [N, V] logits of N prompt positions
    :param next_token_ids: [N] the token that actually follows each position
    :param k: how many top entries to add besides the actual token (0 = only it)
    :return: per position, ``{token: Logprob}`` with the top-k (ranks 1..k) and the actual
        next token (its true rank)
    """
    if logits.dim() != 2 or next_token_ids.shape != (logits.shape[0],):
        raise ValueError(
            f"prompt_logprobs needs logits [N, V] and next_token_ids [N]; got "
            f"{tuple(logits.shape)} and {tuple(next_token_ids.shape)}"
        )
    if logits.shape[0] == 0:
        return []
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    tokens = next_token_ids.to(device=logits.device, dtype=torch.int64)
    per_pos = _top_logprobs(logits, lse, tokens, [k] * logits.shape[0], _Scratch())
    return [d for d in per_pos if d is not None]
