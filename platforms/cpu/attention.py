"""CPU attention: SDPA for prompts, a block-table gather for decode.

KV layout: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (keys then values),
so one slot's key is a contiguous ``[num_kv_heads, head_size]`` row and writes are one
``index_copy_`` over the flattened slot dimension.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.attention import AttentionBackend, AttentionMetadata


class CpuAttentionBackend(AttentionBackend):
    name = "cpu_sdpa"

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
        flat[0].index_copy_(0, slot_mapping, key.to(flat.dtype))
        flat[1].index_copy_(0, slot_mapping, value.to(flat.dtype))

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        n_pre = metadata.num_prefill_tokens
        if metadata.num_prefills:
            self._prefill(query, key, value, kv_cache, metadata, out)
        if metadata.num_decode_tokens:
            out[n_pre:] = self._decode(query[n_pre:], kv_cache, metadata)
        return out

    # ---- prompts ----------------------------------------------------------------------
    def _prefill(self, query, key, value, kv_cache, md: AttentionMetadata, out) -> None:
        starts = md.query_start_loc.tolist()
        context = md.context_lens_host or tuple(md.context_lens.tolist())
        window = self.spec.sliding_window
        for i in range(md.num_prefills):
            s, e, ctx = starts[i], starts[i + 1], context[i]
            q = query[s:e].transpose(0, 1)  # [H, q, D]
            if ctx == 0 and window is None:
                k, v = key[s:e].transpose(0, 1), value[s:e].transpose(0, 1)
                o = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.spec.softmax_scale, enable_gqa=True
                )
            else:
                k, v = self._gather_one(kv_cache, md.block_tables[i], ctx + e - s)
                qpos = torch.arange(ctx, ctx + e - s).unsqueeze(1)
                kpos = torch.arange(ctx + e - s).unsqueeze(0)
                allowed = kpos <= qpos
                if window is not None:
                    allowed &= kpos > qpos - window
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=allowed, scale=self.spec.softmax_scale, enable_gqa=True
                )
            out[s:e] = o.transpose(0, 1).to(out.dtype)

    def _gather_one(self, kv_cache, block_table, length: int):
        """Keys/values of positions [0, length) of one sequence as [kvh, length, D]."""
        bs = kv_cache.shape[2]
        pos = torch.arange(length)
        slots = block_table[pos // bs].long() * bs + pos % bs
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        k = flat[0].index_select(0, slots).transpose(0, 1)
        v = flat[1].index_select(0, slots).transpose(0, 1)
        return k.to(self.spec.dtype), v.to(self.spec.dtype)

    # ---- decode -----------------------------------------------------------------------
    def _decode(self, query, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        """One new token per sequence; gather each context (padded to the longest)."""
        first = md.num_prefills
        seq_lens = md.seq_lens[first:].long()
        tables = md.block_tables[first:].long()
        bs = kv_cache.shape[2]
        max_len = int(seq_lens.max())
        pos = torch.arange(max_len)
        slots = tables[:, pos // bs] * bs + pos % bs  # [B, L]
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        b, kvh, d = slots.shape[0], flat.shape[2], flat.shape[3]
        k = flat[0].index_select(0, slots.reshape(-1)).view(b, max_len, kvh, d).transpose(1, 2)
        v = flat[1].index_select(0, slots.reshape(-1)).view(b, max_len, kvh, d).transpose(1, 2)
        allowed = pos.unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, L]
        if self.spec.sliding_window is not None:
            allowed &= pos.unsqueeze(0) >= (seq_lens - self.spec.sliding_window).unsqueeze(1)
        q = query.unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(
            q,
            k.to(q.dtype),
            v.to(q.dtype),
            attn_mask=allowed[:, None, None, :],
            scale=self.spec.softmax_scale,
            enable_gqa=True,
        )
        return o.squeeze(2)

    # ---- block moves ------------------------------------------------------------------
    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        if pairs.numel() == 0:
            return
        src, dst = pairs[:, 0].long(), pairs[:, 1].long()
        for cache in kv_caches:
            cache.index_copy_(1, dst, cache.index_select(1, src))

    @staticmethod
    def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        if pairs.numel() == 0:
            return
        s = pairs[:, 0].to(device=src.device, dtype=torch.long)
        d = pairs[:, 1].to(device=dst.device, dtype=torch.long)
        dst.index_copy_(1, d, src.index_select(1, s).to(dst.device))
