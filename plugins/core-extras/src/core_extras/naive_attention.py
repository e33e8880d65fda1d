"""``cpu_naive``: a second attention backend for platform cpu, added by a plugin through
the ``core_attention_backends`` hook and chosen with ``--attention-backend cpu_naive``.

Written to be read, not to be fast: every sequence (prefill chunk or decode) is attended
on its own with an explicit float32 softmax. Useful to bisect a numerical problem: if the
default backend and this one disagree, the bug is in attention.

KV layout (token-major, keys and values of one token side by side)::

    kv_cache: [num_blocks, block_size, 2, num_kv_heads, head_size]
    kv_cache.view(-1, 2, kvh, head)[slot] = (key, value) of the token at ``slot``
"""

from __future__ import annotations

import torch

from core.attention import AttentionBackend, AttentionMetadata


class NaiveCpuAttentionBackend(AttentionBackend):
    name = "cpu_naive"

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (num_blocks, block_size, 2, num_kv_heads, head_size)

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        slots = kv_cache.view(-1, *kv_cache.shape[2:])  # [slots, 2, kvh, head]
        real = slot_mapping >= 0  # negative slots are padding: never written
        slots[slot_mapping[real], 0] = key[real].to(kv_cache.dtype)
        slots[slot_mapping[real], 1] = value[real].to(kv_cache.dtype)

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        out = torch.zeros_like(query)
        starts = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        for i in range(metadata.num_seqs):  # prefills and decodes alike
            s, e = starts[i], starts[i + 1]
            out[s:e] = self._one_sequence(query[s:e], kv_cache, metadata.block_tables[i], seq_lens[i])
        return out

    def _one_sequence(self, q, kv_cache, table, seq_len: int) -> torch.Tensor:
        """q: the sequence's new rows [n, H, D]; they are its last n positions."""
        bs = kv_cache.shape[1]
        positions = torch.arange(seq_len)
        slots = table[positions // bs].long() * bs + positions % bs
        kv = kv_cache.view(-1, *kv_cache.shape[2:])[slots].float()  # [L, 2, kvh, D]
        group = q.shape[1] // kv.shape[2]
        k = kv[:, 0].repeat_interleave(group, dim=1)  # [L, H, D]
        v = kv[:, 1].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * self.spec.softmax_scale
        q_pos = positions[seq_len - q.shape[0] :, None]  # [n, 1]
        hidden = positions[None, :] > q_pos  # the future
        if self.spec.sliding_window is not None:
            hidden |= positions[None, :] <= q_pos - self.spec.sliding_window
        scores = scores.masked_fill(hidden[None], float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)

    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        if pairs.numel() == 0:
            return
        src, dst = pairs[:, 0].long(), pairs[:, 1].long()
        for cache in kv_caches:
            cache[dst] = cache[src]  # the right side is gathered before anything is written

    @staticmethod
    def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        if pairs.numel() == 0:
            return
        s = pairs[:, 0].to(device=src.device, dtype=torch.long)
        d = pairs[:, 1].to(device=dst.device, dtype=torch.long)
        dst[d] = src[s].to(dst.device)
