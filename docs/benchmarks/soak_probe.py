"""Where the soak's RSS growth comes from (see soak.md): the offline LLM, no HTTP.

    PYTHONPATH=. .venv/bin/python docs/benchmarks/soak_probe.py        # random prompt lengths
    PYTHONPATH=. .venv/bin/python docs/benchmarks/soak_probe.py 60     # always 60 words

300 ``generate()`` calls of 16 tokens on the embedded SmolLM2 (CPU); prints the RSS every 50.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from core.entrypoints.llm import LLM
from core.sampling_params import SamplingParams

WORDS = "the a river stone light north quiet garden paper window seven orange music cloud".split()


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    fixed = int(sys.argv[1]) if len(sys.argv) > 1 else None
    llm = LLM(platform="cpu", max_model_len=1024, kv_cache_memory="256MiB")
    rng = random.Random(0)
    params = SamplingParams(max_tokens=16, temperature=0.8)
    start = time.time()
    for i in range(301):
        words = fixed if fixed is not None else rng.randint(4, 120)
        llm.generate([" ".join(rng.choice(WORDS) for _ in range(words))], params, use_tqdm=False)
        if i % 50 == 0:
            print(f"{i} calls: RSS {rss_mib():.1f} MiB after {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
