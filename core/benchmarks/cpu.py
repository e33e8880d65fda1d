"""The CPU targets of issues 10 and 18, in one command: ``python -m core.benchmarks.cpu``.

Runs the embedded SmolLM2-135M-Instruct and prints achieved vs target vs llama.cpp:

* throughput: 32 requests x (128 in / 128 out) through ``core bench throughput``'s own
  code (random prompt ids, temperature 1, EOS ignored); target: 1.5x faster than llama.cpp's
  best setting (``llama-batched-bench -npl 32``), or <= 29.5 s without ``--peer``;
* decode: one sequence, 128-token prompt, 128 greedy tokens; tokens/s after the first
  token (median of ``--repeats``); target >= llama.cpp's ``llama-bench -n 128``;
* prefill: 32 prompts of 128 tokens in one batch, one output token each; prompt tokens/s;
  target >= 2x llama.cpp's prompt processing of the same 32 x 128 (``llama-batched-bench``);
* memory: resident set of the engine process with the model loaded and after the runs,
  against 1 GiB plus the KV cache it allocated.

``--peer DIR`` runs llama.cpp's ``llama-bench`` and ``llama-batched-bench`` from DIR on the same
GGUF file, at 1 and 2 threads, right before our engine in the same run, and takes its best
figures as the reference; without it the figures of issue 10 stand in. Engine options default
to the platform's pick for the model (``--dtype auto --weight-format auto``); any ``core``
engine flag can be passed. ``--isa avx2`` runs the CPU kernels' AVX2 path and caps torch's own
kernels (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, set by re-running this command) to
AVX2: what an AVX2-only CPU runs, on an AVX-512 machine. ``--hf`` adds HF transformers
``generate`` on the same model and workloads, shortened. Each figure carries the 1-minute load
average at its start: other processes on the machine slow every figure, so compare runs at
similar load, and peer and engine back to back.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform as host
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from core.engine_args import EngineArgs
from core.sampling_params import SamplingParams

LLAMA_CPP = {"throughput_s": 44.3, "decode_tok_s": 73.0, "prefill_tok_s": 204.0}
"""llama.cpp (AVX-512, Q4_1 weights) on the 2-core AMD EPYC of issue 10 (without ``--peer``)."""
TARGETS = {"throughput_s": 29.5, "decode_tok_s": 73.0, "prefill_tok_s": 400.0}
"""Issue 10's targets; with ``--peer`` they follow llama.cpp (see :func:`peer_targets`)."""
ISA_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}
"""torch's own kernel caps that go with ``--isa`` (read by torch when it loads)."""
GiB = 1 << 30


@dataclass
class Row:
    name: str
    value: float
    unit: str
    target: str
    ok: bool | None
    load: float
    llama_cpp: float | None = None
    hf: str = ""
    extra: dict = field(default_factory=dict)


def load_average() -> float:
    return os.getloadavg()[0]


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
    except (OSError, subprocess.SubprocessError):
        name = host.processor()
    return f"{name or host.machine()}, {os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))})"


def rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set of this process from /proc/self/status."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)  # as core bench throughput: ids away from the special tokens
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


# ---- our engine --------------------------------------------------------------------------


def bench_throughput(ns, engine_argv: list[str]) -> Row:
    """``core bench throughput --num-prompts 32 --input-len 128 --output-len 128``, in-process."""
    from core.entrypoints.cli import build_parser

    load = load_average()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        args = build_parser().parse_args([
            "bench", "throughput", "--num-prompts", str(ns.num_prompts), "--input-len",
            str(ns.input_len), "--output-len", str(ns.output_len), "--output-json", f.name, *engine_argv,
        ])
        args.func(args)  # exactly what the `core bench throughput ...` command runs
        with open(f.name) as out:
            result = json.load(out)
    elapsed = result["elapsed_s"]
    return Row(f"throughput {ns.num_prompts} x {ns.input_len}/{ns.output_len}", elapsed, "s",
               f"<= {ns.targets['throughput_s']:.1f}", elapsed <= ns.targets["throughput_s"], load,
               ns.reference["throughput_s"], extra=result)


def bench_decode(llm, ns) -> Row:
    """One sequence: decode tokens/s after its first token, median over repeats."""
    vocab = llm.engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    warm = random_prompts(1, ns.input_len, vocab, ns.seed + 100)
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    load, rates = load_average(), []
    for i in range(ns.repeats):  # a fresh prompt each time: no prefix-cache hits
        prompt = random_prompts(1, ns.input_len, vocab, ns.seed + 101 + i)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        m, n = out.metrics, len(out.outputs[0].token_ids)
        rates.append((n - 1) / (m.finished_time - m.first_token_time))
    rate = statistics.median(rates)
    return Row("decode, one sequence", rate, "tok/s", f">= {ns.targets['decode_tok_s']:.1f}",
               rate >= ns.targets["decode_tok_s"], load, ns.reference["decode_tok_s"],
               extra={"runs_tok_s": [round(r, 1) for r in rates]})


