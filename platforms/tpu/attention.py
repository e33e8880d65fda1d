"""TPU attention for torch-xla: bucketed static shapes, Pallas paged decode on a real TPU.

KV layout: ``[2, num_kv_heads, num_blocks, block_size, head_size]`` (keys then values), so
``kv_cache[0]`` is the ``[kv_heads, pages, page_size, head]`` page array that the Pallas
paged-attention kernel reads.

The core builds metadata with exact sizes; this backend re-lays every step's attention
inputs into the buckets of :mod:`platforms.tpu.buckets` (host-built index tensors, so only
their bucketed shapes reach XLA). Paths:

* prefill (with or without cached context): XLA gather path — gather each sequence's
  blocks, one masked softmax over ``[seqs, kv_heads, group, query, keys]``;
* decode: ``torch_xla.experimental.custom_kernel.paged_attention`` (Pallas) when running
  on a TPU and the shape fits the kernel; otherwise the same XLA gather path.
"""

from __future__ import annotations

from typing import Any

import torch

from core.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    index_copy_blocks,
    index_swap_blocks,
)
from platforms.tpu.buckets import BucketPolicy, DecodePlan, PrefillPlan

PALLAS_HEAD_MULTIPLE = 128
"""Pallas paged attention tiles the head dimension by the TPU lane width."""


def _xla_views():
    """Leave inference mode for the body: torch-xla cannot create a view (``view``,
    ``select``, ``t``) of a tensor made outside inference mode while inside it ("Cannot set
    version_counter for inference tensor"), and the KV cache is made outside. Nothing here
    needs grad, so leaving it costs nothing."""
    return torch.inference_mode(False)


def _int_tensor(data: Any, device: torch.device) -> torch.Tensor:
    return torch.tensor(data, dtype=torch.int32).to(device)


def _long_tensor(data: Any, device: torch.device) -> torch.Tensor:
    return torch.tensor(data, dtype=torch.int64).to(device)


class TpuAttentionBackend(AttentionBackend):
    name = "xla_paged"
    policy = BucketPolicy()

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
        seq = md.seq_lens_host or tuple(md.seq_lens.tolist())
        ctx = md.context_lens_host or tuple(md.context_lens.tolist())
        tables = md.block_tables.cpu().tolist()  # device data only: a copy, not a compile
        bs = kv_cache.shape[3]
        p, n_pre = md.num_prefills, md.num_prefill_tokens
        parts = []
        if p:
            qlens = [s - c for s, c in zip(seq[:p], ctx[:p])]
            plan = self.policy.plan_prefill(qlens, list(ctx[:p]), tables[:p], bs)
            parts.append(self._prefill(query[:n_pre], kv_cache, plan))
        if md.num_decode_tokens:
            plan = self.policy.plan_decode(list(seq[p:]), tables[p:], bs)
            parts.append(self._decode(query[n_pre:], kv_cache, plan))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

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

    def _prefill(self, query, kv_cache, plan: PrefillPlan) -> torch.Tensor:
        dev = query.device
        s, r = plan.num_seqs, plan.query_len
        q = query.index_select(0, _long_tensor(plan.gather_rows, dev)).view(s, r, *query.shape[1:])
        k, v = self._gather_context(kv_cache, _long_tensor(plan.block_table, dev))
        qpos = _long_tensor(plan.positions, dev).view(s, r)
        out = self._attend(q, k, v, self._mask(qpos, k.shape[2]))
        out = out.view(s * r, *query.shape[1:])
        return out.index_select(0, _long_tensor(plan.scatter_rows, dev)).to(query.dtype)

    def _decode(self, query, kv_cache, plan: DecodePlan) -> torch.Tensor:
        dev = query.device
        q = query.index_select(0, _long_tensor(plan.gather_rows, dev))  # [S, H, D]
        lengths = _int_tensor(plan.lengths, dev)
        if self.use_pallas:
            out = self._pallas_decode(q, kv_cache, lengths, _int_tensor(plan.block_table, dev))
        else:
            k, v = self._gather_context(kv_cache, _long_tensor(plan.block_table, dev))
            out = self._attend(
                q.unsqueeze(1), k, v, self._mask(lengths.long() - 1, k.shape[2])[:, None]
            )
            out = out.squeeze(1)
        return out[: query.shape[0]].to(query.dtype)

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
