"""The sampler: one pass over the whole batch with per-row parameters.

Pipeline for each row (the order vLLM uses; HF transformers applies the same warpers in the
same order):

1. ``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` get ``-inf`` until the
   sequence has generated ``min_tokens`` tokens (:mod:`core.sampler.processors`).
2. ``logit_bias`` is added.
3. Repetition penalty (HF definition, over prompt + output tokens), then presence and
   frequency penalties (OpenAI definition, over output tokens only).
4. Temperature. (Implemented as one division of the whole batch *first*, with the bias and
   penalty amounts divided alike: every step above commutes with a positive scale, and the
   division doubles as the copy that keeps the raw logits intact.)
5. Greedy rows (temperature 0) take the argmax and skip the rest.
6. Top-k, top-p and min-p (:mod:`core.sampler.filters`).
7. One uniform number per row picks the token by inverse CDF over the survivors in
   vocabulary order (:mod:`core.sampler.draw`).

Logprobs (:mod:`core.sampler.logprobs`) are of the raw model logits.

Penalties read the rows' token history. By default the host lists it from the rows each
call; with ``Sampler(penalty_state=True)`` (the model runner's choice on a device with
memory of its own) the history lives on the device per sequence and is counted there from
the sampled ids (:mod:`core.sampler.penalties`): no host work per step that grows with the
tokens generated. The caller then reports each step's scheduled sequences through
:meth:`Sampler.begin_step`.

A platform's fused kernel (``Sampler(kernel=...)``, :mod:`core.sampler.kernel`) replaces
steps 1-7 and the logsumexp with one launch where it accepts the logits; the torch pipeline
below is the reference it follows and runs everywhere else.

Static-shape platforms (XLA) supply :class:`core.sampler.static.StaticShapeSampling` as that
kernel: the same pipeline with no data-dependent row subsets (every stage on every row,
neutral values where a row does not use it), identical tokens and logprobs, and shapes that
follow the number of rows (bucketed by the runner, :mod:`core.sampler.padding`) and the
padded edit count (a power of two, :func:`core.sampler.static.pad_edits`) only. What stays
subset-shaped there, exactly: (a) structured output's grammar bitmask, applied in
:meth:`Sampler.draw` to the rows that have a grammar (``logits[rows]``, sized by how many
do); (b) top logprobs (:meth:`Sampler.finish`), computed on the rows that request them with
``topk`` of the largest k asked, after a read-back; (c) prompt logprobs (the runner's, over
the prompt positions). Each of those compiles per size it meets, and only steps that use
them run them.

With ``Staging(pinned=True)`` (a device with memory of its own that can pin host memory) the
sampler does not wait for the device until it reads the result: which stages run and on
which rows is decided from the rows' parameters on the host, host values reach the device
through pinned memory with non-blocking copies, and top-p sorts its rows instead of reading
back whether its candidates sufficed. (Each ``bool(t.any())`` or blocking copy would drain
the stream, idling the GPU for a round trip.) Only requested logprobs read back before the
result does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from core.outputs import Logprob
from core.sampler.draw import inverse_cdf, logsumexp, seeded_uniform
from core.sampler.filters import apply_filters
from core.sampler.kernel import NO_KERNEL, SamplingKernel, pack
from core.sampler.logprobs import top_logprobs
from core.sampler.penalties import PenaltyState, apply_dense
from core.sampler.processors import add_logit_bias, apply_penalties, mask_min_tokens
from core.sampler.rows import SampleRow, SamplingBatch, Scratch, Staging
from core.sampler.static import pad_edits
from core.structured_output.bitmask import RowBitmask

PLAIN = Staging(pinned=False)
"""Plain copies: the default, right wherever a read-back costs little (the CPU)."""

TOP_P_CANDIDATES = 256
"""Default for ``Sampler(top_p_candidates=...)`` where read-backs are cheap."""


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


@dataclass(frozen=True)
class Drawn:
    """Tokens drawn for one step, on the device (see :meth:`Sampler.draw`)."""

    logits: torch.Tensor
    """The checked float32 logits the tokens were drawn from."""
    token_ids: torch.Tensor
    """[B] int64."""
    logprobs: torch.Tensor
    """[B] float32 raw logprobs of the tokens."""
    lse: torch.Tensor
    """[B] float32 logsumexp of each row's raw logits."""


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
        sort, the textbook method). The result is the same either way. Default: 256, or 0
        with pinned staging (the check would wait for the device).
    :param staging: how host values reach the logits' device (see the module docstring).
    :param kernel: the platform's fused sampling kernel, used for the logits it accepts.
    :param penalty_state: keep the penalties' history on the device per sequence
        (:mod:`core.sampler.penalties`); the caller must then call :meth:`begin_step` every
        step. Used with the torch pipeline and with kernels that read it
        (``reads_penalty_state``); other kernels keep the host-built history.
    """

    def __init__(
        self,
        eos_token_ids: frozenset[int] = frozenset(),
        seed: int | None = None,
        top_p_candidates: int | None = None,
        staging: Staging = PLAIN,
        kernel: SamplingKernel = NO_KERNEL,
        penalty_state: bool = False,
    ):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kernel = kernel
        self.penalty_state = penalty_state and (
            kernel is NO_KERNEL or bool(getattr(kernel, "reads_penalty_state", False))
        )
        self.penalties: PenaltyState | None = None  # made on first use
        if top_p_candidates is None:
            top_p_candidates = 0 if staging.pinned else TOP_P_CANDIDATES
        self.top_p_candidates = top_p_candidates
        self.staging = staging
        self._ws = Scratch()
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def begin_step(self, seq_ids: Iterable[int], preempted: Sequence[int] = ()) -> None:
        """A new step schedules the sequences ``seq_ids`` (sampled or not) and preempted
        ``preempted``: the penalty state of every other sequence is dropped (with
        ``penalty_state``; otherwise nothing to do)."""
        if self.penalties is not None:
            self.penalties.begin_step(seq_ids, preempted)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SampleRow],
        vocab_size: int | None = None,
    ) -> SamplerOutput:
        """Sample one token per row.

        :param logits: [len(rows), V'] float32, one row per sampled sequence, same order
        :param rows: the scheduled sequences with ``sample=True``
        :param vocab_size: the real vocabulary; columns beyond it (padding of the LM head)
            are never sampled. Default: all of ``logits``' columns.
        """
        return self.finish(rows, self.draw(logits, rows, vocab_size))

    def draw(
        self,
        logits: torch.Tensor,
        rows: Sequence[SampleRow],
        vocab_size: int | None = None,
        bitmask: RowBitmask | None = None,
    ) -> Drawn:
        """The first half of ``__call__``: the tokens, still on the logits' device (no
        read-back). ``bitmask``: grammar masks (structured output), applied to the logits
        before every other stage, so logprobs are of the masked logits."""
        logits = _check_logits(logits, len(rows), vocab_size)
        if bitmask is not None:
            bitmask.apply(logits)
        if not rows:
            empty = torch.empty(0, dtype=torch.int64, device=logits.device)
            return Drawn(logits, empty, empty.float(), empty.float())
        # Stages on the logits that both paths below share (structured output's grammar
        # bitmask) go here, on the logits' device.
        tokens, logprobs, lse = self._sample(logits, rows)
        return Drawn(logits, tokens, logprobs, lse)

    def finish(self, rows: Sequence[SampleRow], drawn: Drawn) -> SamplerOutput:
        """The second half of ``__call__``: top logprobs and the one read-back."""
        if not rows:
            return SamplerOutput([], [], [])
        ks = [r.params.logprobs for r in rows]
        tops = [None] * len(rows)
        if any(k is not None for k in ks):
            tops = top_logprobs(drawn.logits, drawn.lse, drawn.token_ids, ks, self._ws)
        # One read-back for both (token ids are exact in float64).
        ids, lps = torch.stack((drawn.token_ids.double(), drawn.logprobs.double())).tolist()
        return SamplerOutput([int(t) for t in ids], lps, tops)

    def sample_tensors(
        self,
        logits: torch.Tensor,
        rows: Sequence[SampleRow],
        vocab_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``__call__`` without the read-back: (token ids [B] int64, their raw logprobs [B]
        float32), on the logits' device. With pinned staging it never waits for the device
        (checked on the GPU with ``torch.cuda.set_sync_debug_mode("error")``). Top logprobs
        are not computed."""
        drawn = self.draw(logits, rows, vocab_size)
        return drawn.token_ids, drawn.logprobs

    def _sample(
        self, logits: torch.Tensor, rows: Sequence[SampleRow]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, raw logprobs of the tokens, logsumexp per row), all on the device."""
        slots = self._slots(logits, rows)
        if self.kernel.accepts(logits):
            out = self._fused(logits, rows, slots)
        else:
            out = self._pipeline(logits, rows, slots)
        if slots is not None:
            self.penalties.record(slots, rows, out[0])
        return out

    def _slots(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int] | None:
        """Each row's penalty-state slot, or None when penalties come from the host."""
        if not self.penalty_state or not any(r.params.needs_token_history for r in rows):
            return None
        if self.penalties is None:
            self.penalties = PenaltyState(logits.shape[1], logits.device, self.staging)
        elif self.penalties.vocab != logits.shape[1]:
            raise ValueError(
                f"the sampler's penalty state is for {self.penalties.vocab} vocabulary columns "
                f"but these logits have {logits.shape[1]}; pass the same vocab_size each step"
            )
        return self.penalties.slots(rows)

    def _pipeline(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], slots: list[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch = SamplingBatch.build(rows, logits.shape[1], logits.device, self.staging, slots)
        top, argmax = logits.max(dim=-1)
        lse = logsumexp(logits, top, self._ws.get("exp", logits.shape, logits))
        if not batch.random_rows and not batch.needs_processing:
            chosen, tokens = top, argmax  # fast path: nothing changes the argmax
        else:
            tokens = self._choose(logits, rows, batch, top, argmax)
            chosen = logits.gather(1, tokens[:, None])[:, 0]
        return tokens, chosen - lse, lse

    def _fused(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], slots: list[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The platform kernel's draw, from the same uniform numbers the torch pipeline
        would use (so the generator advances alike on either path)."""
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        u = self._uniforms([rows[i] for i in random]).tolist() if random else []
        state = self.penalties.table if slots is not None else None
        inputs = pack(rows, logits.shape[1], self.eos_token_ids, dict(zip(random, u)), slots, state)
        if getattr(self.kernel, "pads_edits", False):
            inputs = pad_edits(inputs)  # a static-shape kernel: the edit count bucketed
        return self.kernel(logits, inputs.to(logits.device, self.staging))

    def distribution(
        self,
        logits: torch.Tensor,
        rows: Sequence[SampleRow],
        vocab_size: int | None = None,
    ) -> torch.Tensor:
        """The exact distribution each row's token is drawn from: [len(rows), V] float32,
        rows sum to 1 (one-hot at the processed argmax for greedy rows). Same processing as
        ``__call__`` (with ``penalty_state``, rows new to it join it; nothing is counted);
        for inspection and tests, not the hot path."""
        logits = _check_logits(logits, len(rows), vocab_size)
        slots = self._slots(logits, rows)
        batch = SamplingBatch.build(rows, logits.shape[1], logits.device, self.staging, slots)
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
        rows: Sequence[SampleRow],
        batch: SamplingBatch,
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
        drawn = inverse_cdf(w, batch.stage(u, torch.float64, logits.device))
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
        self, logits: torch.Tensor, rows: Sequence[SampleRow], batch: SamplingBatch
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
            mask_min_tokens(work, rows, self.eos_token_ids, batch)
            add_logit_bias(work, rows, inv_t, batch)
            if batch.slots is None:
                apply_penalties(work, rows, inv_t, batch)
            else:
                apply_dense(work, rows, batch.slots, self.penalties.table, inv_t, batch)
            # Extreme penalties (e.g. repetition_penalty=5e-324) overflow to +inf or NaN:
            # keep such a token the most likely one instead of poisoning the whole row.
            torch.nan_to_num_(work, nan=float("-inf"), posinf=torch.finfo(work.dtype).max, neginf=float("-inf"))
        return work

    def _weights(
        self, work: torch.Tensor, batch: SamplingBatch, row_max: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Unnormalised sampling weights [R, V] of the R non-greedy rows, in row order.
        ``row_max``: ``work``'s row maxima, with ``exp(work - row_max)`` already in scratch
        ``exp`` (only when every row is random)."""
        rand = batch.random_rows
        sub = work if not batch.greedy_rows else self._ws.rows("rows", work, batch.index(rand))
        ready = None if row_max is None else (row_max, self._ws.get("exp", work.shape, work))
        return apply_filters(
            sub,
            [batch.top_k[i] for i in rand],
            [batch.top_p[i] for i in rand],
            [batch.min_p[i] for i in rand],
            self.top_p_candidates,
            self._ws,
            self.staging,
            ready,
        )

    def _uniforms(self, rows: Sequence[SampleRow]) -> torch.Tensor:
        """One uniform in [0, 1) per row: from (seed, output_index) for seeded rows, from
        the sampler's generator for the others."""
        u = torch.rand(len(rows), generator=self._generator, dtype=torch.float64)
        seeded = [i for i, row in enumerate(rows) if row.params.seed is not None]
        if seeded:
            vals = [seeded_uniform(rows[i].params.seed, rows[i].output_index) for i in seeded]
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