def bench_prefill(llm, ns) -> Row:
    """A batch of prompts, one output token each: prompt tokens per second."""
    vocab = llm.engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(random_prompts(2, ns.input_len, vocab, ns.seed + 200), params, use_tqdm=False)
    load, rates = load_average(), []
    for i in range(ns.repeats):  # fresh prompts each time: no prefix-cache hits
        prompts = random_prompts(ns.num_prompts, ns.input_len, vocab, ns.seed + 201 + i)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(ns.num_prompts * ns.input_len / (time.perf_counter() - t0))
    rate = statistics.median(rates)
    return Row(f"prefill, {ns.num_prompts} x {ns.input_len} prompt tokens", rate, "tok/s",
               f">= {ns.targets['prefill_tok_s']:.0f}", rate >= ns.targets["prefill_tok_s"], load,
               ns.reference["prefill_tok_s"], extra={"runs_tok_s": [round(r, 1) for r in rates]})


def memory_row(llm, loaded_rss: int) -> Row:
    kv = llm.engine.kv_plan.num_blocks * llm.engine.executor.runner.kv_bytes_per_block()
    rss, peak = rss_bytes()
    limit = GiB + kv
    return Row("resident set (peak)", peak / GiB, "GiB", f"<= 1 GiB + KV {kv / GiB:.2f} GiB",
               peak <= limit, load_average(),
               extra={"rss_after_load_gib": round(loaded_rss / GiB, 3), "rss_now_gib": round(rss / GiB, 3),
                      "kv_cache_gib": round(kv / GiB, 3)})


def run_ours(ns, engine_argv: list[str]) -> tuple[list[Row], dict]:
    from core.entrypoints.llm import LLM

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    args = EngineArgs.from_cli_args(p.parse_args(engine_argv))
    llm = LLM(**vars(args))
    loaded_rss, _ = rss_bytes()
    cfg = llm.engine.config.model
    setup = {"dtype": cfg.dtype, "weight_format": cfg.weight_format}
    rows = [bench_decode(llm, ns), bench_prefill(llm, ns), memory_row(llm, loaded_rss)]
    if ns.profile:
        setup["profile"] = [decode_profile(llm, b, ns.input_len + ns.output_len // 2) for b in (1, ns.num_prompts)]
    llm.engine.shutdown()
    del llm
    rows.insert(0, bench_throughput(ns, engine_argv))
    return rows, setup


# ---- where a decode step's time goes -------------------------------------------------------------

CATEGORIES = (
    ("fused decode layers (csrc)", ("core_cpu::decode_stack",)),  # matmuls, attention, norms inside
    ("int4/int8 matmuls", ("_weight_int4pack_mm", "_weight_int8pack_mm", "quant_linear")),
    ("dense matmuls (oneDNN)", ("aten::mm", "aten::addmm", "aten::bmm")),
    ("LM head (fp32 logits)", ("linear_f32out",)),
    ("paged attention + KV write", ("paged_decode", "write_kv")),
    ("norms, rotary, SiLU", ("rms_norm", "rotary_embedding", "silu_and_mul")),
    ("sampler", ("aten::max", "aten::exp", "aten::sub", "aten::sum", "aten::log", "aten::gather",
                 "aten::div", "aten::rand", "aten::cumsum", "aten::topk", "aten::sort")),
)


def decode_profile(llm, batch: int, context: int, iters: int = 5) -> str:
    """Self CPU time per category of one decode step of ``batch`` sequences at ``context``
    cached tokens (torch.profiler), and the rest of the step's wall time (Python, dispatch)."""
    from torch.profiler import profile

    from core.benchmarks.model_step import decode_schedule

    runner = llm.engine.executor.runner
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=1000)
    sched = decode_schedule(batch, context, runner.block_size, params, llm.engine.vocab_size)
    for _ in range(3):
        runner.execute(sched)
    t0 = time.perf_counter()
    for _ in range(iters):
        runner.execute(sched)
    wall = (time.perf_counter() - t0) / iters * 1e3
    with profile() as prof:
        for _ in range(iters):
            runner.execute(sched)
    totals = dict.fromkeys([c for c, _ in CATEGORIES], 0.0)
    for evt in prof.key_averages():
        for cat, keys in CATEGORIES:
            if any(k in evt.key for k in keys):
                totals[cat] += evt.self_cpu_time_total / iters / 1e3
                break
    threads = torch_threads()  # op times below are wall time on the calling thread
    lines = [f"decode step, {batch} sequence(s) at {context} cached tokens: {wall:.2f} ms wall "
             f"({1e3 * batch / wall:.0f} tok/s), {threads} thread(s), load {load_average():.2f}"]
    for cat, ms in totals.items():
        lines.append(f"  {cat:<28} {ms:6.2f} ms  {100 * ms / wall:4.0f}%")
    rest = wall - sum(totals.values())
    lines.append(f"  {'Python, dispatch, other ops':<28} {rest:6.2f} ms  {100 * rest / wall:4.0f}%")
    return "\n".join(lines)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


# ---- HF transformers, same model and workloads (shortened) ------------------------------------


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_hf(ns) -> dict[str, str]:
    """HF ``generate`` / forward figures, keyed like the rows they sit beside."""
    import torch
    from transformers import AutoModelForCausalLM

    from core.model_loader import default_model_path

    folder, name = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    out: dict[str, str] = {}
    with torch.inference_mode():
        one = torch.tensor(random_prompts(1, ns.input_len, vocab, ns.seed + 1))
        greedy = dict(do_sample=False, pad_token_id=0)
        first = _timed(lambda: model.generate(one, max_new_tokens=1, **greedy))
        n = ns.hf_decode_tokens
        total = _timed(lambda: model.generate(one, max_new_tokens=n, min_new_tokens=n, **greedy))
        out["decode"] = f"{(n - 1) / (total - first):.1f} tok/s ({n} tokens, load {load_average():.1f})"
        batch = torch.tensor(random_prompts(ns.hf_prefill_seqs, ns.input_len, vocab, ns.seed + 2))
        secs = _timed(lambda: model(batch))
        out["prefill"] = (f"{batch.numel() / secs:.0f} tok/s ({ns.hf_prefill_seqs} x {ns.input_len}, "
                          f"load {load_average():.1f})")
        prompts = torch.tensor(random_prompts(ns.num_prompts, ns.input_len, vocab, ns.seed))
        k = ns.hf_output_len
        sample = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)
        secs = _timed(lambda: model.generate(prompts, max_new_tokens=k, min_new_tokens=k, **sample))
        out["throughput"] = (f"{secs:.1f} s for {ns.num_prompts} x {ns.input_len}/{k} "
                             f"({ns.num_prompts * k / secs:.1f} out tok/s, load {load_average():.1f})")
    return out


