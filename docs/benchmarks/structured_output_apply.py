"""Time the bitmask application: core's apply_bitmask, its host fallback, and llguidance's
torch.compile kernel, on the logits' device (CUDA when present, else CPU).

    .venv/bin/python docs/benchmarks/structured_output_apply.py [--vocab 128256]

Prints one JSON line per (function, batch): median milliseconds over 50 runs, the device
synchronized around each run. The copy of the bitmask from pinned host memory is included,
as in the sampler.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from core.structured_output import apply_bitmask, apply_bitmask_host  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def llguidance_apply(logits, bitmask, rows=None):
    import llguidance.torch

    llguidance.torch.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pin = device.type == "cuda"
    for batch in (1, 32, 256):
        logits = torch.randn(batch, args.vocab, device=device)
        words = (args.vocab + 31) // 32
        bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32)
        bitmask = bitmask.pin_memory() if pin else bitmask
        for fn in (apply_bitmask, apply_bitmask_host, llguidance_apply):
            fn(logits.clone(), bitmask)  # warm-up (and torch.compile for llguidance)
            times = []
            for _ in range(args.runs):
                x = logits.clone()
                sync(device)
                t0 = time.perf_counter()
                fn(x, bitmask)
                sync(device)
                times.append(time.perf_counter() - t0)
            print(json.dumps({"fn": fn.__name__, "device": str(device), "batch": batch, "vocab": args.vocab,
                              "ms_median": round(statistics.median(times) * 1e3, 4)}), flush=True)


if __name__ == "__main__":
    main()
