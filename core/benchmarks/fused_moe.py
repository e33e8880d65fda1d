"""Fused-MoE op benchmark: achieved weight bandwidth and FLOP/s of a platform's ``fused_moe``.

For one MoE layer of a known shape (Mixtral-8x7B, Qwen3-30B-A3B) and each token count, the
platform's op (``Ops(platform.ops()).fused_moe``; ``--reference`` forces core.ops') runs on
random bf16 inputs with softmax-top-k routing. Reported per call: the median device time
after an L2 flush (helpers of core.benchmarks.attention_kernels), FLOP/s of the two GEMMs
(``6 * tokens * k * hidden * ffn``) and the bandwidth of the expert weights the routing
touched (each distinct routed expert's gate/up/down once) plus activations.

    python -m core.benchmarks.fused_moe --platform cuda --shape qwen3-30b-a3b --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch

from core import ops as reference
from core.benchmarks.attention_kernels import FLUSH_BYTES, median_ms, resolve_platform
from core.models.moe import select_experts
from core.ops import Ops

LAYERS = {
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "tiny": (64, 96, 8, 2),  # checks the script on a CPU
}
"""hidden, ffn per expert, experts, top-k."""


def bench(op, shape: str, tokens: int, device, flush) -> dict:
    hidden, ffn, experts, k = LAYERS[shape]
    gen = torch.Generator(device=device).manual_seed(tokens)
    bf16 = dict(dtype=torch.bfloat16, device=device)
    x = torch.randn(tokens, hidden, generator=gen, **bf16)
    w13 = torch.randn(experts, 2 * ffn, hidden, generator=gen, **bf16) * hidden**-0.5
    w2 = torch.randn(experts, hidden, ffn, generator=gen, **bf16) * ffn**-0.5
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    weights, ids = select_experts(logits, k, renormalize=True)
    ms = median_ms(lambda: op(x, w13, w2, weights, ids), device, flush)
    touched = int(torch.unique(ids).numel())
    weight_bytes = touched * 3 * hidden * ffn * 2
    act_bytes = (tokens * hidden * 2) * 2 + tokens * k * (2 * ffn + hidden) * 2 * 2
    flops = 6 * tokens * k * hidden * ffn
    return {"shape": shape, "tokens": tokens, "experts_touched": touched,
            "time_us": round(ms * 1e3, 1), "tb_per_s": round((weight_bytes + act_bytes) / ms / 1e9, 2),
            "tflop_per_s": round(flops / ms / 1e9, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--platform", required=True)
    ap.add_argument("--plugin", action="append", default=[], help="platform module to register")
    ap.add_argument("--shape", choices=sorted(LAYERS), action="append")
    ap.add_argument("--tokens", default="1,8,64,256,1024,4096")
    ap.add_argument("--reference", action="store_true", help="time core.ops' reference")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(argv)
    platform = resolve_platform(ns.platform, ns.plugin)
    device = platform.device(0)
    op = reference.fused_moe if ns.reference else Ops(platform.ops()).fused_moe
    flush = torch.ones(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    rows = []
    with torch.inference_mode():
        for shape in ns.shape or sorted(LAYERS):
            for tokens in (int(t) for t in ns.tokens.split(",")):
                rows.append(bench(op, shape, tokens, device, flush))
                print(json.dumps(rows[-1]), flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"platform": platform.name, "torch": torch.__version__,
                       "reference": ns.reference, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
