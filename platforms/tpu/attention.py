"""TPU attention for torch-xla: static shapes throughout, Pallas paged decode on a real TPU.

KV layout: ``[2, num_kv_heads, num_blocks, block_size, head_size]`` (keys then values), so
``kv_cache[0]`` is the ``[kv_heads, pages, page_size, head]`` page array that the Pallas
paged-attention kernel reads.

The runner pads every step to the TPU's buckets before it reaches the device (the
platform's batch shaper, :mod:`core.batch_shape`), so this backend receives bucketed
metadata and builds every index it needs on the device from it
(:func:`core.batch_shape.rows_of_groups`): no host data, no shape taken from the batch.
Paths:

* prefill (with or without cached context): XLA gather path — gather each sequence's
  blocks, one masked softmax over ``[seqs, kv_heads, group, query, keys]``;
* decode: ``torch_xla.experimental.custom_kernel.paged_attention`` (Pallas) when running
  on a TPU and the shape fits the kernel; otherwise the same XLA gather path.
"""

from __future__ import annotations

import torch

from core.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    index_copy_blocks,
    index_swap_blocks,
)
from core.batch_shape import GroupRows, rows_of_groups, scatter_groups

PALLAS_HEAD_MULTIPLE = 128
"""Pallas paged attention tiles the head dimension by the TPU lane width."""


def _xla_views():
    """Leave inference mode for the body: torch-xla cannot create a view (``view``,
    ``select``, ``t``) of a tensor made outside inference mode while inside it ("Cannot set
    version_counter for inference tensor"), and the KV cache is made outside. Nothing here
    needs grad, so leaving it costs nothing."""
    return torch.inference_mode(False)


