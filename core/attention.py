"""The attention contract every platform implements, and the reference it is checked against.

A step's tokens are flattened into one batch: the sequences that are prefilling (one or
more new tokens, possibly over an already cached context) come first, then the decoding
sequences (exactly one new token each). Each layer owns one KV-cache tensor whose shape
and layout the backend declares; the core only moves block ids around.

Slot mapping: ``slot = block_id * block_size + offset``. A negative slot marks a padding
token: its key/value are never written and its output row is unspecified.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention layer needs; the backend is created from it."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    """Dtype of query/key/value (and of the KV cache unless ``kv_cache_dtype`` is set)."""
    block_size: int
    scale: float | None = None
    """Softmax scale; None means 1/sqrt(head_size)."""
    sliding_window: int | None = None
    """Attend only to the last ``sliding_window`` positions (inclusive of self)."""
    logits_soft_cap: float | None = None
    """Scaled scores ``s`` become ``cap * tanh(s / cap)`` before the mask and softmax (Gemma 2);
    None: no capping. Only backends with ``supports_logits_soft_cap`` accept it."""
    kv_cache_dtype: torch.dtype | None = None
    """What the cache stores when it is not ``dtype``: ``torch.float8_e4m3fn`` holds keys as
    ``fp8(clamp(k * (1 / k_scale)))`` and values likewise with ``v_scale``, read back times
    the scale (:mod:`core.quantization.kv_cache`). Only backends with
    ``supports_fp8_kv_cache`` accept it. None: the cache is ``dtype``."""
    k_scale: float = 1.0
    """Per-layer scale of the FP8 cache's keys (ignored without ``kv_cache_dtype``)."""
    v_scale: float = 1.0
    """Per-layer scale of the FP8 cache's values."""

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_size)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype the KV cache tensor holds."""
        return self.kv_cache_dtype if self.kv_cache_dtype is not None else self.dtype

    @property
    def fp8_cache(self) -> bool:
        return self.kv_cache_dtype == torch.float8_e4m3fn


def shared_sliding_window(specs: list[AttentionSpec]) -> int | None:
    """The window within which every layer attends (the widest one), or None when some layer
    attends to everything: KV positions before it are dead for the whole model."""
    windows = [s.sliding_window for s in specs]
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


@dataclass(frozen=True)
class AttentionMetadata:
    """Device-neutral description of one step's batch, built by the model runner.

    Invariant: sequences ``[0, num_prefills)`` are prefills (any number of new tokens,
    ``context_lens[i]`` of them already cached); sequences after them are decodes (one new
    token each). Token ``t`` of sequence ``i`` sits at flat row ``query_start_loc[i] + t``
    and has absolute position ``context_lens[i] + t``.

    On a platform with a batch shaper (:meth:`core.platform.Platform.batch_shaper`) the
    runner pads every step to the platform's buckets before the backend sees it: then some
    prefills are empty (no rows, ``seq_lens`` 0), some decodes are padding (context 0,
    ``seq_lens`` 1, table row all 0), rows past :attr:`num_tokens` belong to no sequence,
    and every padding row has slot -1 (see :mod:`core.batch_shape` for the layout). Real
    rows keep their places. Build metadata by hand with :func:`build_metadata`.
    """

    num_prefills: int
    """Number of prefill sequences (they come first)."""
    num_prefill_tokens: int
    """Flat rows belonging to prefills; decode rows follow them."""
    num_decode_tokens: int
    """Number of decode sequences (= their rows)."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64 cache slot of each new token; negative = padding, not written."""
    seq_lens: torch.Tensor
    """[num_seqs] int32 context length after this step (cached + new tokens)."""
    context_lens: torch.Tensor
    """[num_seqs] int32 tokens already in the cache before this step."""
    query_start_loc: torch.Tensor
    """[num_seqs + 1] int32 cumulative new-token counts (row offsets)."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks] int32; row i lists sequence i's blocks in order; unused
    entries are 0 and never read past ``ceil(seq_lens[i] / block_size)``."""
    max_query_len: int
    """Most new tokens of one sequence (a batch shaper rounds it up to its query bucket)."""
    max_seq_len: int
    """Longest ``seq_lens`` entry (a batch shaper rounds it up to a whole bucketed table)."""
    seq_lens_host: tuple[int, ...] = ()
    """``seq_lens`` as Python ints (lets backends avoid a device sync)."""
    context_lens_host: tuple[int, ...] = ()
    """``context_lens`` as Python ints."""

    @property
    def num_seqs(self) -> int:
        return self.num_prefills + self.num_decode_tokens

    @property
    def num_tokens(self) -> int:
        """Rows that belong to a sequence. A shaped batch (:mod:`core.batch_shape`) has
        padding rows after them: ``slot_mapping`` is then longer, and every tensor of the
        step has its bucketed row count."""
        return self.num_prefill_tokens + self.num_decode_tokens


