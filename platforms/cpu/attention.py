"""CPU attention: the csrc/cpu paged kernel for prompts and decode, or plain torch.

KV layout: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (keys then values),
so one slot's key is a contiguous ``[num_kv_heads, head_size]`` row and writes are one
``index_copy_`` over the flattened slot dimension.

Two backends share that layout: :class:`CpuAttentionBackend` (``cpu_sdpa``, plain torch:
SDPA for prompts, a block-table gather and matmuls for decode) and
:class:`CpuPagedAttentionBackend` (``cpu_paged``, the csrc/cpu kernels for cache writes,
prompts and decode), which the platform picks when the kernels load.

Both keep an FP8 KV cache (``spec.kv_cache_dtype = torch.float8_e4m3fn``, see
:mod:`core.quantization.kv_cache`): the torch path quantizes with :func:`quantize_kv` and
dequantizes what it gathers; the kernel backend calls csrc/cpu/paged_attention_fp8.cpp.
Every prompt token then attends to the cache's (dequantized) keys and values, its own included.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from core.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    index_copy_blocks,
    index_swap_blocks,
)
from core.quantization.kv_cache import dequantize_kv, quantize_kv
from platforms.cpu.kernels import load_kernels


class CpuAttentionBackend(AttentionBackend):
    name = "cpu_sdpa"
    supports_logits_soft_cap = True  # in plain torch (_attend, _decode), not in SDPA
    supports_fp8_kv_cache = True

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])  # [2, slots, kvh, d]
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        if self.spec.fp8_cache:  # fp8 codes moved as bytes: CPU index_copy_ has no float8 kernel
            key = quantize_kv(key, self.spec.k_scale).view(torch.uint8)
            value = quantize_kv(value, self.spec.v_scale).view(torch.uint8)
            flat = flat.view(torch.uint8)
        flat[0].index_copy_(0, slot_mapping, key.to(flat.dtype))
        flat[1].index_copy_(0, slot_mapping, value.to(flat.dtype))

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        n_pre = metadata.num_prefill_tokens
        if metadata.num_prefills:
            self._prefill(query, key, value, kv_cache, metadata, out)
        if metadata.num_decode_tokens:
            self._decode_into(out[n_pre:], query[n_pre:], kv_cache, metadata)
        return out

    # ---- prompts ----------------------------------------------------------------------
    def _prefill(self, query, key, value, kv_cache, md: AttentionMetadata, out) -> None:
        starts = md.query_start_loc.tolist()
        context = md.context_lens_host or tuple(md.context_lens.tolist())
        window = self.spec.sliding_window
        for i in range(md.num_prefills):
            s, e, ctx = starts[i], starts[i + 1], context[i]
            q = query[s:e].transpose(0, 1)  # [H, q, D]
            if ctx == 0 and window is None and not self.spec.fp8_cache:
                k, v = key[s:e].transpose(0, 1), value[s:e].transpose(0, 1)
                o = self._attend(q, k, v, torch.ones(e - s, e - s, dtype=torch.bool).tril())
            else:
                k, v = self._gather_one(kv_cache, md.block_tables[i], ctx + e - s)
                qpos = torch.arange(ctx, ctx + e - s).unsqueeze(1)
                kpos = torch.arange(ctx + e - s).unsqueeze(0)
                allowed = kpos <= qpos
                if window is not None:
                    allowed &= kpos > qpos - window
                o = self._attend(q, k, v, allowed)
            out[s:e] = o.transpose(0, 1).to(out.dtype)

    def _attend(self, q, k, v, allowed: torch.Tensor) -> torch.Tensor:
        """q [H, q, D], k/v [KVH, L, D], allowed [q, L] -> [H, q, D]; SDPA unless the
        spec soft-caps the logits (SDPA cannot), then the same in plain torch."""
        cap = self.spec.logits_soft_cap
        if cap is None:
            causal = allowed.shape[0] == allowed.shape[1] and self.spec.sliding_window is None
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if causal else allowed, is_causal=causal,
                scale=self.spec.softmax_scale, enable_gqa=True,
            )
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = torch.matmul(q, k.transpose(1, 2)).float() * self.spec.softmax_scale
        scores = (cap * torch.tanh(scores / cap)).masked_fill_(~allowed, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)

    def _gather_one(self, kv_cache, block_table, length: int):
        """Keys/values of positions [0, length) of one sequence as [kvh, length, D]."""
        bs = kv_cache.shape[2]
        pos = torch.arange(length)
        slots = block_table[pos // bs].long() * bs + pos % bs
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        k = flat[0].index_select(0, slots).transpose(0, 1)
        v = flat[1].index_select(0, slots).transpose(0, 1)
        return self._read(k, self.spec.k_scale), self._read(v, self.spec.v_scale)

    def _read(self, cached: torch.Tensor, scale: float) -> torch.Tensor:
        """Cached keys or values in the compute dtype (FP8 codes dequantized)."""
        if self.spec.fp8_cache:
            return dequantize_kv(cached, scale, self.spec.dtype)
        return cached.to(self.spec.dtype)

    # ---- decode -----------------------------------------------------------------------
    def _decode_into(self, out, query, kv_cache, md: AttentionMetadata) -> None:
        out.copy_(self._decode(query, kv_cache, md))

    def _decode(self, query, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        """One new token per sequence; gather each context (padded to the longest).

        Plain batched matmuls: for one query row per sequence they beat SDPA's CPU flash
        kernel, whose tiling is built for long query blocks (measured in docs/benchmarks/cpu.md).
        """
        first = md.num_prefills
        seq_lens = md.seq_lens[first:].long()
        tables = md.block_tables[first:].long()
        bs = kv_cache.shape[2]
        max_len = max(md.seq_lens_host[first:]) if md.seq_lens_host else int(seq_lens.max())
        pos = torch.arange(max_len)
        slots = tables[:, pos // bs] * bs + pos % bs  # [B, L]
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        b, kvh, d = slots.shape[0], flat.shape[2], flat.shape[3]
        group = query.shape[1] // kvh
        k = flat[0].index_select(0, slots.reshape(-1)).view(b, max_len, kvh, d).permute(0, 2, 3, 1)
        v = flat[1].index_select(0, slots.reshape(-1)).view(b, max_len, kvh, d).transpose(1, 2)
        if self.spec.fp8_cache:
            k, v = self._read(k, self.spec.k_scale), self._read(v, self.spec.v_scale)
        q = query.view(b, kvh, group, d).to(k.dtype)
        scores = torch.matmul(q, k).float() * self.spec.softmax_scale  # [B, KVH, G, L]
        if self.spec.logits_soft_cap is not None:
            cap = self.spec.logits_soft_cap
            scores = cap * torch.tanh(scores / cap)
        masked = pos.unsqueeze(0) >= seq_lens.unsqueeze(1)  # [B, L]
        if self.spec.sliding_window is not None:
            masked |= pos.unsqueeze(0) < (seq_lens - self.spec.sliding_window).unsqueeze(1)
        scores.masked_fill_(masked[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.matmul(probs, v).view(b, kvh * group, d).to(query.dtype)

    # ---- block moves ------------------------------------------------------------------
    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        index_copy_blocks(kv_caches, pairs, block_dim=1)

    @staticmethod
    def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        index_swap_blocks(src, dst, pairs, block_dim=1)


class CpuPagedAttentionBackend(CpuAttentionBackend):
    """The csrc/cpu kernels for cache writes, prompts and decode.

    The kernel reads each sequence's blocks in place (no padded gather), reads every cached
    key/value row once for all query heads of its group, and computes in fp32. Prompt tokens
    go through it too (see :meth:`_prefill`). Inputs the kernels do not take (a query whose
    heads are not contiguous rows, mixed dtypes) use the torch path.

    :raises RuntimeError: from construction, when the kernels cannot be built here.
    """

    name = "cpu_paged"

    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        kernels = load_kernels()
        self._write_kv = kernels.write_kv.default
        self._paged_decode = kernels.paged_decode.default
        if spec.fp8_cache:  # the fp8 twins take the layer's scales on every call
            scales = dict(k_scale=spec.k_scale, v_scale=spec.v_scale)
            self._write_kv = functools.partial(kernels.write_kv_fp8.default, **scales)
            self._paged_decode = functools.partial(kernels.paged_decode_fp8.default, **scales)
        self._window = spec.sliding_window or 0
        self._soft_cap = spec.logits_soft_cap or 0.0

    @staticmethod
    def _heads_are_rows(t: torch.Tensor) -> bool:
        return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]

    def _kernel_dtypes(self, kv_cache: torch.Tensor, *tensors: torch.Tensor) -> bool:
        """Whether the kernels take these tensors with this cache: the cache's dtype, or the
        compute dtype over an FP8 cache."""
        want = self.spec.dtype if self.spec.fp8_cache else kv_cache.dtype
        return all(t.dtype == want for t in tensors)

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        fits = (
            self._heads_are_rows(key) and self._heads_are_rows(value)
            and self._kernel_dtypes(kv_cache, key, value)
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
        )
        if not fits:
            super().write_kv(key, value, kv_cache, slot_mapping)
            return
        self._write_kv(key, value, kv_cache, slot_mapping)

    def _decode_into(self, out, query, kv_cache, md: AttentionMetadata) -> None:
        first = md.num_prefills
        tables, seq_lens = md.block_tables[first:], md.seq_lens[first:]
        fits = (
            self._heads_are_rows(query) and self._heads_are_rows(out)
            and self._kernel_dtypes(kv_cache, query, out)
            and tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
        )
        if not fits:
            super()._decode_into(out, query, kv_cache, md)
            return
        self._paged_decode(
            out, query, kv_cache, tables, seq_lens.contiguous(), self.spec.softmax_scale, self._window,
            logits_soft_cap=self._soft_cap,
        )

    def _prefill(self, query, key, value, kv_cache, md: AttentionMetadata, out) -> None:
        """Every prompt token of the step in one kernel call, as a decode over its own prefix.

        ``forward`` writes the step's keys and values before it attends, so all a prompt
        token attends to is in the cache: token t of a prompt with c cached positions is a
        decode of length c + t + 1 over the prompt's block table (``table_rows`` maps each
        row to its table, so nothing is gathered or copied per token). Against SDPA with a
        [query, key] mask (cached context) or causal SDPA (fresh prompts) this was 2-7x
        faster per layer on the measured shapes (docs/benchmarks/cpu.md).
        """
        n, p = md.num_prefill_tokens, md.num_prefills
        q, o = query[:n], out[:n]
        tables = md.block_tables[:p]
        fits = (
            self._heads_are_rows(q) and self._heads_are_rows(o)
            and self._kernel_dtypes(kv_cache, q, o)
            and tables.dtype == torch.int32
        )
        if not fits:
            super()._prefill(query, key, value, kv_cache, md, out)
            return
        rows, lens = _PROMPT_ROWS.of(md)
        self._paged_decode(o, q, kv_cache, tables, lens, self.spec.softmax_scale, self._window, rows,
                           logits_soft_cap=self._soft_cap)


class _LastStepRows:
    """:func:`_prompt_rows` of the step's metadata, computed by the first layer and reused by
    the others (every layer of a step gets the same metadata object)."""

    def __init__(self) -> None:
        self._held: tuple[AttentionMetadata, tuple[torch.Tensor, torch.Tensor]] | None = None

    def of(self, md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        held = self._held  # one read and one write: ranks running as threads never mix steps
        if held is None or held[0] is not md:
            held = self._held = (md, _prompt_rows(md))
        return held[1]


_PROMPT_ROWS = _LastStepRows()


def _prompt_rows(md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """For each prompt row of the step: (its sequence's block-table row, the length it
    attends over = its absolute position + 1), both int32 [num_prefill_tokens]. A padding
    row (negative slot) attends over its sequence's first position only: its output is
    unspecified, and its position may lie past the sequence's block table."""
    p, n = md.num_prefills, md.num_prefill_tokens
    starts = md.query_start_loc[: p + 1].long()
    counts = starts[1:] - starts[:-1]
    seq = torch.repeat_interleave(torch.arange(p), counts)
    pos = torch.arange(n) - starts[:-1][seq] + md.context_lens[:p].long()[seq]
    pos = pos.masked_fill_(md.slot_mapping[:n] < 0, 0)
    return seq.to(torch.int32), (pos + 1).to(torch.int32)
