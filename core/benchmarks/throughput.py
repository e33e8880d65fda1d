"""``core bench throughput``: N requests of random tokens through the offline engine."""

from __future__ import annotations

import json
import platform as host
import random
import time

from core.engine_args import EngineArgs
from core.sampling_params import SamplingParams


def run_throughput(ns) -> int:
    from core.entrypoints.llm import LLM

    args = EngineArgs.from_cli_args(ns)
    t0 = time.perf_counter()
    llm = LLM(**vars(args))
    startup = time.perf_counter() - t0
    vocab = llm.engine.vocab_size
    rng = random.Random(args.seed)
    # Random ids avoid tokenizer effects; keep away from the top of the vocab (special tokens).
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(ns.input_len)] for _ in range(ns.num_prompts)]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=ns.output_len, ignore_eos=True, seed=None)
    t0 = time.perf_counter()
    if ns.step_timing:
        outs, split = _generate_timed(llm.engine, prompts, params)
    else:
        outs, split = llm.generate(prompts, params, use_tqdm=False), None
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    result = {
        "num_prompts": ns.num_prompts,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "elapsed_s": round(elapsed, 3),
        "startup_s": round(startup, 3),
        "requests_per_s": round(ns.num_prompts / elapsed, 3),
        "output_tokens_per_s": round(n_out / elapsed, 2),
        "total_tokens_per_s": round((n_in + n_out) / elapsed, 2),
        "platform": llm.engine.platform.name,
        "model": llm.engine.config.model.model,
        "dtype": llm.engine.config.model.dtype,
        "machine": f"{host.machine()} {host.processor() or ''}".strip(),
    }
    if split is not None:
        result["step_split_s"] = split
        print("step time split (s): " + ", ".join(f"{k} {v}" for k, v in split.items()))
    print(
        f"Throughput: {result['requests_per_s']:.2f} requests/s, "
        f"{result['output_tokens_per_s']:.1f} output tokens/s, "
        f"{result['total_tokens_per_s']:.1f} total tokens/s ({elapsed:.1f} s)"
    )
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=2)
    llm.engine.shutdown()
    return 0


def _generate_timed(engine, prompts, params) -> tuple[list, dict]:
    """The engine loop of ``LLM.generate`` with each part of ``step()`` timed separately:
    schedule (host), execute (inputs, forward, sampling: ends in a device sync, so it holds
    the device time), update (host: detokenize, stop checks, outputs)."""
    ids = [engine.add_request(None, p, params, final_only=True) for p in prompts]
    done: dict[str, object] = {}
    split = {"schedule": 0.0, "execute": 0.0, "update": 0.0}
    steps = {"decode_only": 0, "with_prefill": 0}
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        sched = engine.scheduler.schedule()
        t1 = time.perf_counter()
        result = engine.executor.execute(sched)
        t2 = time.perf_counter()
        outs, stops = engine.output_processor.process(engine.scheduler.update(sched, result))
        for hit in stops:
            engine.core.stop_sample(hit.request_id, hit.index)
        for out in outs:
            if out.finished:
                done[out.request_id] = out
        t3 = time.perf_counter()
        split["schedule"] += t1 - t0
        split["execute"] += t2 - t1
        split["update"] += t3 - t2
        steps["with_prefill" if sched.num_prefills else "decode_only"] += 1
    return [done[i] for i in ids], {**{k: round(v, 3) for k, v in split.items()}, **steps}