def build_metadata(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    *,
    num_prefills: int,
    device: torch.device | str = "cpu",
    slot_mapping: Sequence[int] | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> AttentionMetadata:
    """The metadata of one step, from its host-side facts: the one way to build it by hand.

    :param query_lens: new tokens per sequence, prefills first (the first ``num_prefills``).
    :param context_lens: tokens each sequence has cached before this step.
    :param block_tables: each sequence's blocks in order (rows of any length: padded with
        the null block 0 to the longest; a 2-D array is taken as it is).
    :param slot_mapping: the slot of every row; None computes it from the tables
        (``slot = block * block_size + offset``). It may be longer than the new tokens:
        the rows after them are padding rows (slot -1) of a shaped batch.
    :param max_query_len: / :param max_seq_len: a batch shaper's bucketed values; None
        takes the true maxima.
    """
    qlens = np.asarray(query_lens, dtype=np.int64).reshape(-1)
    ctx = np.asarray(context_lens, dtype=np.int64).reshape(-1)
    if len(qlens) != len(ctx) or not 0 <= num_prefills <= len(qlens):
        raise ValueError(
            f"{len(qlens)} query lengths, {len(ctx)} context lengths and num_prefills="
            f"{num_prefills}: give one query and one context length per sequence, and at "
            f"most that many prefills"
        )
    seq_lens = ctx + qlens
    qsl = np.concatenate([[0], np.cumsum(qlens)])
    table = _table_array(block_tables, len(qlens))
    if slot_mapping is None:
        seq_of = np.repeat(np.arange(len(qlens)), qlens)
        pos = ctx[seq_of] + np.arange(int(qsl[-1])) - qsl[seq_of]
        slots = table[seq_of, pos // block_size].astype(np.int64) * block_size + pos % block_size
    else:
        slots = np.asarray(slot_mapping, dtype=np.int64)

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(dtype).to(device)

    return AttentionMetadata(
        num_prefills=num_prefills,
        num_prefill_tokens=int(qsl[num_prefills]),
        num_decode_tokens=len(qlens) - num_prefills,
        slot_mapping=dev(slots, torch.int64),
        seq_lens=dev(seq_lens, torch.int32),
        context_lens=dev(ctx, torch.int32),
        query_start_loc=dev(qsl, torch.int32),
        block_tables=dev(table, torch.int32),
        max_query_len=int(qlens.max(initial=0)) if max_query_len is None else max_query_len,
        max_seq_len=int(seq_lens.max(initial=0)) if max_seq_len is None else max_seq_len,
        seq_lens_host=tuple(seq_lens.tolist()),
        context_lens_host=tuple(ctx.tolist()),
    )


def _table_array(block_tables: Sequence[Sequence[int]], num_seqs: int) -> np.ndarray:
    """Block tables as one [num_seqs, width] int32 array (short rows padded with 0)."""
    if isinstance(block_tables, np.ndarray) and block_tables.ndim == 2:
        return block_tables.astype(np.int32, copy=False)
    rows = [list(r) for r in block_tables]
    if len(rows) != num_seqs:
        raise ValueError(f"{len(rows)} block tables for {num_seqs} sequences: give one each")
    table = np.zeros((num_seqs, max((len(r) for r in rows), default=0)), dtype=np.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    return table


class AttentionBackend(ABC):
    """Paged attention for one layer shape on one platform.

    Subclasses state their KV layout through :meth:`kv_cache_shape`; everything else in the
    core treats a layer's cache as an opaque tensor of that shape.
    """

    name: str = "unnamed"
    supports_logits_soft_cap: bool = False
    """Whether :meth:`forward` applies ``spec.logits_soft_cap``; a backend that does not is
    refused for such a layer instead of silently attending without the cap."""
    supports_fp8_kv_cache: bool = False
    """Whether the backend stores and reads ``spec.kv_cache_dtype = torch.float8_e4m3fn``
    (with the spec's scales); a backend that does not is refused for such a layer."""

    def __init__(self, spec: AttentionSpec):
        if spec.kv_cache_dtype not in (None, spec.dtype) and not (
            spec.fp8_cache and self.supports_fp8_kv_cache
        ):
            raise ValueError(
                f"attention backend {self.name!r} cannot keep a {spec.kv_cache_dtype} KV cache "
                f"(--kv-cache-dtype); use --kv-cache-dtype auto, or a platform whose backend "
                f"does (see `core platforms`)"
            )
        if spec.logits_soft_cap is not None and not self.supports_logits_soft_cap:
            raise ValueError(
                f"attention backend {self.name!r} does not implement attention logit "
                f"soft-capping (logits_soft_cap={spec.logits_soft_cap}, e.g. Gemma 2's "
                f"attn_logit_softcapping); run this model on a platform whose backend does "
                f"(the CPU platform's torch path)"
            )
        self.spec = spec

    # ---- layout -----------------------------------------------------------------
    @staticmethod
    @abstractmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor (keys and values together).

        :return: a shape whose product is ``2 * num_blocks * block_size * num_kv_heads *
            head_size``.
        """

    def allocate_kv_cache(
        self, num_blocks: int, device: torch.device | str, pin_memory: bool = False
    ) -> torch.Tensor:
        """Allocate one layer's cache. Default: zeros of :meth:`kv_cache_shape`."""
        s = self.spec
        shape = self.kv_cache_shape(num_blocks, s.block_size, s.num_kv_heads, s.head_size)
        return torch.zeros(shape, dtype=s.cache_dtype, device=device, pin_memory=pin_memory)

    # ---- cache ops ----------------------------------------------------------------
    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store ``key``/``value`` ([num_tokens, num_kv_heads, head_size]) at their slots.

        Rows whose slot is negative are padding and must not be written.
        """

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write this step's keys/values into the cache, then attend.

        :param query: [num_tokens, num_heads, head_size]
        :param key: [num_tokens, num_kv_heads, head_size]
        :param value: [num_tokens, num_kv_heads, head_size]
        :param kv_cache: this layer's cache, shaped by :meth:`kv_cache_shape`
        :return: [num_tokens, num_heads, head_size]; each token attends causally to its
            sequence's cached context plus the new tokens up to and including itself
            (limited to the sliding window when the spec sets one).
        """

    @staticmethod
    @abstractmethod
    def copy_blocks(kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        """Copy-on-write: for every layer, copy block ``pairs[i, 0]`` onto ``pairs[i, 1]``.

        :param pairs: [n, 2] int64 (src, dst) block ids; batched, never a per-block loop
            in Python on devices where that costs a launch per block.
        """

    @staticmethod
    @abstractmethod
    def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        """Copy blocks between two caches of the same layout (device <-> host).

        :param pairs: [n, 2] int64 (src block in ``src``, dst block in ``dst``).
        """


# --------------------------------------------------------------------------------------
# Block moves in plain torch, for backends whose cache layout needs no kernel of its own:
# ``copy_blocks`` / ``swap_blocks`` of such a backend is one call to these with the
# dimension its layout keeps blocks in.
# --------------------------------------------------------------------------------------


def _movable(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` itself, or its bytes for a float8 cache (torch's CPU index_copy_ has no
    float8 kernel; moving bytes is the same copy)."""
    return cache.view(torch.uint8) if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else cache


def _block_ids(pairs: torch.Tensor, column: int, device: torch.device) -> torch.Tensor:
    # dtype first, then device: one host-side conversion, one transfer (also what XLA wants)
    return pairs[:, column].to(dtype=torch.long).to(device)


def index_copy_blocks(kv_caches: list[torch.Tensor], pairs: torch.Tensor, block_dim: int) -> None:
    """``AttentionBackend.copy_blocks`` for caches that hold blocks along ``block_dim`` of
    each layer's tensor: one gather and one scatter per layer, whatever ``len(pairs)``."""
    if pairs.numel() == 0:
        return
    ids: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    for cache in kv_caches:
        if cache.device not in ids:
            ids[cache.device] = (
                _block_ids(pairs, 0, cache.device),
                _block_ids(pairs, 1, cache.device),
            )
        src, dst = ids[cache.device]
        cache = _movable(cache)
        cache.index_copy_(block_dim, dst, cache.index_select(block_dim, src))


def index_swap_blocks(
    src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor, block_dim: int
) -> None:
    """``AttentionBackend.swap_blocks`` for caches that hold blocks along ``block_dim``:
    gather on ``src``'s device, one transfer, scatter on ``dst``'s."""
    if pairs.numel() == 0:
        return
    s = _block_ids(pairs, 0, src.device)
    d = _block_ids(pairs, 1, dst.device)
    src, dst = _movable(src), _movable(dst)
    dst.index_copy_(block_dim, d, src.index_select(block_dim, s).to(dst.device))


# --------------------------------------------------------------------------------------
# Reference implementation: written for clarity, used by tests and the conformance suite.
# It works on *logical* K/V: a per-sequence list of [len, num_kv_heads, head_size].
# --------------------------------------------------------------------------------------


def reference_attention(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    query_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Naive causal attention per sequence, in float64.

    :param query: [num_tokens, num_heads, head_size], sequences concatenated.
    :param keys: per sequence, all keys of its context including the new tokens
        ([seq_len, num_kv_heads, head_size]); the last ``query_lens[i]`` rows are the new ones.
    :return: [num_tokens, num_heads, head_size] in query's dtype.
    """
    out = torch.empty_like(query)
    row = 0
    for k, v, qlen in zip(keys, values, query_lens):
        seq_len = k.shape[0]
        q = query[row : row + qlen].double()  # [q, H, D]
        group = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)  # [S, H, D]
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", q, kk) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        qpos = torch.arange(seq_len - qlen, seq_len).unsqueeze(1)
        kpos = torch.arange(seq_len).unsqueeze(0)
        mask = kpos > qpos
        if sliding_window is not None:
            mask |= kpos <= qpos - sliding_window
        scores = scores.masked_fill(mask.unsqueeze(0), float("-inf"))
        out[row : row + qlen] = torch.einsum("hqs,shd->qhd", scores.softmax(-1), vv).to(query.dtype)
        row += qlen
    return out
