"""Structured-output overhead through the whole engine: output tokens/s of the same batch with
and without a JSON schema, at batch 1 and 32 (docs/benchmarks/structured_output.md).

Both runs of a pair generate exactly ``--max-tokens`` tokens per sequence (``ignore_eos``),
so they do the same model work; the schema run adds the per-step mask fill (host), the mask
copy and its application in the sampler, and the matchers' token accepts. After the grammar
is complete only EOS is allowed, so a sequence keeps paying for its masks until
``max_tokens``: the figure is the per-token cost of a constrained row, not an average over
free text. Each configuration runs once to warm up (grammar compile, lexer) and then
``--repeats`` times; the best time is reported (the host is shared: the minimum is the run
least disturbed).

    PYTHONPATH=. .venv/bin/python docs/benchmarks/structured_output_overhead.py            # CPU, SmolLM2
    PYTHONPATH=. python3 docs/benchmarks/structured_output_overhead.py --platform cuda \
        --model DIR --load-format dummy --dtype bfloat16                                # the H200

On the H200 (no hub, and the embedded GGUF is too big to travel with a device run) DIR holds
SmolLM2-135M-Instruct's config.json and tokenizer, exported from the embedded GGUF here with
``core.tokenizer.load_tokenizer`` and ``AutoConfig.from_pretrained(..., gguf_file=...)``;
the weights are random, which changes nothing in the work done per token.
"""

from __future__ import annotations

import argparse
import json
import time

from core import LLM, SamplingParams
from core.structured_output import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "tags", "address"],
}
PROMPT = "Describe a person as JSON with name, age, tags and address."


def run(llm: LLM, batch: int, max_tokens: int, structured: bool, temperature: float) -> tuple[float, int]:
    spec = GrammarSpec.of("json_schema", SCHEMA) if structured else None
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=max_tokens, ignore_eos=True,
                            structured=spec)
    t0 = time.perf_counter()
    outs = llm.generate([PROMPT] * batch, params, use_tqdm=False)
    took = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    if structured:  # the text before the EOS padding must be the schema's JSON
        first = outs[0].outputs[0]
        json.loads(llm.get_tokenizer().decode(
            [t for t in first.token_ids if t not in llm.engine.core.scheduler.eos_token_ids]))
    return took, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--platform", default="cpu")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--load-format", default="auto",
                    help="'dummy': random weights for a directory holding config.json and a tokenizer")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    llm = LLM(model=args.model, platform=args.platform, max_model_len=512, load_format=args.load_format,
              dtype=args.dtype)
    print("| batch | schema | best s | output tok/s | overhead |")
    print("|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        best = {}
        for structured in (False, True):
            run(llm, batch, args.max_tokens, structured, args.temperature)  # warm-up
            times = [run(llm, batch, args.max_tokens, structured, args.temperature) for _ in range(args.repeats)]
            best[structured] = min(times)
        for structured in (False, True):
            took, tokens = best[structured]
            extra = f"{100 * (took / best[False][0] - 1):+.1f}%" if structured else ""
            print(f"| {batch} | {'yes' if structured else 'no'} | {took:.2f} | {tokens / took:.1f} | {extra} |",
                  flush=True)


if __name__ == "__main__":
    main()
