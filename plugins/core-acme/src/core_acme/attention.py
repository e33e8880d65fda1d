"""Paged attention and cache ops of the Acme NPU (emulated with torch on CPU tensors).

KV layout (one tensor per layer, block-major so one block of keys *and* values is one
contiguous DMA transfer)::

    kv_cache: [num_blocks, 2, num_kv_heads, head_size * block_size]
    kv_cache[b, 0, h].view(head_size, block_size)   keys, transposed: column t is token t
    kv_cache[b, 1, h].view(block_size, head_size)   values, row-major: row t is token t

Keys are stored transposed because the NPU's matrix unit computes ``q @ K^T`` from a
column-major operand: ``scores = q[H, D] @ K^T[D, block]`` reads the cache as it lies.
Slot ``s`` is token ``s % block_size`` of block ``s // block_size``; a negative slot is
padding and is never written.

Constraints of the (imagined) hardware, checked when a backend is built: block size 32
or 64; head size a multiple of 8 between 8 and 256; float32 or bfloat16. Softmax and
both matmuls run in float32 whatever the cache dtype (the NPU accumulates in fp32).
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

BLOCK_SIZES = (32, 64)
DTYPES = (torch.float32, torch.bfloat16)
HEAD_SIZE_MULTIPLE = 8
MAX_HEAD_SIZE = 256
QUERY_TILE = 128
"""Prompt rows attended per pass; bounds the score matrix at QUERY_TILE x context."""


def check_spec(spec: AttentionSpec) -> None:
    """Refuse a layer shape the Acme NPU cannot run, saying what to change."""
    if spec.block_size not in BLOCK_SIZES:
        raise ValueError(
            f"the Acme NPU pages KV in blocks of {list(BLOCK_SIZES)} tokens, got block size "
            f"{spec.block_size}; pass --block-size 32 or --block-size 64"
        )
    d = spec.head_size
    if d % HEAD_SIZE_MULTIPLE or not HEAD_SIZE_MULTIPLE <= d <= MAX_HEAD_SIZE:
        raise ValueError(
            f"the Acme NPU needs a head size that is a multiple of {HEAD_SIZE_MULTIPLE} between "
            f"{HEAD_SIZE_MULTIPLE} and {MAX_HEAD_SIZE}; this model has head size {d}, so it cannot "
            f"run on platform 'acme' (use --platform cpu)"
        )
    if spec.dtype not in DTYPES:
        raise ValueError(
            f"the Acme NPU computes attention in {[str(t) for t in DTYPES]}, got {spec.dtype}; "
            f"pass --dtype float32 or --dtype bfloat16"
        )
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError(
            f"{spec.num_heads} query heads cannot be grouped over {spec.num_kv_heads} KV heads"
        )


class AcmeAttentionBackend(AttentionBackend):
    name = "acme_paged"

    def __init__(self, spec: AttentionSpec):
        check_spec(spec)
        super().__init__(spec)

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (num_blocks, 2, num_kv_heads, head_size * block_size)

    # ---- views of the layout --------------------------------------------------------
    def _keys(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """[num_blocks, kvh, head, block] view of the (transposed) keys."""
        n, _, kvh, _ = kv_cache.shape
        return kv_cache[:, 0].view(n, kvh, self.spec.head_size, self.spec.block_size)

    def _values(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """[num_blocks, kvh, block, head] view of the values."""
        n, _, kvh, _ = kv_cache.shape
        return kv_cache[:, 1].view(n, kvh, self.spec.block_size, self.spec.head_size)

    # ---- cache ops ------------------------------------------------------------------
    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        real = slot_mapping >= 0
        if not bool(real.all()):  # padding rows are dropped before any index is formed
            key, value, slot_mapping = key[real], value[real], slot_mapping[real]
        if slot_mapping.numel() == 0:
            return
        bs = self.spec.block_size
        block, offset = slot_mapping // bs, slot_mapping % bs
        # Advanced indices on dims 0 and 3 (or 0 and 2) select [tokens, kvh, head].
        self._keys(kv_cache)[block, :, :, offset] = key.to(kv_cache.dtype)
        self._values(kv_cache)[block, :, offset, :] = value.to(kv_cache.dtype)

    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        index_copy_blocks(kv_caches, pairs, block_dim=0)

    @staticmethod
    def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        index_swap_blocks(src, dst, pairs, block_dim=0)

    # ---- attention ------------------------------------------------------------------
    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        md = metadata
        out = torch.zeros_like(query)  # rows past num_tokens (padding) stay zero
        seq_lens = md.seq_lens_host or tuple(md.seq_lens.tolist())
        starts = md.query_start_loc.tolist()
        for i in range(md.num_prefills):
            s, e = starts[i], starts[i + 1]
            out[s:e] = self._prefill(query[s:e], kv_cache, md.block_tables[i], seq_lens[i])
        if md.num_decode_tokens:
            s, e = md.num_prefill_tokens, md.num_prefill_tokens + md.num_decode_tokens
            tables = md.block_tables[md.num_prefills : md.num_seqs]
            out[s:e] = self._decode(query[s:e], kv_cache, tables, seq_lens[md.num_prefills :])
        return out

    def _prefill(self, q, kv_cache, table, seq_len: int) -> torch.Tensor:
        """One sequence's new rows [n, H, D]; its context is ``seq_len - n`` cached tokens."""
        n, ctx, dev = q.shape[0], seq_len - q.shape[0], q.device
        kt, v = self._gather(kv_cache, table[None, : self._blocks_for(seq_len)])
        out = torch.empty_like(q)
        for t0 in range(0, n, QUERY_TILE):
            t1 = min(n, t0 + QUERY_TILE)
            visible = ctx + t1  # causal: no row of this tile sees past its last row
            qpos = torch.arange(ctx + t0, ctx + t1, device=dev)
            kpos = torch.arange(visible, device=dev)
            allowed = kpos[None, :] <= qpos[:, None]
            if self.spec.sliding_window is not None:
                allowed &= kpos[None, :] > qpos[:, None] - self.spec.sliding_window
            o = self._attend(q[None, t0:t1], kt[..., :visible], v[:, :, :visible], allowed[None])
            out[t0:t1] = o[0]
        return out

    def _decode(self, q, kv_cache, tables, seq_lens: tuple[int, ...]) -> torch.Tensor:
        """One new row per sequence, all sequences in one batched pass."""
        longest, dev = max(seq_lens), q.device
        kt, v = self._gather(kv_cache, tables[:, : self._blocks_for(longest)])
        lens = torch.tensor(seq_lens, device=dev)[:, None]
        kpos = torch.arange(kt.shape[-1], device=dev)[None, :]
        allowed = kpos < lens  # [B, L]; the new token is at position len - 1
        if self.spec.sliding_window is not None:
            allowed &= kpos >= lens - self.spec.sliding_window
        return self._attend(q[:, None], kt, v, allowed[:, None, :])[:, 0]

    def _blocks_for(self, length: int) -> int:
        return -(-length // self.spec.block_size)

    def _gather(self, kv_cache, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys as K^T [B, kvh, D, L] and values [B, kvh, L, D] for block-table rows
        ``tables`` [B, nblk] (L = nblk * block_size, in position order)."""
        idx = tables.long()
        b, nblk = idx.shape
        kvh, d, bs = kv_cache.shape[2], self.spec.head_size, self.spec.block_size
        kt = self._keys(kv_cache)[idx]  # [B, nblk, kvh, D, bs]
        kt = kt.permute(0, 2, 3, 1, 4).reshape(b, kvh, d, nblk * bs)
        v = self._values(kv_cache)[idx]  # [B, nblk, kvh, bs, D]
        v = v.permute(0, 2, 1, 3, 4).reshape(b, kvh, nblk * bs, d)
        return kt, v

    def _attend(self, q, kt, v, allowed) -> torch.Tensor:
        """q [B, Q, H, D], kt [B, kvh, D, L], v [B, kvh, L, D], allowed [B, Q, L] bool
        -> [B, Q, H, D] in q's dtype. Every query row must allow at least one key."""
        b, nq, h, d = q.shape
        kvh = kt.shape[1]
        qf = q.float().view(b, nq, kvh, h // kvh, d).permute(0, 2, 3, 1, 4)  # [B, kvh, g, Q, D]
        scores = torch.matmul(qf, kt.float()[:, :, None]) * self.spec.softmax_scale
        scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
        probs = scores.softmax(dim=-1)  # [B, kvh, g, Q, L]
        # Never-visible keys (beyond a sequence, stale blocks) are zeroed: 0 * garbage could
        # still be NaN if a stale block held inf.
        used = allowed.any(dim=1)  # [B, L]
        vf = v.float().masked_fill(~used[:, None, :, None], 0.0)
        o = torch.matmul(probs, vf[:, :, None])  # [B, kvh, g, Q, D]
        return o.permute(0, 3, 1, 2, 4).reshape(b, nq, h, d).to(q.dtype)
