"""Quantized linear layers on a GPU against bf16 cuBLAS, per Llama-3-8B shape and step size.

    python -m platforms.cuda.quant_bench [--rows 1 4 16 64 256 2048] [--variants NAME ...]
        [--output-json PATH]

For each projection (fused QKV, output, fused gate/up, down) and number of activation rows
it times, with the weights cycling through copies totalling >= 512 MiB so every call reads
its weight from HBM (as in a decode step):

* ``bf16``: ``F.linear`` on the dense bf16 weight (what an unquantized model runs);
* ``fp8-gemv``: csrc/quant's weight-only GEMV over fp8 codes with per-row scales (M <= 16),
  with the kernel the op chooses (what the FP8 path runs for decode steps: tensor cores from
  3 rows and at one row up to 2^24 codes, the CUDA cores otherwise); ``fp8-gemv-cuda-cores``:
  the same op held to its CUDA-core kernel (``tensor_cores=False``), for comparison;
* ``fp8-scaled-mm``: ``torch._scaled_mm`` (rowwise scales), activations quantized per token
  in the same call (what the FP8 path runs above the GEMV's rows);
* ``int4-gemv``: the GEMV over AWQ-style int4 codes, group 128 with zero points (M <= 16),
  on tensor cores (what AWQ / GPTQ run for decode steps); ``int4-gemv-cuda-cores``: the same
  op held to its CUDA-core kernel (what GGUF Q4_1 / Q4_K, whose mins are free, and Q4_0,
  whose groups are 32, run; and AWQ at one row on weights of up to 2^24 codes);
* ``int4-dequant-gemm``: ``core_C.quant_dequant`` to bf16 then ``F.linear`` (int4 prefill).

Reported: median microseconds per call (40 back-to-back calls replayed from a CUDA graph, so
the host's launch rate does not set the pace; "timing" says where capture failed and the
calls were launched from Python) and the weight bytes read per second (TB/s; the H200
copies at 4.26). Each variant is checked against the float64 product first. Needs a CUDA
device; the lead runs it (docs/benchmarks/cuda_quant.sh) and records the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from core.quantization.tensors import IntWeight, quantize_fp8_rows

SHAPES = (("qkv", 4096, 6144), ("o_proj", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096))
"""(name, in_features, out_features) of Llama-3-8B's quantized linear layers."""


def time_us(fn, n_weights: int, calls: int = 40, runs: int = 5) -> tuple[float, str]:
    """Median microseconds of ``fn(i)`` over ``calls`` back-to-back calls, i cycling weights,
    and how they ran: replayed from one CUDA graph ("graph"), as the model's decode steps
    run, or launched from Python ("eager") where capture fails. Launched one by one, a
    kernel of ~10 us waits for the host's next launch (~10-20 us of Python and dispatch), so
    the small layers measured the host: the same unchanged kernel gave 12.2 and 17.1 us in
    one call on one H100 (2026-12-06, docs/quantization.md). The graph replay was written
    after that session's device time ran out: it has not run on a GPU yet."""
    for i in range(8):
        fn(i % n_weights)
    torch.cuda.synchronize()

    def many():
        for i in range(calls):
            fn(i % n_weights)

    run, mode = many, "eager"
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            many()  # warm-up on the capture stream (lazy initialisation outside the graph)
            with torch.cuda.graph(graph, stream=stream):
                many()
        torch.cuda.current_stream().wait_stream(stream)
        run, mode = graph.replay, "graph"
    except RuntimeError:
        torch.cuda.synchronize()
    run()  # one untimed pass of the timed form
    out = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(out), mode


