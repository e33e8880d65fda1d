"""Sampler microbenchmark: median wall time of one ``Sampler.__call__`` (read-back included).

    python -m core.benchmarks.sampler [--batch 256] [--vocab 128256] [--repeats 5]
                                      [--top-p-candidates N] [--threads N]
    python -m core.benchmarks.sampler --grid [--platform cuda] [--batches 1,64,256]
                                      [--repeats 20] [--output-json F]
    python -m core.benchmarks.sampler --pack [--batch 500] [--repeats 200]

Each parameter mix runs on the same seeded logits. Two logit shapes are used: ``peaked``
(Gaussian bulk plus a few dominant tokens per row, like an LM's next-token logits; nuclei
of tens of tokens) and ``flat`` (pure Gaussian, nuclei of tens of thousands of tokens: the
worst case for top-p). ``--top-p-candidates 0`` switches the top-p candidate search off
(always a full sort), to compare with the textbook method. Mixes with penalties run a second
time with the device penalty state (``[device state]``), to compare the two on the CPU.

``--grid`` runs the accelerator grid instead, on the selected platform's device: batches
1/64/256 x vocab 128256 x the grid's mixes (greedy, temperature 1, top-p 0.9 + top-k 50,
penalties with top-k 50, penalties at temperature 1), the torch pipeline ("torch") against
the platform's fused sampling kernel ("kernel", from its op table: csrc/sampling on CUDA),
both staged as the model runner stages them. Mixes with penalties also run both with the
device penalty state (core/sampler/penalties.py; "torch+state", "kernel+state": the rows
join the state in the warm-up call, each timed call then counts its tokens on the device,
as in a decode loop) against the host-built history ("torch", "kernel": ``np.unique`` over
each row's 512 prompt + 128 output ids every call). Per cell: ``wall_ms``, one whole call as the engine makes it (host packing, launches,
the read-back); ``device_ms``, the device time of ``Sampler.draw`` alone, between two events
queued behind ~50 ms of matmuls so that the host's launch time is not counted.

``--pack`` times the host half of a fused-kernel call alone: ``core.sampler.kernel.pack``
over the mixes' rows (one params object per row, as requests bring their own), which the
engine's step loop runs on the host every step while the device works.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from core.sampler import Sampler, Staging
from core.sampler.draw import inverse_cdf as _inverse_cdf
from core.sampling_params import SamplingParams
from core.scheduler import ScheduledSequence

PROMPT_LEN, OUTPUT_LEN = 512, 128


def make_logits(batch: int, vocab: int, shape: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen) * 2.0
    if shape == "peaked":
        hot = torch.randint(0, vocab, (batch, 16), generator=gen)
        logits.scatter_(1, hot, 15.0 + 5.0 * torch.rand(batch, 16, generator=gen))
    return logits


def make_rows(batch: int, vocab: int, make: Callable[[int], SamplingParams]) -> list:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for i in range(batch):
        params = make(i)
        history = params.needs_token_history
        prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist()
        output = torch.randint(0, vocab, (OUTPUT_LEN,), generator=gen).tolist()
        rows.append(
            ScheduledSequence(
                seq_id=i,
                request_id=str(i),
                token_ids=(output[-1],),
                start_pos=PROMPT_LEN + OUTPUT_LEN - 1,
                block_table=(),
                sample=True,
                params=params,
                output_index=OUTPUT_LEN,
                prompt_token_ids=tuple(prompt) if history else (),
                output_token_ids=tuple(output) if history else (),
            )
        )
    return rows


MIXES: dict[str, Callable[[int], SamplingParams]] = {
    "all greedy": lambda i: SamplingParams(temperature=0.0),
    "temperature 0.8 + top_p 0.95": lambda i: SamplingParams(temperature=0.8, top_p=0.95),
    "top_k 50 + rep/pres/freq penalties": lambda i: SamplingParams(
        top_k=50, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3
    ),
    "seeded, temperature 1.0": lambda i: SamplingParams(seed=i),
    "mixed (greedy/top_p/top_k/min_p/seeded/logprobs)": lambda i: [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(top_k=40, top_p=0.95, logprobs=5),
        SamplingParams(min_p=0.05, seed=i),
    ][i % 4],
}


def time_fn(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall and median process CPU seconds of ``fn()`` after one warm-up call. On a
    shared machine with --threads 1, CPU time is what the wall time would be on an idle core."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def primitives(batch: int, vocab: int, repeats: int) -> list[tuple[str, tuple[float, float]]]:
    """The design choices measured against the textbook alternative, on the same data."""
    gen = torch.Generator().manual_seed(2)
    z = make_logits(batch, vocab, "flat")
    p = torch.exp(z - z.amax(dim=-1, keepdim=True))
    u = torch.rand(batch, generator=gen, dtype=torch.float64)
    # Preallocated outputs, so that neither side pays for page faults.
    vals, ids, noise = (
        torch.empty_like(z),
        torch.empty_like(z, dtype=torch.int64),
        torch.empty_like(p),
    )
    cases = {
        "top-p cut-off: full sort (textbook)": lambda: torch.sort(
            z, dim=-1, descending=True, out=(vals, ids)
        ),
        "top-p cut-off: top-256 candidates (ours)": lambda: z.topk(256, dim=-1),
        "draw: exponential race, noise + argmax (vLLM)": lambda: torch.div(
            p, noise.exponential_(generator=gen), out=noise
        ).argmax(dim=-1),
        "draw: one uniform per row, inverse CDF (ours)": lambda: _inverse_cdf(p, u),
    }
    return [(name, time_fn(fn, repeats)) for name, fn in cases.items()]


GPU_MIXES: dict[str, Callable[[int], SamplingParams]] = {
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "temperature 1": lambda i: SamplingParams(temperature=1.0),
    "top_p 0.9 + top_k 50": lambda i: SamplingParams(temperature=1.0, top_p=0.9, top_k=50),
    "penalties (top_k 50 + rep/pres/freq)": MIXES["top_k 50 + rep/pres/freq penalties"],
    "penalties (temperature 1 + rep/pres/freq)": lambda i: SamplingParams(
        temperature=1.0, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3
    ),
}


def _has_penalties(make: Callable[[int], SamplingParams]) -> bool:
    return make(0).needs_token_history


class DeviceClock:
    """GPU-side time of queued work on an accelerator, through torch's device-generic events.
    The host runs ahead behind a queue of matmuls (~50 ms of device work), so the measured
    interval holds device time only, not the host's launch gaps."""

    def __init__(self, device: torch.device, sync: Callable[[], None]):
        self.device, self.sync = device, sync
        self.a = torch.randn(2048, 2048, device=device)
        self.out = torch.empty_like(self.a)
        self.sync()
        t = time.perf_counter()
        for _ in range(5):
            torch.mm(self.a, self.a, out=self.out)
        self.sync()
        self.busy = max(1, int(0.05 / max((time.perf_counter() - t) / 5, 1e-6)))
        try:  # a host device has no events: its device time is the synchronised wall time
            torch.Event(device=device, enable_timing=True).record()
            self.events = True
        except RuntimeError:
            self.events = False

    def median_ms(self, fn: Callable[[], object], repeats: int) -> float:
        if not self.events:
            return 1e3 * time_fn(lambda: (fn(), self.sync()), repeats)[0]
        times = []
        for _ in range(repeats):
            self.sync()
            for _ in range(self.busy):
                torch.mm(self.a, self.a, out=self.out)
            start = torch.Event(device=self.device, enable_timing=True)
            end = torch.Event(device=self.device, enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


def device_grid(args: argparse.Namespace) -> list[dict]:
    """The torch pipeline against the platform's fused kernel (see the module docstring)."""
    from core.ops import Ops
    from core.platform import Capability
    from core.plugins import load_plugins

    plugins = load_plugins()
    info = plugins.select(args.platform)
    platform = info.cls()
    device = platform.device()
    caps = platform.capabilities
    stage = Staging(pinned=Capability.PINNED_HOST_MEMORY in caps and Capability.DEVICE_MEMORY in caps)
    kernel = Ops({**platform.ops(), **plugins.op_overrides(info.name)}).sampling_kernel
    paths = {"torch": {}, "kernel": {"kernel": kernel},
             "torch+state": {"penalty_state": True}, "kernel+state": {"kernel": kernel, "penalty_state": True}}
    clock = DeviceClock(device, platform.synchronize)
    print(f"platform {info.name}, device {device}, kernel {kernel!r}, staging {stage}")
    print(f"{'logits':7s} {'batch':>5s} {'mix':41s} {'path':12s} {'wall ms':>8s} {'device ms':>9s}")
    results = []
    for shape in args.shapes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            logits = make_logits(batch, args.vocab, shape).to(device)
            for name, make in GPU_MIXES.items():
                if args.mixes and not any(m in name for m in args.mixes.split(",")):
                    continue
                rows = make_rows(batch, args.vocab, make)
                for path, extra in paths.items():
                    if "penalty_state" in extra and not _has_penalties(make):
                        continue  # without penalties the state path is the plain one
                    s = Sampler(frozenset({0}), seed=0, staging=stage, **extra)
                    wall, _ = time_fn(lambda s=s, x=logits, r=rows: s(x, r), args.repeats)
                    dev = clock.median_ms(lambda s=s, x=logits, r=rows: s.draw(x, r), args.repeats)
                    results.append({"platform": info.name, "logits": shape, "batch": batch,
                                    "vocab": args.vocab, "mix": name, "path": path,
                                    "wall_ms": wall * 1e3, "device_ms": dev})
                    print(f"{shape:7s} {batch:5d} {name:41s} {path:12s} {wall * 1e3:8.3f} {dev:9.3f}")
    return results


def pack_times(args: argparse.Namespace) -> list[dict]:
    """Median wall time of ``pack`` per mix, batch ``args.batch``."""
    from core.sampler.kernel import pack

    print(f"pack, batch {args.batch} x vocab {args.vocab}, median of {args.repeats}; "
          f"load average {os.getloadavg()}")
    results = []
    for name, make in MIXES.items():
        if args.mixes and not any(m in name for m in args.mixes.split(",")):
            continue
        rows = make_rows(args.batch, args.vocab, make)
        uniforms = {i: 0.5 for i, r in enumerate(rows) if not r.params.greedy}
        wall, _ = time_fn(lambda r=rows, u=uniforms: pack(r, args.vocab, frozenset({0}), u), args.repeats)
        results.append({"mix": name, "pack_ms": wall * 1e3})
        print(f"{name:50s} {wall * 1e3:9.3f} ms")
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top-p-candidates", type=int, default=None)
    ap.add_argument("--shapes", default="peaked,flat")
    ap.add_argument("--mixes", default=None, help="comma-separated substrings of mix names")
    ap.add_argument("--primitives", action="store_true", help="also time the design choices")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--device", default="cpu", help="torch device of the logits")
    ap.add_argument("--pinned", action="store_true", help="page-locked staging (accelerators)")
    ap.add_argument("--grid", action="store_true",
                    help="accelerator grid: torch pipeline vs the platform's fused kernel")
    ap.add_argument("--platform", default=None, help="grid: platform name (default: selected)")
    ap.add_argument("--batches", default="1,64,256", help="grid: comma-separated batch sizes")
    ap.add_argument("--pack", action="store_true", help="time the host packing of the fused kernel's inputs only")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.pack:
        results = pack_times(args)
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(results, f, indent=2)
        return
    if args.grid:
        print(f"torch {torch.__version__}, vocab {args.vocab}, median of {args.repeats}; "
              f"load average {os.getloadavg()}")
        results = device_grid(args)
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(results, f, indent=2)
        return
    sampler = Sampler(frozenset({0}), seed=0, top_p_candidates=args.top_p_candidates,
                      staging=Staging(pinned=args.pinned))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch} "
        f"x vocab {args.vocab}, median of {args.repeats}; load average {os.getloadavg()}"
    )
    print(f"{'logits':7s} {'mix':50s} {'wall ms':>9s} {'cpu ms':>9s}")
    results = []
    for shape in args.shapes.split(","):
        logits = make_logits(args.batch, args.vocab, shape).to(args.device)
        for name, make in MIXES.items():
            if args.mixes and not any(m in name for m in args.mixes.split(",")):
                continue
            rows = make_rows(args.batch, args.vocab, make)
            runs = [(name, sampler)]
            if _has_penalties(make):  # the same rows again through a fresh device state
                state = Sampler(frozenset({0}), seed=0, top_p_candidates=args.top_p_candidates,
                                staging=Staging(pinned=args.pinned), penalty_state=True)
                runs.append((f"{name} [device state]", state))
            for label, s in runs:
                wall, cpu = time_fn(lambda s=s, x=logits, r=rows: s(x, r), args.repeats)
                results.append(
                    {"logits": shape, "mix": label, "wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3}
                )
                print(f"{shape:7s} {label:50s} {wall * 1e3:9.1f} {cpu * 1e3:9.1f}")
    if args.primitives:
        for name, (wall, cpu) in primitives(args.batch, args.vocab, args.repeats):
            results.append({"primitive": name, "wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3})
            print(f"{name:58s} {wall * 1e3:9.1f} {cpu * 1e3:9.1f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