# ---- llama.cpp on the same GGUF (--peer) --------------------------------------------------------


def _run_peer_tool(cmd: list[str], timeout: float = 900) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def _batched_row(text: str) -> dict[str, float]:
    """The result row of llama-batched-bench's table (| PP | TG | B | N_KV | T_PP s | S_PP t/s |
    T_TG s | S_TG t/s | T s | S t/s |)."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            return {"t_pp_s": float(cells[4]), "s_pp": float(cells[5]), "t_tg_s": float(cells[6]),
                    "t_s": float(cells[8])}
    raise RuntimeError(f"no result row in llama-batched-bench output:\n{text[-2000:]}")


def run_peer(ns, gguf: str) -> dict:
    """llama.cpp's figures for our three workloads at each thread count up to the cores, and
    the best of each (our reference)."""
    bench, batched = os.path.join(ns.peer, "llama-bench"), os.path.join(ns.peer, "llama-batched-bench")
    runs = []
    for threads in range(1, len(os.sched_getaffinity(0)) + 1):
        load = load_average()
        records = json.loads(_run_peer_tool([
            bench, "-m", gguf, "-p", str(ns.input_len), "-n", str(ns.output_len), "-t", str(threads),
            "-r", str(ns.repeats), "-o", "json"]))
        tg = next(r["avg_ts"] for r in records if r["n_gen"] > 0 and r["n_prompt"] == 0)
        pp1 = next(r["avg_ts"] for r in records if r["n_prompt"] > 0 and r["n_gen"] == 0)
        load_batch = load_average()
        ctx = ns.num_prompts * (ns.input_len + ns.output_len + 16)
        row = _batched_row(_run_peer_tool([
            batched, "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(ns.input_len),
            "-ntg", str(ns.output_len), "-npl", str(ns.num_prompts), "-t", str(threads)]))
        runs.append({"threads": threads, "decode_tok_s": tg, "prefill_1x_tok_s": pp1, "load": round(load, 2),
                     "throughput_s": row["t_s"], "prefill_tok_s": row["s_pp"], "load_batch": round(load_batch, 2)})
    best = {"throughput_s": min(r["throughput_s"] for r in runs),
            "decode_tok_s": max(r["decode_tok_s"] for r in runs),
            "prefill_tok_s": max(r["prefill_tok_s"] for r in runs)}
    return {"best": best, "runs": runs}


def peer_targets(best: dict) -> dict:
    """Issue 18: the batch job 1.5x faster, decode at least llama.cpp's, prefill 2x."""
    return {"throughput_s": best["throughput_s"] / 1.5, "decode_tok_s": best["decode_tok_s"],
            "prefill_tok_s": 2 * best["prefill_tok_s"]}


