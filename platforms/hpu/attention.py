"""HPU (Gaudi) attention written with plain torch ops in a graph-friendly, bucketed form.

KV layout: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (keys then values), the
``[blocks, block, kv_heads, head]`` layout Gaudi's gather-based paged attention uses; one
slot's key is a contiguous ``[num_kv_heads, head_size]`` row.

What makes it graph-friendly: no data-dependent shapes and no per-sequence Python loop.
Every step is split into two groups (prefills, decodes); each group is padded to bucketed
sizes from :class:`~platforms.hpu.buckets.BucketPolicy` (sequences, longest query, context
blocks), its context is gathered from the cache with one ``index_select`` over the padded
block tables, and attention is two batched matmuls under a mask. Shapes are chosen from the
host-side ``max_query_len`` / ``max_seq_len`` / group sizes, so building them never waits on
the device. Padded rows and padded table entries read block 0 and are masked out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.attention import (
    AttentionBackend,
    AttentionMetadata,
    index_copy_blocks,
    index_swap_blocks,
)
from platforms.hpu.buckets import BucketPolicy


@dataclass(frozen=True)
class GroupShape:
    """Padded sizes of one group (the shape an HPU graph is compiled for)."""

    seqs: int
    query: int
    blocks: int


def group_shape(
    policy: BucketPolicy, num_seqs: int, max_query: int, max_seq_len: int, block_size: int
) -> GroupShape:
    """Bucketed sizes for a group of ``num_seqs`` sequences (host ints only)."""
    blocks = -(-max_seq_len // block_size)
    return GroupShape(
        seqs=policy.pad_seqs(num_seqs),
        query=1 if max_query == 1 else policy.pad_query(max_query),
        blocks=policy.pad_blocks(blocks),
    )


class HpuAttentionBackend(AttentionBackend):
    name = "hpu_bucketed"
    policy = BucketPolicy()
    """Bucket policy of every layer (see :mod:`platforms.hpu.buckets`)."""

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        """Static-shape write: padding rows (slot < 0) are redirected to repeat the first
        real row, so every index_copy_ has the batch's shape and duplicates carry identical
        data (the result does not depend on which duplicate lands last)."""
        valid = slot_mapping >= 0
        if not bool(valid.any()):  # all padding: nothing to write
            return
        rows = torch.arange(slot_mapping.shape[0], device=slot_mapping.device)
        src = torch.where(valid, rows, valid.to(torch.int64).argmax())
        slots = slot_mapping.index_select(0, src)
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])  # [2, slots, kvh, d]
        flat[0].index_copy_(0, slots, key.index_select(0, src).to(flat.dtype))
        flat[1].index_copy_(0, slots, value.index_select(0, src).to(flat.dtype))

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        """Write this step's K/V, then attend over the cache (new tokens included)."""
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        md = metadata
        out = torch.empty_like(query)
        n_pre = md.num_prefill_tokens
        if md.num_prefills:
            seqs = slice(0, md.num_prefills)
            out[:n_pre] = self._attend_group(query[:n_pre], kv_cache, md, seqs, md.max_query_len)
        if md.num_decode_tokens:
            seqs = slice(md.num_prefills, md.num_seqs)
            out[n_pre:] = self._attend_group(query[n_pre:], kv_cache, md, seqs, 1)
        return out

    # ---- one group (all prefills or all decodes) ---------------------------------------
    def _attend_group(self, query, kv_cache, md: AttentionMetadata, seqs: slice, max_query: int):
        """query: [rows, H, D] of the group's sequences -> [rows, H, D]."""
        bs = kv_cache.shape[2]
        n = seqs.stop - seqs.start
        lens = md.seq_lens_host[seqs] if md.seq_lens_host else ()
        shape = group_shape(self.policy, n, max_query, max(lens, default=md.max_seq_len), bs)
        starts = md.query_start_loc[seqs.start : seqs.stop + 1].long()
        starts = starts - starts[0]
        q_lens = starts[1:] - starts[:-1]
        ctx = md.context_lens[seqs].long()
        tables = md.block_tables[seqs, : shape.blocks].long()
        # Pad sequences with empty ones and tables with block 0; both are masked below.
        pad_n = shape.seqs - n
        q_lens, ctx = F.pad(q_lens, (0, pad_n)), F.pad(ctx, (0, pad_n))
        tables = F.pad(tables, (0, shape.blocks - tables.shape[1], 0, pad_n))
        q_starts = F.pad(starts[:-1], (0, pad_n), value=0)

        q_pad, row_ok = self._pad_queries(query, q_starts, q_lens, shape.query)
        k, v = self._gather(kv_cache, tables)  # [S, L, kvh, D] each
        mask = self._mask(ctx, row_ok, shape.query, k.shape[1])
        o = self._sdpa(q_pad, k, v, mask)  # [S, Q, H, D]
        # Back to flat rows: row r belongs to sequence seq_of[r] at query index r - start.
        rows = torch.arange(query.shape[0], device=query.device)
        seq_of = torch.searchsorted(starts[1:], rows, right=True)
        return o[seq_of, rows - starts.index_select(0, seq_of)]

    @staticmethod
    def _pad_queries(query, q_starts, q_lens, q_pad: int):
        """[rows, H, D] -> [S, q_pad, H, D] plus [S, q_pad] bool of real rows."""
        j = torch.arange(q_pad, device=query.device)
        row_ok = j.unsqueeze(0) < q_lens.unsqueeze(1)
        idx = (q_starts.unsqueeze(1) + j).clamp(max=query.shape[0] - 1)
        idx = torch.where(row_ok, idx, 0)
        return query.index_select(0, idx.reshape(-1)).view(*idx.shape, *query.shape[1:]), row_ok

    def _gather(self, kv_cache, tables):
        """Context of each padded sequence: [S, blocks * block_size, kvh, D] for K and V."""
        s, nb = tables.shape
        flat_ids = tables.reshape(-1)
        k = kv_cache[0].index_select(0, flat_ids)  # [S*nb, bs, kvh, D]
        v = kv_cache[1].index_select(0, flat_ids)
        length = nb * kv_cache.shape[2]
        return k.view(s, length, *k.shape[2:]), v.view(s, length, *v.shape[2:])

    def _mask(self, ctx, row_ok, q_pad: int, length: int):
        """[S, q_pad, L] bool: causal, within the window, real rows only."""
        qpos = ctx.unsqueeze(1) + torch.arange(q_pad, device=ctx.device)  # [S, Q]
        kpos = torch.arange(length, device=ctx.device)
        allowed = kpos.view(1, 1, -1) <= qpos.unsqueeze(2)
        if self.spec.sliding_window is not None:
            allowed &= kpos.view(1, 1, -1) > (qpos - self.spec.sliding_window).unsqueeze(2)
        # A padded row attends to position 0 only, so its softmax never sees an empty row.
        only_first = (kpos == 0).view(1, 1, -1)
        return torch.where(row_ok.unsqueeze(2), allowed, only_first)

    def _sdpa(self, q, k, v, mask):
        """q [S, Q, H, D], k/v [S, L, kvh, D], mask [S, Q, L] -> [S, Q, H, D].

        Query heads are grouped by KV head (head h reads KV head h // group) so every KV
        row is read once per group rather than once per query head.
        """
        s, nq, h, d = q.shape
        kvh = k.shape[2]
        g = h // kvh
        qg = q.view(s, nq, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(s, kvh, g * nq, d)
        kt = k.to(q.dtype).permute(0, 2, 3, 1)  # [S, kvh, D, L]
        vv = v.to(q.dtype).permute(0, 2, 1, 3)  # [S, kvh, L, D]
        scores = torch.matmul(qg, kt).float() * self.spec.softmax_scale  # [S, kvh, g*Q, L]
        m = mask.unsqueeze(1).unsqueeze(2).expand(s, 1, g, nq, mask.shape[-1])
        scores = scores.masked_fill(~m.reshape(s, 1, g * nq, -1), float("-inf"))
        probs = scores.softmax(-1).to(q.dtype)
        o = torch.matmul(probs, vv)  # [S, kvh, g*Q, D]
        return o.view(s, kvh, g, nq, d).permute(0, 3, 1, 2, 4).reshape(s, nq, h, d)

    # ---- block moves ------------------------------------------------------------------
    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        index_copy_blocks(kv_caches, pairs, block_dim=1)

    @staticmethod
    def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        index_swap_blocks(src, dst, pairs, block_dim=1)
