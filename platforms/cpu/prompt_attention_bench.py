"""Prompt attention of one layer on CPU: ``cpu_sdpa``'s SDPA path against ``cpu_paged``'s
kernel path, on the same cache (SmolLM2's shape: 9 heads, 3 kv heads, head size 64).

    python -m platforms.cpu.prompt_attention_bench [--threads N] [--repeats 3]

Prints, per dtype and batch shape (prompts x new tokens over cached context), the median
time of each path and the largest difference between their outputs. It lives beside the
CPU platform because it times the backends' internal prompt path (``_prefill``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from core.attention import AttentionSpec, build_metadata

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 9, 3, 64, 16
SHAPES = [(32, 128, 0), (2, 1024, 0), (1, 4096, 0), (45, 24, 992), (4, 128, 1000), (1, 2048, 2048)]


def _case(dtype: torch.dtype, seqs: int, new: int, cached: int):
    """A cache holding every position of ``seqs`` prompts, the step's query, and metadata."""
    total = cached + new
    blocks = -(-total // BLOCK)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, seqs * blocks + 1, BLOCK, KV_HEADS, HEAD_SIZE, generator=g).to(dtype)
    tables = torch.arange(1, seqs * blocks + 1, dtype=torch.int32).view(seqs, blocks)
    query = torch.randn(seqs * new, HEADS, HEAD_SIZE, generator=g).to(dtype)
    md = build_metadata([new] * seqs, [cached] * seqs, tables.numpy(), BLOCK, num_prefills=seqs)
    flat = cache.view(2, -1, KV_HEADS, HEAD_SIZE)
    # The new tokens' keys and values as the cache holds them (forward writes, then attends).
    key, value = flat[0, md.slot_mapping].clone(), flat[1, md.slot_mapping].clone()
    return cache, query, key, value, md


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from platforms.cpu.attention import CpuAttentionBackend, CpuPagedAttentionBackend

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}")
    for dtype in (torch.bfloat16, torch.float32):
        spec = AttentionSpec(HEADS, KV_HEADS, HEAD_SIZE, dtype, BLOCK)
        backends = {"sdpa": CpuAttentionBackend(spec), "kernel": CpuPagedAttentionBackend(spec)}
        for seqs, new, cached in SHAPES:
            cache, query, key, value, md = _case(dtype, seqs, new, cached)
            ms, outs = {}, []
            for name, backend in backends.items():
                out = torch.empty_like(query)
                backend._prefill(query, key, value, cache, md, out)  # warm-up
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    backend._prefill(query, key, value, cache, md, out)
                    times.append(time.perf_counter() - t0)
                ms[name] = statistics.median(times) * 1e3
                outs.append(out.float())
            diff = (outs[0] - outs[1]).abs().max().item()
            print(
                f"{str(dtype).removeprefix('torch.'):9} {seqs:3} x {new:5} over {cached:5}: "
                f"sdpa {ms['sdpa']:8.1f} ms  kernel {ms['kernel']:7.1f} ms  "
                f"x{ms['sdpa'] / ms['kernel']:.1f}  max|diff| {diff:.2g}"
            )


if __name__ == "__main__":
    main()