def _copies(nbytes: int) -> int:
    return max(2, -(-(512 << 20) // nbytes))


def _int4(n: int, k: int, gen: torch.Generator) -> IntWeight:
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // 128, generator=gen) * 0.002
    return IntWeight(4, codes, scales, -8 * scales, 128)


VARIANTS = ("bf16", "fp8-gemv", "fp8-gemv-cuda-cores", "fp8-scaled-mm", "int4-gemv", "int4-gemv-cuda-cores",
            "int4-dequant-gemm", "int4-method")
"""The names :func:`variants` gives, in its order."""


def variants(n: int, k: int, gen: torch.Generator):
    """(name, weight bytes, max rows or None, weight, fn(weight, x) -> y, reference(x))."""
    from platforms.cuda.build import load_ops
    from platforms.cuda.quant import CudaQuantizedLinear, _pack, dequantize_packed, fp8_scaled_mm

    dev = torch.device("cuda")
    ops = load_ops()
    dense = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16).to(dev)
    fp8 = _pack(quantize_fp8_rows(dense.float().cpu()), dev)
    int4 = _pack(_int4(n, k, gen), dev)

    def gemv(p, x, tensor_cores=True):
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=dev)
        ops.quant_gemv(y, x, p.codes, p.scales, p.mins, p.code, p.group, tensor_cores, p.zeros)
        return y

    def ref(p, x):
        return x.double() @ dequantize_packed(p, torch.float32).double().T

    from core.quantization.fp8 import Fp8Method

    linear = CudaQuantizedLinear(Fp8Method.from_config(None), torch.bfloat16)
    return [
        ("bf16", n * k * 2, None, dense, lambda w, x: F.linear(x, w), lambda x: x.double() @ dense.double().T),
        ("fp8-gemv", n * k, 16, fp8, gemv, lambda x: ref(fp8, x)),
        ("fp8-gemv-cuda-cores", n * k, 16, fp8, lambda p, x: gemv(p, x, False), lambda x: ref(fp8, x)),
        ("fp8-scaled-mm", n * k, None, fp8, lambda p, x: fp8_scaled_mm(p, x), lambda x: ref(fp8, x)),
        ("int4-gemv", n * k // 2, 16, int4, gemv, lambda x: ref(int4, x)),
        ("int4-gemv-cuda-cores", n * k // 2, 16, int4, lambda p, x: gemv(p, x, False), lambda x: ref(int4, x)),
        ("int4-dequant-gemm", n * k // 2, None, int4,
         lambda p, x: F.linear(x, dequantize_packed(p, x.dtype)), lambda x: ref(int4, x)),
        ("int4-method", n * k // 2, None, int4, lambda p, x: linear.matmul(p, x, None), lambda x: ref(int4, x)),
    ]


def _clone(w):
    if isinstance(w, torch.Tensor):
        return w.clone()
    import dataclasses

    return dataclasses.replace(w, codes=w.codes.clone())


def _bench(name: str, k: int, n: int, variant, rows: list[int], gen: torch.Generator) -> list[dict]:
    label, nbytes, max_rows, weight, fn, reference = variant
    weights = [weight] + [_clone(weight) for _ in range(_copies(nbytes) - 1)]
    out = []
    for m in rows:
        if max_rows is not None and m > max_rows:
            continue
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
        got, want = fn(weight, x).double(), reference(x)
        err = float((got - want).norm() / want.norm())
        us, mode = time_us(lambda i, x=x: fn(weights[i], x), len(weights))
        out.append({"shape": name, "in": k, "out": n, "rows": m, "variant": label, "us": round(us, 2),
                    "weight_tb_s": round(nbytes / us / 1e6, 3), "rel_error": round(err, 5), "timing": mode})
        print(f"{name:8s} M={m:<5d} {label:18s} {us:9.1f} us  {nbytes / us / 1e6:6.2f} TB/s  "
              f"rel err {err:.2e}  ({mode})", flush=True)
    return out


def measure(rows: list[int], only: list[str] | None = None) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    results = []
    for name, k, n in SHAPES:
        vs = variants(n, k, gen)
        assert tuple(v[0] for v in vs) == VARIANTS, "VARIANTS must name what variants() gives"
        for variant in vs:
            if only is None or variant[0] in only:
                results += _bench(name, k, n, variant, rows, gen)
            torch.cuda.empty_cache()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description="quantized linear kernels vs bf16 cuBLAS (needs a GPU)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 2048])
    p.add_argument("--variants", nargs="+", default=None, choices=VARIANTS,
                   help="time only these (default: all)")
    p.add_argument("--output-json", default=None)
    ns = p.parse_args()
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    results = measure(ns.rows, ns.variants)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
