"""Where the soak's RSS growth comes from (see soak.md): the offline LLM, no HTTP.

PYTHONPATH=. .venv/bin/python docs/benchmarks/soak_probe.py        # random prompt lengths
PYTHONPATH=. .venv/bin/python docs/benchmarks/soak_probe.py 60     # always 60 words
"""

import random
import sys
import time

from core.entrypoints.llm import LLM
from core.sampling_params import SamplingParams


def rss():
    for l in open("/proc/self/status"):
        if l.startswith("VmRSS"):
            return int(l.split()[1]) / 1024


W = "the a river stone light north quiet garden paper window seven orange music cloud".split()
llm = LLM(platform="cpu", max_model_len=1024, kv_cache_memory="256MiB")
rng = random.Random(0)
sp = SamplingParams(max_tokens=16, temperature=0.8)
t = time.time()
for i in range(301):
    llm.generate(
        [
            " ".join(
                rng.choice(W)
                for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else rng.randint(4, 120))
            )
        ],
        sp,
        use_tqdm=False,
    )
    if i % 50 == 0:
        print(i, round(rss(), 1), round(time.time() - t), flush=True)
