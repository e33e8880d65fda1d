"""XPU attention through IPEX's paged-attention ops.

KV layout: ``[2, num_blocks, num_kv_heads, block_size, head_size]`` (keys then values).
``kv_cache[0]`` and ``kv_cache[1]`` are then exactly the ``[blocks, kv_heads, block, head]``
key and value caches that ``intel_extension_for_pytorch.llm.modules.PagedAttention`` reads
and writes, on an Intel GPU and on IPEX's CPU kernels alike:

* ``reshape_and_cache`` stores this step's keys/values at their slots;
* ``flash_attn_varlen_func`` runs the prefill rows (also chunked prefill: queries are the
  last ``query_len`` positions of each sequence, keys come from the paged cache);
* ``single_query_cached_kv_attention`` runs the decode rows.

IPEX's ops expose no copy/swap for this layout on CPU, so block moves are batched torch
index ops (one gather and one scatter per layer, whatever the number of pairs).
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


def paged_attention_ops() -> Any:
    """IPEX's ``PagedAttention`` op collection (imports IPEX on first use)."""
    from intel_extension_for_pytorch.llm.modules import PagedAttention

    return PagedAttention


class XpuAttentionBackend(AttentionBackend):
    name = "ipex_paged"

    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        self._ops = paged_attention_ops()
        group = spec.num_heads // spec.num_kv_heads
        # query head h reads kv head h // group (GQA/MQA); IPEX's decode op takes it explicitly
        self._head_mapping = torch.arange(spec.num_kv_heads, dtype=torch.int32).repeat_interleave(
            group
        )

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        # IPEX's reshape_and_cache does not skip negative slots (on CPU it writes out of
        # bounds), so padding rows are dropped here.
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        if slot_mapping.numel() == 0:
            return
        self._ops.reshape_and_cache(
            key.to(kv_cache.dtype).contiguous(),
            value.to(kv_cache.dtype).contiguous(),
            kv_cache[0],
            kv_cache[1],
            slot_mapping.to(torch.int32),
        )

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        query = query.contiguous()
        out = torch.empty_like(query)
        n_pre = metadata.num_prefill_tokens
        if metadata.num_prefills:
            self._prefill(out[:n_pre], query[:n_pre], kv_cache, metadata)
        if metadata.num_decode_tokens:
            self._decode(out[n_pre:], query[n_pre:], kv_cache, metadata)
        return out

    def _host_lens(self, md: AttentionMetadata) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(seq_lens, context_lens) as Python ints, without a device sync when possible."""
        seq = md.seq_lens_host or tuple(md.seq_lens.tolist())
        ctx = md.context_lens_host or tuple(md.context_lens.tolist())
        return seq, ctx

    def _prefill(self, out, query, kv_cache, md: AttentionMetadata) -> None:
        """Prefill rows (with or without cached context) through IPEX's varlen kernel."""
        p = md.num_prefills
        seq, ctx = self._host_lens(md)
        seq_lens = md.seq_lens[:p].to(torch.int32)
        cu_kv = torch.zeros(p + 1, dtype=torch.int32, device=query.device)
        torch.cumsum(seq_lens, 0, out=cu_kv[1:])
        window = self.spec.sliding_window
        self._ops.flash_attn_varlen_func(
            out,
            query,
            kv_cache[0],
            kv_cache[1],
            md.query_start_loc[: p + 1].to(torch.int32),
            cu_kv,
            max(s - c for s, c in zip(seq[:p], ctx[:p])),
            max(seq[:p]),
            self.spec.softmax_scale,
            True,
            md.block_tables[:p].to(torch.int32),
            None,
            # IPEX counts the left window without the query's own position
            -1 if window is None else window - 1,
            -1 if window is None else 0,
        )

    def _decode(self, out, query, kv_cache, md: AttentionMetadata) -> None:
        """One new token per sequence through IPEX's paged decode kernel."""
        p = md.num_prefills
        seq, _ = self._host_lens(md)
        window = self.spec.sliding_window
        self._ops.single_query_cached_kv_attention(
            out,
            query,
            kv_cache[0],
            kv_cache[1],
            self._head_mapping.to(query.device),
            self.spec.softmax_scale,
            md.block_tables[p:].to(torch.int32),
            md.seq_lens[p:].to(torch.int32),
            kv_cache.shape[3],
            max(seq[p:]),
            None,
            -1 if window is None else window,
        )

    # ---- block moves ------------------------------------------------------------------
    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        index_copy_blocks(kv_caches, pairs, block_dim=1)

    @staticmethod
    def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        index_swap_blocks(src, dst, pairs, block_dim=1)
