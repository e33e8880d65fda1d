"""Times the CPU weight-quantized matmul (csrc/cpu ``quant_linear``) against dense float32.

``python -m core.benchmarks.cpu_linear [--isa avx2] [--threads 2]`` prints, for SmolLM2-135M's
layer shapes and row counts from one decode row to a 32 x 128 prompt batch, the milliseconds of
CPU time of one call (process time, so a busy machine's other processes are not counted; with
``--threads 1`` that is the kernel's single-core cost): int4 and int8 weights with int8 activations (mode 1) and with fp32 activations
(mode 0), and torch's float32 ``F.linear``. To mimic an AVX2-only CPU on an AVX-512 one, run
it with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` (torch's own kernels) and
``--isa avx2`` (ours); ``--scales float16`` stores scales and mins as a GGUF checkpoint does
(the embedded model's case). Each figure is the median of ``--repeats`` calls after a warm-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from platforms.cpu.kernels import load_kernels
from platforms.cpu.linear import GroupedQuant, group_int4, group_int8, grouped_matmul

SHAPES = {"qkv 576->960": (960, 576), "o 576->576": (576, 576), "gate+up 576->3072": (3072, 576),
          "down 1536->576": (576, 1536), "lm head 576->49152": (49152, 576)}


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--isa", default="auto", help="csrc/cpu path: auto, avx2, avx512, generic, neon_dot")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rows", default="1,4,32,512,4096")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--scales", default="float32", choices=["float32", "float16"],
                   help="scale and min storage (float16: a GGUF checkpoint's, what the embedded model runs)")
    ns = p.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    kernels = load_kernels()
    isa = kernels.set_cpu_isa(ns.isa)
    print(f"isa {isa}, {torch.get_num_threads()} threads, torch capability "
          f"{torch.backends.cpu.get_cpu_capability()}, load {os.getloadavg()[0]:.2f}")
    print(f"{'shape':<20} {'rows':>5} {'int4/i8':>9} {'int4/f32':>9} {'int8/i8':>9} {'int8/f32':>9} {'fp32':>9}")
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g) * 0.05
        q4, q8 = group_int4(w), group_int8(w)
        if ns.scales == "float16":  # the scales rounded: other weights, the same work
            q4, q8 = (GroupedQuant(q.bits, q.codes, q.scales.half(), None if q.mins is None else q.mins.half())
                      for q in (q4, q8))
        for rows in (int(r) for r in ns.rows.split(",")):
            if name.startswith("lm head") and rows > 32:
                continue  # the LM head sees one row per sequence
            x = torch.randn(rows, k, generator=g)
            cells = [timed(lambda q=q, m=m, x=x: grouped_matmul(kernels, x, q, m), ns.repeats)
                     for q in (q4, q8) for m in (1, 0)]
            cells.append(timed(lambda x=x, w=w: F.linear(x, w), ns.repeats))
            print(f"{name:<20} {rows:>5} " + " ".join(f"{c:>9.3f}" for c in cells))


if __name__ == "__main__":
    main()
