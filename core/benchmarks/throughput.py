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
    outs = llm.generate(prompts, params, use_tqdm=False)
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
