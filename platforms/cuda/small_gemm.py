"""The decode-step GEMMs (M <= 16 rows) on a GPU: cuBLAS against split-K, as bandwidth.

    python -m platforms.cuda.small_gemm [--rows 1 2 4 8 16] [--splits 2 4 8]
                                         [--gemv-rows 1 2 4] [--dtype bfloat16] [--output-json PATH]

At batch 1-16 a linear layer reads its whole weight for a handful of rows, so it is bound by
memory bandwidth: the figure that matters is weight bytes / time against the device's copy
bandwidth (the H200 copies at 4.26 TB/s). For each Llama-3-8B projection (fused QKV, output,
fused gate/up, down, LM head) it times:

* ``cublas``: ``torch.nn.functional.linear`` (what the model runs today);
* ``splitk-S``: the reduction dimension cut into ``S`` slices, one batched GEMM over the
  slices (more CTAs for a skinny problem) and a sum over them, in plain torch;
* ``gemv-R``: csrc/gemv.cu (``core_C.gemv``, M <= 8) with ``R`` output features per warp,
  ``gemv-R-split4``: the same with each row's inputs split across a CTA's four warps, and
  ``gemv``: the layer's defaults (what :class:`platforms.cuda.gemv.CudaDenseLinear` runs).

Each variant is checked against the float64 product first. Timing: CUDA events around 48
back-to-back calls after 10 warm-ups, median of 5 such runs. The calls cycle through copies
of the weight totalling at least 512 MiB (ten times the H200's L2), so every call reads its
weight from HBM, as in a real decode step where each layer's weight is cold.
Needs a CUDA device; the figures are for the lead to record (docs/benchmarks/).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from platforms.cuda.gemv import GEMV_MAX_ROWS, GEMV_SPLIT_K, gemv

# (name, in_features, out_features) of Llama-3-8B's linear layers.
SHAPES = (
    ("qkv", 4096, 6144),
    ("o_proj", 4096, 4096),
    ("gate_up", 4096, 28672),
    ("down", 14336, 4096),
    ("lm_head", 4096, 128256),
)


def split_k(x: torch.Tensor, w: torch.Tensor, splits: int) -> torch.Tensor:
    """``x @ w.T`` with the reduction cut into ``splits`` slices summed in float32."""
    m, k = x.shape
    n = w.shape[0]
    xs = x.view(m, splits, k // splits).transpose(0, 1)  # [S, M, K/S]
    ws = w.view(n, splits, k // splits).permute(1, 2, 0)  # [S, K/S, N], column-major
    return torch.bmm(xs, ws).float().sum(dim=0).to(x.dtype)


def time_ms(fn, weights: list[torch.Tensor], calls: int = 48, runs: int = 5) -> float:
    """Median milliseconds of ``fn(w)``, cycling ``w`` through ``weights``."""
    for i in range(10):
        fn(weights[i % len(weights)])
    out = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(weights[i % len(weights)])
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / calls)
    return statistics.median(out)


def check(name: str, got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = (x.double() @ w.double().T).to(got.dtype)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}: {m}")


def measure(rows: list[int], splits: list[int], dtype: torch.dtype, gemv_rows: list[int],
            shapes: list[str] | None = None) -> list[dict]:
    dev = torch.device("cuda")
    results = []
    for name, k, n in SHAPES:
        if shapes and name not in shapes:
            continue
        w = torch.randn(n, k, device=dev, dtype=dtype) / k**0.5
        nbytes = w.numel() * w.element_size()
        weights = [w] + [w.clone() for _ in range(-(-(512 << 20) // nbytes) - 1)]
        gb = nbytes / 1e9
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            variants = {"cublas": lambda w, x=x: F.linear(x, w)}
            for s in splits:
                if k % s == 0:
                    variants[f"splitk-{s}"] = lambda w, x=x, s=s: split_k(x, w, s)
            if m <= GEMV_MAX_ROWS:
                variants["gemv"] = lambda w, x=x: gemv(x, w)
                for r in gemv_rows:
                    variants[f"gemv-{r}"] = lambda w, x=x, r=r: gemv(x, w, r, 1)
                    if r in (1, 2):  # each row's inputs split across a CTA's warps
                        variants[f"gemv-{r}-split{GEMV_SPLIT_K}"] = lambda w, x=x, r=r: gemv(x, w, r, GEMV_SPLIT_K)
            for variant, fn in variants.items():
                check(f"{name} M={m} {variant}", fn(w), x, w)
                ms = time_ms(fn, weights)
                row = {"shape": name, "k": k, "n": n, "m": m, "variant": variant,
                       "ms": round(ms, 4), "weight_tb_per_s": round(gb / ms, 3)}
                results.append(row)
                print(json.dumps(row), flush=True)
        del w, weights
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--gemv-rows", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--shapes", nargs="+", choices=[name for name, _, _ in SHAPES], default=None,
                   help="only these projections (default: all)")
    p.add_argument("--output-json", default=None)
    ns = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("small_gemm needs a CUDA device (run it on the GPU machine)")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    results = measure(ns.rows, ns.splits, getattr(torch, ns.dtype), ns.gemv_rows, ns.shapes)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