# ---- report ------------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    head = ("target", "achieved", "goal", "met", "llama.cpp", "HF transformers", "load")
    lines = []
    for r in rows:
        value = f"{r.value:.2f} {r.unit}" if r.unit == "GiB" else f"{r.value:.1f} {r.unit}"
        met = "-" if r.ok is None else ("yes" if r.ok else "NO")
        ref = "" if r.llama_cpp is None else f"{r.llama_cpp:g} {r.unit}"
        lines.append((r.name, value, r.target, met, ref, r.hf, f"{r.load:.2f}"))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([fmt.format(*head), sep, *(fmt.format(*ln) for ln in lines)])


def _cap_torch_isa(isa: str, argv: list[str] | None) -> None:
    """torch reads its kernel caps when it loads: re-run this command with them set."""
    env = ISA_ENV.get(isa, {})
    if env and any(os.environ.get(k) != v for k, v in env.items()):
        import sys

        args = sys.argv[1:] if argv is None else argv
        os.execvpe(sys.executable, [sys.executable, "-m", "core.benchmarks.cpu", *args], {**os.environ, **env})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Other arguments are core engine flags (--dtype, --weight-format, ...).")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="runs of the decode and prefill figures (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf", action="store_true", help="also run HF transformers on shortened workloads")
    p.add_argument("--hf-decode-tokens", type=int, default=32)
    p.add_argument("--hf-prefill-seqs", type=int, default=8)
    p.add_argument("--hf-output-len", type=int, default=16)
    p.add_argument("--profile", action="store_true",
                   help="also print where a decode step's time goes (batch 1 and --num-prompts)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--peer", default=None, metavar="DIR",
                   help="directory holding llama.cpp's llama-bench and llama-batched-bench: run them too")
    p.add_argument("--isa", default="auto", choices=["auto", "avx2", "generic"],
                   help="CPU kernel path; avx2 also caps torch's kernels to AVX2 (an AVX2-only CPU)")
    ns, engine_argv = p.parse_known_args(argv)
    _cap_torch_isa(ns.isa, argv)  # re-runs this command under torch's AVX2 caps; returns otherwise
    import torch

    from core.model_loader import default_model_path
    from platforms.cpu.isa import force_isa, has_native_bf16

    isa = force_isa(ns.isa)
    if ns.isa != "auto" and not any(a.startswith(("--dtype", "--weight-format")) for a in engine_argv):
        # What the platform picks for a 4-bit GGUF on a CPU without native bf16.
        engine_argv += ["--dtype", "float32", "--weight-format", "int4"] if has_native_bf16() else []
    started = datetime.datetime.now().isoformat(timespec="seconds")
    threads = torch.get_num_threads()  # the ceiling; the CPU platform lowers it under load
    ns.reference, ns.targets, peer = LLAMA_CPP, TARGETS, None
    if ns.peer:  # right before our engine, so both see the same machine load
        peer = run_peer(ns, default_model_path())
        ns.reference, ns.targets = peer["best"], peer_targets(peer["best"])
    rows, setup = run_ours(ns, engine_argv)
    setup["isa"], setup["torch_capability"] = isa, torch.backends.cpu.get_cpu_capability()
    if ns.hf:
        hf = run_hf(ns)
        for row, key in zip(rows, ("throughput", "decode", "prefill")):
            row.hf = hf[key]
    print(f"\nmachine: {machine()}; torch {torch.__version__} ({setup['torch_capability']}), up to "
          f"{threads} threads; {started}; engine: dtype {setup['dtype']}, weight format "
          f"{setup['weight_format']}, kernels {isa} path")
    if peer:
        print("llama.cpp (" + ns.peer + "): " + "; ".join(
            f"{r['threads']} thread(s): decode {r['decode_tok_s']:.1f} tok/s, prefill 1 x {ns.input_len} "
            f"{r['prefill_1x_tok_s']:.0f} tok/s (load {r['load']}), {ns.num_prompts} x {ns.input_len}/"
            f"{ns.output_len} job {r['throughput_s']:.1f} s, its prefill {r['prefill_tok_s']:.0f} tok/s "
            f"(load {r['load_batch']})" for r in peer["runs"]))
    print(table(rows))
    for text in setup.get("profile", []):
        print(text)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"machine": machine(), "date": started, "engine": setup, "threads": threads,
                       "peer": peer, "rows": [r.__dict__ for r in rows]}, f, indent=2)
    return 0 if all(r.ok is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