class TpuAttentionBackend(AttentionBackend):
    name = "xla_paged"

    pallas = False
    """Decode through the Pallas kernel when the layer shape fits it (TPU only)."""

    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        self.use_pallas = (
            self.pallas
            and spec.sliding_window is None
            and spec.head_size % PALLAS_HEAD_MULTIPLE == 0
        )

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_size)

    # ---- cache writes -------------------------------------------------------------------
    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        """One scatter of static shape. A padding row (negative slot) is redirected to the
        slot of the first real row and carries that row's key/value, so a duplicate index
        always writes identical data and the result does not depend on scatter order. With
        no real row at all, every row rewrites slot 0 with its current contents."""
        n = slot_mapping.shape[0]
        if n == 0:
            return
        with _xla_views():
            self._scatter_kv(key, value, kv_cache, slot_mapping)

    @staticmethod
    def _scatter_kv(key, value, kv_cache, slot_mapping) -> None:
        n = slot_mapping.shape[0]
        _, kvh, nb, bs, d = kv_cache.shape
        flat = kv_cache.view(2, kvh, nb * bs, d)
        valid = slot_mapping >= 0
        any_valid = valid.any()
        first = torch.argmax(valid.to(torch.int32))  # first real row (0 if none)
        src = torch.where(valid, torch.arange(n, device=slot_mapping.device), first)
        slots = torch.where(any_valid, slot_mapping[src], torch.zeros_like(slot_mapping))
        kv = torch.stack([key[src], value[src]]).to(kv_cache.dtype)  # [2, n, kvh, d]
        kv = torch.where(any_valid, kv, flat[:, :, :1].transpose(1, 2))
        flat.index_copy_(2, slots, kv.transpose(1, 2))

    # ---- attention ----------------------------------------------------------------------
    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        with _xla_views():
            return self._attention(query, kv_cache, metadata)

    def _attention(self, query, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        rows = rows_of_groups(md, query.shape[0])
        pre = self._prefill(query, kv_cache, md, rows) if md.num_prefills else None
        dec = self._decode(query, kv_cache, md, rows) if md.num_decode_tokens else None
        return scatter_groups(rows, md.num_prefills, pre, dec)

    def _gather_context(self, kv_cache, table: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Keys/values of each row's blocks: two [kv_heads, seqs, blocks * block, head]."""
        _, kvh, _, bs, d = kv_cache.shape
        s, b = table.shape
        k = kv_cache[0].index_select(1, table.reshape(-1)).view(kvh, s, b * bs, d)
        v = kv_cache[1].index_select(1, table.reshape(-1)).view(kvh, s, b * bs, d)
        return k.float(), v.float()

    def _attend(self, q, k, v, allowed) -> torch.Tensor:
        """q [s, r, H, D] over k/v [kvh, s, L, D] where ``allowed`` [s, r, L]; -> [s, r, H, D]."""
        s, r, h, d = q.shape
        kvh = k.shape[0]
        q = q.float().view(s, r, kvh, h // kvh, d)
        scores = torch.einsum("srkgd,ksld->skgrl", q, k) * self.spec.softmax_scale
        scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
        out = torch.einsum("skgrl,ksld->srkgd", scores.softmax(-1), v)
        return out.reshape(s, r, h, d)

    def _mask(self, qpos: torch.Tensor, num_keys: int) -> torch.Tensor:
        """[..., num_keys] True where key position kpos may be read from query position qpos."""
        kpos = torch.arange(num_keys, device=qpos.device)
        allowed = kpos <= qpos.unsqueeze(-1)
        if self.spec.sliding_window is not None:
            allowed &= kpos > qpos.unsqueeze(-1) - self.spec.sliding_window
        return allowed

    def _prefill(self, query, kv_cache, md: AttentionMetadata, rows: GroupRows) -> torch.Tensor:
        """The prefills as ``[seqs, query rows]`` padded queries -> [seqs, rows, H, D]."""
        s, r = rows.prefill_rows.shape
        q = query.index_select(0, rows.prefill_rows.reshape(-1)).view(s, r, *query.shape[1:])
        k, v = self._gather_context(kv_cache, md.block_tables[:s].long())
        allowed = self._mask(rows.prefill_positions, k.shape[2])
        # A padding row reads key 0 only (a finite softmax); its output is dropped.
        first = torch.arange(k.shape[2], device=q.device) == 0
        allowed = torch.where(rows.prefill_valid.unsqueeze(-1), allowed, first)
        return self._attend(q, k, v, allowed).to(query.dtype)

    def _decode(self, query, kv_cache, md: AttentionMetadata, rows: GroupRows) -> torch.Tensor:
        """One row per decode -> [seqs, H, D] (padding decodes read block 0 at length 1)."""
        p = md.num_prefills
        q = query.index_select(0, rows.decode_rows)  # [S, H, D]
        lengths, table = md.seq_lens[p:], md.block_tables[p:]
        if self.use_pallas:
            out = self._pallas_decode(q, kv_cache, lengths.int(), table.int())
        else:
            k, v = self._gather_context(kv_cache, table.long())
            allowed = self._mask(lengths.long() - 1, k.shape[2])[:, None]
            out = self._attend(q.unsqueeze(1), k, v, allowed).squeeze(1)
        return out.to(query.dtype)

    def _pallas_decode(self, q, kv_cache, lengths, table) -> torch.Tensor:
        """Pallas paged attention (TPU only). The kernel has no scale argument, so the query
        is pre-scaled; it reads the page arrays in place, no gather."""
        from torch_xla.experimental.custom_kernel import paged_attention

        pages_per_block = min(table.shape[1], 8)  # both powers of two: it divides the width
        return paged_attention(
            q * self.spec.softmax_scale, kv_cache[0], kv_cache[1], lengths, table, pages_per_block
        )

    # ---- block moves --------------------------------------------------------------------
    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        with _xla_views():
            index_copy_blocks(kv_caches, pairs, block_dim=2)

    @staticmethod
    def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        with _xla_views():
            index_swap_blocks(src, dst, pairs, block_dim=2)


class PallasTpuAttentionBackend(TpuAttentionBackend):
    """The TPU default: Pallas paged attention for decode (layers whose head size is not
    a multiple of 128, or that use a sliding window, fall back to the gather path)."""

    name = "pallas_paged"
    pallas = True
