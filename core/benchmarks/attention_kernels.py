"""Attention-kernel benchmark: achieved memory bandwidth of a platform's decode attention.

For each (batch, context) a decode-only step (one new token per sequence) runs through the
platform's attention backend. Two times are reported: ``forward`` (cache write + attention)
and, when the backend exposes ``decode(query, kv_cache, metadata, out)``, the decode
attention alone; bandwidth is the bytes of the cached K and V the step must read plus Q and
the output, over the median attention time. Before every timed call the L2 cache is flushed
by reading 512 MiB twice: reads leave the cache full of clean lines (a flush by writing would
leave dirty lines whose write-back lands in the timed region), and the device work is long
enough that the host has queued the whole call before the device reaches it, so host launch
overhead is not counted, as under graph replay. Prompt (prefill) steps are timed too, as attention TFLOP/s.

    python -m core.benchmarks.attention_kernels --platform cuda \\
        --variant auto --variant v1:decode_partition=0 --json results.json

``--kv-cache-dtype fp8`` times the same steps over an FP8 (e4m3) cache (its bandwidth counts
the one-byte codes actually read).

``--variant LABEL[:key=value,...]`` passes backend-specific constructor options (integers)
to the backend; ``--plugin MODULE`` registers a platform module that is not installed.
Device-neutral: timing uses ``torch.Event`` on the platform's device.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import statistics
import sys
import time
from typing import Any

import torch

from core.attention import AttentionBackend, AttentionSpec, build_metadata
from core.plugins import Plugins

FLUSH_BYTES = 512 << 20  # several times any L2 cache


@dataclasses.dataclass(frozen=True)
class Shape:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    kv_cache_dtype: torch.dtype | None = None
    """None: the cache is ``dtype``; torch.float8_e4m3fn: the FP8 cache (scales 1.0)."""

    def spec(self) -> AttentionSpec:
        return AttentionSpec(self.num_heads, self.num_kv_heads, self.head_size, self.dtype,
                             self.block_size, kv_cache_dtype=self.kv_cache_dtype)


def fill_random(cache: torch.Tensor) -> None:
    """Random cache contents: normal values, or for a 1-byte (fp8) cache random finite
    codes (normal_ has no float8 kernel)."""
    if cache.element_size() == 1:
        cache.view(torch.uint8).random_(0, 0x7F)  # below the NaN code
    else:
        cache.normal_()


def parse_variant(text: str) -> tuple[str, dict[str, int]]:
    """``"v2:decode_partition=512"`` -> ("v2", {"decode_partition": 512})."""
    label, _, opts = text.partition(":")
    options = {}
    for item in filter(None, opts.split(",")):
        key, _, value = item.partition("=")
        options[key] = int(value)
    return label, options


def _has_events(device: torch.device) -> bool:
    """Whether ``device``'s backend records timing events (host backends do not: their ops
    are synchronous, so the host clock times them)."""
    try:
        start, end = (torch.Event(device=device, enable_timing=True) for _ in range(2))
        start.record()
        end.record()
        end.synchronize()
        start.elapsed_time(end)
    except RuntimeError:
        return False
    return True


def time_ms(fn, device: torch.device, flush: torch.Tensor, reps: int) -> list[float]:
    """Per-call device times of ``fn`` (ms), each after an L2 flush: with the device's
    timing events where it has them, else with the host clock."""
    times = []
    events = _has_events(device)
    for _ in range(reps):
        flush.sum()
        flush.sum()
        if not events:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start = torch.Event(device=device, enable_timing=True)
        end = torch.Event(device=device, enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def median_ms(fn, device, flush, budget_ms: float = 300.0) -> float:
    for _ in range(3):  # warm-up: kernel load, allocator
        fn()
    first = statistics.median(time_ms(fn, device, flush, 3))
    reps = int(min(100, max(5, budget_ms / max(first, 1e-3))))
    return statistics.median(time_ms(fn, device, flush, reps))


def decode_step(shape: Shape, batch: int, context: int, device) -> tuple[Any, ...]:
    """Random cache (blocks shuffled), query and decode metadata for batch x context."""
    bs = shape.block_size
    per_seq = -(-context // bs)
    num_blocks = batch * per_seq + 1  # block 0 stays the null block
    cache_shape_args = (num_blocks, bs, shape.num_kv_heads, shape.head_size)
    tables = (torch.randperm(num_blocks - 1) + 1).view(batch, per_seq).int()
    md = build_metadata([1] * batch, [context - 1] * batch, tables.numpy(), bs, num_prefills=0,
                        device=device)
    def rand(*s):
        return torch.randn(*s, device=device, dtype=shape.dtype)
    q = rand(batch, shape.num_heads, shape.head_size)
    k = rand(batch, shape.num_kv_heads, shape.head_size)
    v = rand(batch, shape.num_kv_heads, shape.head_size)
    return cache_shape_args, q, k, v, md


def decode_bytes(shape: Shape, batch: int, context: int) -> int:
    e = torch.empty((), dtype=shape.dtype).element_size()
    kv = 2 * batch * context * shape.num_kv_heads * shape.head_size * shape.spec().cache_dtype.itemsize
    q_out = 2 * batch * shape.num_heads * shape.head_size * e
    return kv + q_out


def bench_decode(platform, backend_cls, shape, variants, batches, contexts, flush):
    device = platform.device(0)
    free_bytes, _ = platform.memory_info()
    rows = []
    for batch in batches:
        for context in contexts:
            need = decode_bytes(shape, batch, context)
            if need > 0.7 * free_bytes:
                rows.append({"batch": batch, "context": context, "skipped": "memory"})
                print(f"skip batch {batch} x {context}: {need / 2**30:.1f} GiB of KV", flush=True)
                continue
            cache_args, q, k, v, md = decode_step(shape, batch, context, device)
            cache = None
            for label, options in variants:
                backend = backend_cls(shape.spec(), **options)
                if cache is None:
                    cache = backend.allocate_kv_cache(cache_args[0], device)
                    fill_random(cache)
                fwd = median_ms(functools.partial(backend.forward, q, k, v, cache, md), device, flush)
                attn = fwd
                if callable(getattr(backend, "decode", None)):
                    out = torch.empty_like(q)
                    attn = median_ms(functools.partial(backend.decode, q, cache, md, out), device, flush)
                plan = getattr(backend, "decode_plan", lambda _md: "")(md)
                rows.append({"batch": batch, "context": context, "variant": label, "plan": plan,
                             "forward_us": round(fwd * 1e3, 2), "time_us": round(attn * 1e3, 2),
                             "tb_per_s": round(need / (attn * 1e-3) / 1e12, 3)})
                print(json.dumps(rows[-1]), flush=True)
            del cache
            platform.empty_cache()
    return rows


def bench_prefill(backend_cls, shape, device, flush, cases=((4, 0, 1024), (1, 3072, 1024))):
    """(prompts, cached context, new tokens): attention TFLOP/s of one prompt step."""
    rows = []
    spec = shape.spec()
    bs = shape.block_size
    for n, ctx, new in cases:
        backend = backend_cls(spec)
        per_seq = -(-(ctx + new) // bs)
        cache = backend.allocate_kv_cache(n * per_seq + 1, device)
        fill_random(cache)
        tables = (torch.arange(n * per_seq) + 1).view(n, per_seq).int()
        md = build_metadata([new] * n, [ctx] * n, tables.numpy(), bs, num_prefills=n, device=device)
        q = torch.randn(n * new, spec.num_heads, spec.head_size, device=device, dtype=spec.dtype)
        k = torch.randn(n * new, spec.num_kv_heads, spec.head_size, device=device, dtype=spec.dtype)
        ms = median_ms(functools.partial(backend.forward, q, k, k, cache, md), device, flush)
        # causal: each new token attends to ctx + its own position
        pairs = n * (new * ctx + new * (new + 1) / 2)
        flops = 4 * pairs * spec.num_heads * spec.head_size
        rows.append({"prompts": n, "context": ctx, "new_tokens": new,
                     "time_us": round(ms * 1e3, 2), "tflop_per_s": round(flops / ms / 1e9, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def resolve_platform(name: str, plugin_modules: list[str]):
    plugins = Plugins()
    for module in plugin_modules:
        plugins.register(importlib.import_module(module), module.rsplit(".", 1)[-1])
    if not plugin_modules:
        plugins.load_entry_points()
    return plugins.select(name).cls()


def table(rows: list[dict]) -> str:
    lines = [f"{'batch':>6} {'context':>8} {'variant':>10} {'plan':>10} {'fwd us':>9} "
             f"{'attn us':>9} {'TB/s':>6}"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['batch']:>6} {r['context']:>8} {'skipped: ' + r['skipped']:>47}")
        else:
            lines.append(f"{r['batch']:>6} {r['context']:>8} {r['variant']:>10} {r['plan']:>10} "
                         f"{r['forward_us']:>9.1f} {r['time_us']:>9.1f} {r['tb_per_s']:>6.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--platform", required=True)
    ap.add_argument("--plugin", action="append", default=[], help="platform module to register")
    ap.add_argument("--variant", action="append", default=None)
    ap.add_argument("--batch", default="1,8,64,256")
    ap.add_argument("--context", default="512,4096,32768")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    ap.add_argument("--json", default=None, help="write all results here")
    ns = ap.parse_args(argv)
    platform = resolve_platform(ns.platform, ns.plugin)
    device = platform.device(0)
    shape = Shape(kv_cache_dtype=torch.float8_e4m3fn if ns.kv_cache_dtype == "fp8" else None)
    backend_cls: type[AttentionBackend] = platform.attention_backend_class(shape.spec())
    variants = [parse_variant(v) for v in (ns.variant or ["auto"])]
    flush = torch.ones(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    batches = [int(b) for b in ns.batch.split(",")]
    contexts = [int(c) for c in ns.context.split(",")]
    with torch.inference_mode():
        decode = bench_decode(platform, backend_cls, shape, variants, batches, contexts, flush)
        prefill = [] if ns.no_prefill else bench_prefill(backend_cls, shape, device, flush)
    result = {"platform": platform.name, "shape": {k: str(v) for k, v in
              dataclasses.asdict(shape).items()}, "torch": torch.__version__,
              "decode": decode, "prefill": prefill}
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=2)
    print(table(decode))
    return 0


if __name__ == "__main__":
    sys.exit(main())
