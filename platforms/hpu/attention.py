"""HPU (Gaudi) attention written with plain torch ops in a graph-friendly, bucketed form.

KV layout: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (keys then values), the
``[blocks, block, kv_heads, head]`` layout Gaudi's gather-based paged attention uses; one
slot's key is a contiguous ``[num_kv_heads, head_size]`` row.

What makes it graph-friendly: no data-dependent shapes, no host data and no per-sequence
Python loop. The runner pads every step to the buckets of
:class:`~platforms.hpu.buckets.BucketPolicy` before upload (the platform's batch shaper,
:mod:`core.batch_shape`), so the metadata arrives bucketed: the prefills are attended as
``[sequences, max_query_len]`` padded queries, the decodes as one row each. Each group's
context is gathered from the cache with one ``index_select`` over its block tables, and
attention is two batched matmuls under a mask. Every index is computed on the device from
the metadata (:func:`core.batch_shape.rows_of_groups`); padded rows and table entries read
block 0 and are masked out.
"""

from __future__ import annotations

import torch

from core.attention import (
    AttentionBackend,
    AttentionMetadata,
    index_copy_blocks,
    index_swap_blocks,
)
from core.batch_shape import GroupRows, rows_of_groups, scatter_groups


class HpuAttentionBackend(AttentionBackend):
    name = "hpu_bucketed"

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        """Static-shape write with no host sync: padding rows (slot < 0) are redirected to
        repeat the first real row, so every index_copy_ has the batch's shape and duplicates
        carry identical data (the result does not depend on which duplicate lands last). A
        batch of padding only rewrites slot 0 with its own contents."""
        if slot_mapping.shape[0] == 0:
            return
        valid = slot_mapping >= 0
        any_valid = valid.any()
        rows = torch.arange(slot_mapping.shape[0], device=slot_mapping.device)
        src = torch.where(valid, rows, valid.to(torch.int64).argmax())
        slots = torch.where(any_valid, slot_mapping.index_select(0, src), 0)
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])  # [2, slots, kvh, d]
        for part, new in ((0, key), (1, value)):
            rows_new = new.index_select(0, src).to(flat.dtype)
            flat[part].index_copy_(0, slots, torch.where(any_valid, rows_new, flat[part, :1]))

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        """Write this step's K/V, then attend over the cache (new tokens included)."""
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        md = metadata
        rows = rows_of_groups(md, query.shape[0])
        pre = self._prefills(query, kv_cache, md, rows) if md.num_prefills else None
        dec = self._decodes(query, kv_cache, md, rows) if md.num_decode_tokens else None
        return scatter_groups(rows, md.num_prefills, pre, dec)

    # ---- the two groups -------------------------------------------------------------------
    def _prefills(self, query, kv_cache, md: AttentionMetadata, rows: GroupRows):
        """query [rows, H, D] -> [prefills, max_query_len, H, D] (padded query rows)."""
        s, q = rows.prefill_rows.shape
        q_pad = query.index_select(0, rows.prefill_rows.reshape(-1)).view(s, q, *query.shape[1:])
        k, v = self._gather(kv_cache, md.block_tables[:s].long())  # [S, L, kvh, D] each
        mask = self._mask(rows.prefill_positions, rows.prefill_valid, k.shape[1])
        return self._sdpa(q_pad, k, v, mask)

    def _decodes(self, query, kv_cache, md: AttentionMetadata, rows: GroupRows):
        """query [rows, H, D] -> [decodes, H, D]; a padding decode reads block 0 only."""
        p = md.num_prefills
        q = query.index_select(0, rows.decode_rows).unsqueeze(1)  # [S, 1, H, D]
        k, v = self._gather(kv_cache, md.block_tables[p:].long())
        qpos = md.seq_lens[p:].long().unsqueeze(1) - 1  # the new token's position
        mask = self._mask(qpos, torch.ones_like(qpos, dtype=torch.bool), k.shape[1])
        return self._sdpa(q, k, v, mask).squeeze(1)

    def _gather(self, kv_cache, tables):
        """Context of each padded sequence: [S, blocks * block_size, kvh, D] for K and V."""
        s, nb = tables.shape
        flat_ids = tables.reshape(-1)
        k = kv_cache[0].index_select(0, flat_ids)  # [S*nb, bs, kvh, D]
        v = kv_cache[1].index_select(0, flat_ids)
        length = nb * kv_cache.shape[2]
        return k.view(s, length, *k.shape[2:]), v.view(s, length, *v.shape[2:])

    def _mask(self, qpos, row_ok, length: int):
        """[S, Q, L] bool: causal, within the window, real rows only (qpos, row_ok [S, Q])."""
        kpos = torch.arange(length, device=qpos.device).view(1, 1, -1)
        allowed = kpos <= qpos.unsqueeze(2)
        if self.spec.sliding_window is not None:
            allowed &= kpos > (qpos - self.spec.sliding_window).unsqueeze(2)
        # A padded row attends to position 0 only, so its softmax never sees an empty row.
        return torch.where(row_ok.unsqueeze(2), allowed, kpos == 0)

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
