"""CUDA attention: our paged decode kernels (csrc/) for decode rows, torch's flash attention
for prompts (one variable-length call per run of fresh prompts, SDPA per chunk over cache).

Per-layer attention variants (Gemma 2/3): the softmax scale (``query_pre_attn_scalar``) and
the sliding window come from each layer's spec, in both paths. Attention-logit soft-capping
runs inside the decode kernel; SDPA has no hook for it, so soft-capped prompts take
:func:`soft_capped_attention` (plain torch, query rows in chunks of bounded score memory).

KV layout (one tensor per layer): ``[num_blocks, 2, num_kv_heads, block_size, head_size]``.
A block's keys and values are one contiguous span, so swaps and copy-on-write move one span
per block; the keys of one (block, kv head) are a contiguous ``[block_size, head_size]`` tile,
which the decode kernel streams with 16-byte coalesced copies.

Decode runs one of two kernels, chosen per batch by :func:`choose_decode_partition`:
v1 (one CTA per sequence x kv head covers the whole context) or v2 (each context is split into
partitions, one CTA each; the CTA that finishes a sequence's last partition merges them, or,
on ROCm, over an fp8 cache on tensor cores, and past the partitions whose weights the kernel's
shared memory holds (1,535-6,143 by shape), a reduce kernel).

FP8 KV cache (``spec.kv_cache_dtype = torch.float8_e4m3fn``, see
:mod:`core.quantization.kv_cache`): the cache-write kernel quantizes with the layer's scales,
the decode kernels read the codes (the same kernels, templated on the cache type), and prompts
gather their blocks, dequantize them and run SDPA over them, so every token attends to what
the cache holds, its own keys included. Not built for ROCm.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from core.attention import AttentionBackend, AttentionMetadata, AttentionSpec
from platforms.cuda.build import load_ops

SUPPORTED_HEAD_SIZES = (64, 128, 256)
"""256 (Gemma 2/3) in bfloat16/float16 only (see csrc/attention/paged_decode_kernel.cuh)."""
SUPPORTED_BLOCK_SIZES = (16, 32)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8 = torch.float8_e4m3fn

CTAS_PER_SM = 2
"""Resident decode CTAs per multiprocessor (96 KiB of copy stages each in bf16)."""
MIN_PARTITION_TOKENS = 256
"""Shortest v2 partition: below this a CTA's start-up (query, block ids, first copies)
outweighs its streaming time."""
SOFT_CAP_SCORE_BYTES = 256 << 20
"""Score memory (fp32) one step of :func:`soft_capped_attention` may take: query rows are
processed in chunks so that heads x rows x keys x 4 bytes stays below it."""


def head_tiles(num_heads: int, num_kv_heads: int, fp8_cache: bool = False) -> int:
    """CTAs per kv head: groups of up to 4 query heads take one, larger groups tiles of 8 (of
    4 over an fp8 cache, see csrc/attention/paged_decode.cuh)."""
    group = num_heads // num_kv_heads
    return 1 if group <= 4 else math.ceil(group / (4 if fp8_cache else 8))


def choose_decode_partition(
    num_seqs: int, num_kv_heads: int, tiles: int, max_seq_len: int, num_sms: int
) -> int:
    """Partition length for a decode batch: 0 selects v1 (single pass), else v2.

    Rule: the v1 grid has ``ctas = num_seqs * num_kv_heads * tiles`` CTAs and the chip holds
    ``slots = num_sms * CTAS_PER_SM`` at once. When ``slots // ctas`` is below 2, v1 already
    fills at least half the chip and splitting only adds the partial-result round trip (on
    the H200, v1 beat every fixed v2 partition from 512 CTAs up). Otherwise each context is
    cut into ``slots // ctas`` partitions, so that the v2 grid is one full wave of
    equally long CTAs (no tail wave), with partitions of at least ``MIN_PARTITION_TOKENS``.
    """
    ctas = num_seqs * num_kv_heads * tiles
    parts = (num_sms * CTAS_PER_SM) // max(ctas, 1)
    if parts < 2 or max_seq_len <= MIN_PARTITION_TOKENS:
        return 0
    per_part = -(-max_seq_len // parts)  # ceil
    partition = max(MIN_PARTITION_TOKENS, (per_part + 15) // 16 * 16)
    return 0 if partition >= max_seq_len else partition


class CudaPagedAttention(AttentionBackend):
    """Paged attention on NVIDIA GPUs.

    :param decode_partition: force the decode kernel: None follows
        :func:`choose_decode_partition`, 0 forces v1, a positive multiple of 16 forces v2 with
        that partition length (benchmarks and tests).
    :param ops: the ``torch.ops.core_C`` namespace to call; None loads the CUDA build
        (:func:`platforms.cuda.build.load_ops`). The ROCm backend passes its hipified build.
    """

    name = "cuda_paged"
    supports_logits_soft_cap = True  # decode: in the csrc kernel; prompts: soft_capped_attention
    supports_fp8_kv_cache = True

    def __init__(self, spec: AttentionSpec, decode_partition: int | None = None, ops=None):
        super().__init__(spec)
        check_spec(spec)
        if decode_partition is not None and (decode_partition < 0 or decode_partition % 16):
            raise ValueError(
                f"decode_partition {decode_partition} must be None, 0 (v1) or a positive "
                "multiple of 16 (v2 partition length in tokens)"
            )
        self.decode_partition = decode_partition
        self.group = spec.num_heads // spec.num_kv_heads
        self.tiles = head_tiles(spec.num_heads, spec.num_kv_heads, spec.fp8_cache)
        # the FP8 cache's scales (the ops ignore them over any other cache)
        self._scales = (spec.k_scale, spec.v_scale) if spec.fp8_cache else (1.0, 1.0)
        self._ops = ops if ops is not None else load_ops()
        self._fused_decode_write = not spec.fp8_cache
        self._num_sms: int | None = None
        self._varlen: bool | None = None  # decided on the first prompt (needs the device)
        self._part_counts: torch.Tensor | None = None  # see _merge_counts
        self._retired_counts: list[torch.Tensor] = []  # outgrown ones, alive for old graphs

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (num_blocks, 2, num_kv_heads, block_size, head_size)

    # ---- cache ops --------------------------------------------------------------------------
    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        self._ops.reshape_and_cache(key, value, kv_cache, slot_mapping, *self._scales)

    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        load_ops().copy_blocks(kv_caches, pairs)

    @staticmethod
    def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        load_ops().swap_blocks(src, dst, pairs)

    # ---- attention ------------------------------------------------------------------------
    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(query)
        first, n = metadata.num_prefill_tokens, metadata.num_decode_tokens
        if n and self._decode_writes(key, value, metadata):
            # The decode kernel stores the decode rows' keys and values itself (one launch
            # instead of two); the prompt rows go through the cache-write kernel.
            if first:
                self.write_kv(key[:first], value[:first], kv_cache, metadata.slot_mapping[:first])
            rows = slice(first, first + n)
            self.decode(query, kv_cache, metadata, out,
                        new=(key[rows], value[rows], metadata.slot_mapping[rows]))
        else:
            self.write_kv(key, value, kv_cache, metadata.slot_mapping)
            if n:
                self.decode(query, kv_cache, metadata, out)
        if metadata.num_prefills:
            self._prefill(query, key, value, kv_cache, metadata, out)
        return out

    def _decode_writes(self, key, value, md: AttentionMetadata) -> bool:
        """Whether the decode kernel can store the decode rows' new tokens itself
        (``paged_decode_and_cache``): a cache in the compute dtype (an fp8 cache's write
        quantizes), 16-byte aligned rows, and exactly one slot per row (a shaped batch's
        trailing padding rows go through the cache-write kernel)."""
        return (
            self._fused_decode_write
            and md.slot_mapping.shape[0] == md.num_tokens
            and all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
                    and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
                    for t in (key, value))
        )

    def decode_partition_for(self, md: AttentionMetadata, device: torch.device) -> int:
        """Partition length the decode rows of ``md`` run with (0 = v1)."""
        if self.decode_partition is not None:
            return self.decode_partition
        return choose_decode_partition(
            md.num_decode_tokens, self.spec.num_kv_heads, self.tiles, md.max_seq_len,
            self._sm_count(device),
        )

    def decode_plan(self, md: AttentionMetadata) -> str:
        """Which decode kernel a batch gets, for logs and benchmarks: 'v1' or 'v2/<tokens>'."""
        partition = self.decode_partition_for(md, md.block_tables.device)
        return f"v2/{partition}" if partition else "v1"

    def decode(self, query, kv_cache, md: AttentionMetadata, out, new=None) -> None:
        """Decode rows ``[num_prefill_tokens, num_tokens)`` of ``query`` into ``out``.

        :param new: None when the cache already holds every decode row's token; else that
            token's ``(key, value, slot_mapping)`` rows, which the kernel stores in the cache
            first (``paged_decode_and_cache``)."""
        first, n = md.num_prefill_tokens, md.num_decode_tokens
        seqs = slice(md.num_prefills, md.num_prefills + n)
        partition = self.decode_partition_for(md, query.device)
        common = (
            md.block_tables[seqs],
            md.seq_lens[seqs],
            self.spec.softmax_scale,
            md.max_seq_len,
            partition,
            self.spec.sliding_window or 0,
            self.spec.logits_soft_cap or 0.0,
        )
        rows = slice(first, first + n)
        # v2: the partitions merge in the main kernel (no reduce kernel) given arrival counts
        merge = {} if not partition else self._merge_counts(n * self.spec.num_heads, query.device)
        if new is None:
            self._ops.paged_decode(out[rows], query[rows], kv_cache, *common, *self._scales, **merge)
        else:
            self._ops.paged_decode_and_cache(out[rows], query[rows], *new, kv_cache, *common, **merge)

    def _merge_counts(self, needed: int, device: torch.device) -> dict:
        """``part_count=`` for a v2 launch of ``needed`` (sequence, query head) pairs: this
        layer's int32 arrival counts (zeros that every launch leaves zero, see
        csrc/launchers.h). Grown outside CUDA-graph capture only (the decode graphs' eager
        warm-up, largest batch first, sizes them); a capture that would need more gets none,
        and its launch merges with the reduce kernel instead. An outgrown tensor is kept
        alive: a graph captured with it replays on its address."""
        counts = self._part_counts
        if counts is None or counts.numel() < needed or counts.device != device:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return {}
            if counts is not None:  # graphs captured before may hold its address: keep it
                self._retired_counts.append(counts)
            size = max(needed, 2 * (counts.numel() if counts is not None else 512))
            counts = self._part_counts = torch.zeros(size, dtype=torch.int32, device=device)
        return {"part_count": counts}

    def _sm_count(self, device: torch.device) -> int:
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        return self._num_sms

    # ---- prompts ----------------------------------------------------------------------------
    def _varlen_ok(self, device: torch.device) -> bool:
        """Whether fresh prompts can go through flash attention's variable-length entry (one
        call for a run of prompts): a CUDA (not HIP) build, an sm80+ device, fp16/bf16, a head
        size flash takes, and nothing flash cannot do here (soft-capping, an FP8 cache)."""
        if self._varlen is None:
            spec = self.spec
            self._varlen = (
                torch.version.hip is None
                and spec.dtype in (torch.float16, torch.bfloat16)
                and spec.head_size % 8 == 0 and spec.head_size <= 256
                and spec.logits_soft_cap is None and not spec.fp8_cache
                and torch.cuda.get_device_capability(device) >= (8, 0)
            )
        return self._varlen

    def _fresh_prompts(self, query, key, value, md: AttentionMetadata, first: int, last: int,
                       rows: slice, out) -> None:
        """Prefills ``[first, last)``, all without cached context, occupying ``rows``: one
        causal varlen flash call over their own keys (GQA in the kernel, no repeat). Empty
        prefills (a shaped batch's padding) are zero-length sequences to flash."""
        if rows.stop == rows.start:
            return
        starts = md.query_start_loc[first : last + 1]
        if rows.start:
            starts = starts - rows.start
        seq_lens = md.seq_lens_host or tuple(md.seq_lens.tolist())
        longest = max(seq_lens[first:last])
        window = self.spec.sliding_window
        # our window counts the query's own position: flash's left window is one less
        extra = {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}
        o = torch.ops.aten._flash_attention_forward(
            query[rows], key[rows], value[rows], starts, starts, longest, longest, 0.0, True, False,
            scale=self.spec.softmax_scale, **extra,
        )[0]
        out[rows] = o

    def _prefill(self, query, key, value, kv_cache, md: AttentionMetadata, out) -> None:
        """Prompt rows. Runs of fresh prompts (no cached context) take one varlen flash call
        each where :meth:`_varlen_ok`; otherwise a fresh prompt attends to its own keys through
        SDPA (flash, causal), and a chunk over cached context gathers the context from the cache
        and uses a bottom-right-aligned causal mask (memory-efficient kernel)."""
        seq_lens = md.seq_lens_host or tuple(md.seq_lens.tolist())
        ctx_lens = md.context_lens_host or tuple(md.context_lens.tolist())
        window, cap = self.spec.sliding_window, self.spec.logits_soft_cap
        varlen = self._varlen_ok(query.device)
        start, run_first, run_start = 0, None, 0
        for i in range(md.num_prefills + 1):
            fresh = i < md.num_prefills and ctx_lens[i] == 0
            if varlen and fresh:
                if run_first is None:
                    run_first, run_start = i, start
                start += seq_lens[i]
                continue
            if run_first is not None:  # a run of fresh prompts ends before i
                self._fresh_prompts(query, key, value, md, run_first, i, slice(run_start, start), out)
                run_first = None
            if i == md.num_prefills:
                break
            q_len, ctx = seq_lens[i] - ctx_lens[i], ctx_lens[i]
            rows = slice(start, start + q_len)
            start += q_len
            q = query[rows].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            if cap is not None:
                k, v = self._gather(kv_cache, md.block_tables[i], seq_lens[i])
                o = soft_capped_attention(q[0], k, v, self.spec.softmax_scale, cap, window)
                out[rows] = o.transpose(0, 1)
                continue
            if ctx == 0 and window is None and self.spec.fp8_cache:
                # a fresh prompt over its own fp8 keys (heads repeated): flash, causal
                k, v = self._gather(kv_cache, md.block_tables[i], seq_lens[i])
                o = F.scaled_dot_product_attention(
                    q, k.unsqueeze(0), v.unsqueeze(0), is_causal=True, scale=self.spec.softmax_scale,
                )
            elif ctx == 0 and window is None:
                k = key[rows].transpose(0, 1).unsqueeze(0)  # [1, Hkv, q, D]
                v = value[rows].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.spec.softmax_scale,
                    enable_gqa=self.group > 1,
                )
            else:
                k, v = self._gather(kv_cache, md.block_tables[i], seq_lens[i])
                mask = self._mask(q_len, seq_lens[i], query.device)
                o = F.scaled_dot_product_attention(
                    q, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                    scale=self.spec.softmax_scale,
                )
            out[rows] = o[0].transpose(0, 1)

    def _gather(self, kv_cache, block_table, length: int):
        """Keys/values of positions [0, length) of one sequence, each [H, length, D] with
        the kv heads repeated for their query groups."""
        bs = kv_cache.shape[3]
        ids = block_table[: -(-length // bs)]
        if self.spec.fp8_cache:  # gathered as bytes, then read as codes * scale
            blocks = kv_cache.view(torch.uint8).index_select(0, ids).view(FP8)
        else:
            blocks = kv_cache.index_select(0, ids)  # [nb, 2, Hkv, bs, D]
        kv = blocks.permute(1, 2, 0, 3, 4).flatten(2, 3)[:, :, :length]  # [2, Hkv, length, D]
        k, v = kv[0], kv[1]
        if self.spec.fp8_cache:  # python-float scales: no host->device copy per layer
            k = (k.float() * self._scales[0]).to(self.spec.dtype)
            v = (v.float() * self._scales[1]).to(self.spec.dtype)
        if self.group > 1:
            k, v = k.repeat_interleave(self.group, dim=0), v.repeat_interleave(self.group, dim=0)
        return k, v

    def _mask(self, q_len: int, kv_len: int, device: torch.device):
        """Causal mask aligned to the end (query t sits at position kv_len - q_len + t)."""
        window = self.spec.sliding_window
        if window is None:
            # Imported here: torch.nn.attention.bias pulls in torch._dynamo (~2 s), a cost
            # every process that merely loads the plugin would otherwise pay.
            from torch.nn.attention.bias import causal_lower_right

            return causal_lower_right(q_len, kv_len)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
        k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
        return (k_pos <= q_pos) & (k_pos > q_pos - window)


def soft_capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    soft_cap: float,
    window: int | None = None,
    max_score_bytes: int = SOFT_CAP_SCORE_BYTES,
) -> torch.Tensor:
    """Causal attention with soft-capped logits for one sequence's new rows.

    :param q: [H, q_len, D], the last ``q_len`` positions of the sequence.
    :param k: [H, kv_len, D] keys of positions ``[0, kv_len)`` (kv heads already repeated
        for their query groups); ``v`` likewise.
    :return: [H, q_len, D] in q's dtype; row t attends to positions ``<= kv_len - q_len + t``
        (and ``> that - window`` under a window), scores ``cap * tanh(scale * q.k / cap)``.
    """
    heads, q_len, _ = q.shape
    kv_len = k.shape[1]
    out = torch.empty_like(q)
    rows = max(1, max_score_bytes // (4 * heads * max(kv_len, 1)))
    k_pos = torch.arange(kv_len, device=q.device)
    kf, vf = k.float(), v.float()
    for r0 in range(0, q_len, rows):
        r1 = min(q_len, r0 + rows)
        scores = torch.matmul(q[:, r0:r1].float(), kf.transpose(1, 2)) * scale  # [H, r, kv]
        scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(kv_len - q_len + r0, kv_len - q_len + r1, device=q.device)
        masked = k_pos.unsqueeze(0) > q_pos.unsqueeze(1)
        if window is not None:
            masked |= k_pos.unsqueeze(0) <= q_pos.unsqueeze(1) - window
        scores.masked_fill_(masked, float("-inf"))
        out[:, r0:r1] = torch.matmul(scores.softmax(-1), vf).to(q.dtype)
    return out


def check_spec(spec: AttentionSpec) -> None:
    problems = []
    if spec.head_size not in SUPPORTED_HEAD_SIZES:
        problems.append(f"head size {spec.head_size} (supported: {SUPPORTED_HEAD_SIZES})")
    elif spec.head_size == 256 and spec.cache_dtype == torch.float32:
        problems.append("head size 256 with a float32 cache (256 is supported in bfloat16, float16 and fp8)")
    if spec.block_size not in SUPPORTED_BLOCK_SIZES:
        problems.append(f"block size {spec.block_size} (supported: {SUPPORTED_BLOCK_SIZES})")
    if spec.dtype not in SUPPORTED_DTYPES:
        problems.append(f"dtype {spec.dtype} (supported: bfloat16, float16, float32)")
    if spec.kv_cache_dtype not in (None, spec.dtype, FP8):
        problems.append(f"KV cache dtype {spec.kv_cache_dtype} (supported: the compute dtype, float8_e4m3fn)")
    if spec.num_kv_heads <= 0 or spec.num_heads % spec.num_kv_heads:
        problems.append(
            f"{spec.num_heads} query heads over {spec.num_kv_heads} kv heads (must divide)"
        )
    if problems:
        raise ValueError(
            "the cuda_paged attention backend cannot serve this layer: "
            + "; ".join(problems)
            + ". Use a supported --block-size/--dtype, or run the model on another platform."
        )
