"""Compare xgrammar and llguidance on core's tokenizers (the figures in structured_output.md).

    .venv/bin/python docs/benchmarks/structured_output_libs.py [--steps 64] [--walks 3]

For each library and tokenizer (the tiny test tokenizer, 512 tokens; the embedded SmolLM2,
49,152): tokenizer set-up time; compile time of each schema in tests/unit/structured_schemas.py
(cold, caches off where the library has a switch); per-step mask time over random walks at
batch 1 and 32; resident memory growth; and correctness: the share of seeded random walks
(argmax of random logits under the mask) that end in JSON valid against its schema.
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

from tests.unit.structured_schemas import SCHEMAS  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def tokenizers():
    from core.gguf_file import load_gguf_tokenizer
    from core.model_loader import default_model_path
    from tests.helpers import build_tokenizer

    yield "tiny-512", build_tokenizer(512), 512
    tok = load_gguf_tokenizer(default_model_path(), os.path.expanduser("~/.cache/core"))
    yield "smollm2", tok, 49152


# The same JSON layout from both: json.dumps's separators, no free whitespace (a sampler that
# may emit whitespace forever can be walked into doing so).
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab):
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, vocab
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, rows, bitmask):
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)

    def accept(self, m, t):
        assert m.accept_token(t), t

    def done(self, m):
        return m.is_terminated()

    def apply(self, logits, bitmask):
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab):
        import llguidance
        import llguidance.hf

        self.llg = llguidance  # llguidance.torch is imported by apply() only: it pulls in dynamo
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=COMPACT)
        m = self.llg.LLMatcher(self.tok, grammar)
        assert not m.is_error(), m.get_error()
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tok, grammar, log_level=0)

    def fill(self, matchers, rows, bitmask):
        pairs = list(zip(matchers, rows))
        self.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])

    def accept(self, m, t):
        assert m.consume_token(t), m.get_error()

    def done(self, m):
        return m.is_stopped()

    def apply(self, logits, bitmask):
        import llguidance.torch

        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)


def unpack_allowed(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab].bool()


def walk(lib, compiled_list, vocab, steps, seed):
    """Random walks, one matcher per row; returns (per-step fill seconds, texts, finished)."""
    gen = torch.Generator().manual_seed(seed)
    matchers = [lib.matcher(c) for c in compiled_list]
    tokens = [[] for _ in matchers]
    bitmask = torch.full(((len(matchers)), (vocab + 31) // 32), -1, dtype=torch.int32)
    times = []
    for _ in range(steps):
        live = [i for i, m in enumerate(matchers) if not lib.done(m)]
        if not live:
            break
        t0 = time.perf_counter()
        lib.fill([matchers[i] for i in live], live, bitmask)
        if len(live) == len(matchers):  # time full batches only, not the tail of long walks
            times.append(time.perf_counter() - t0)
        for i in live:
            allowed = unpack_allowed(bitmask[i], vocab)
            logits = torch.randn(vocab, generator=gen).masked_fill(~allowed, float("-inf"))
            t = int(logits.argmax())
            lib.accept(matchers[i], t)
            tokens[i].append(t)
    return times, tokens, [lib.done(m) for m in matchers]


def validate(tok, schema, ids):
    import jsonschema

    eos = set(tok.all_special_ids)
    text = tok.decode([t for t in ids if t not in eos])
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except Exception:
        return False


def bench(lib_cls, tname, tok, vocab, args):
    rss0 = rss_mib()
    t0 = time.perf_counter()
    lib = lib_cls(tok, vocab)
    setup = time.perf_counter() - t0
    compile_s, compiled = [], {}
    first_mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()  # to the first mask: llguidance builds its lexer lazily
        compiled[name] = lib.compile(schema)
        lib.fill([lib.matcher(compiled[name])], [0], first_mask)
        compile_s.append(time.perf_counter() - t0)
    rss1 = rss_mib()
    valid = total = 0
    fill1 = []
    for w in range(args.walks):
        for name, schema in SCHEMAS.items():
            times, toks, done = walk(lib, [compiled[name]], vocab, args.steps, seed=w)
            fill1 += times
            total += 1
            valid += bool(done[0] and validate(tok, schema, toks[0]))
    names = list(SCHEMAS)
    batch = [compiled[names[i % len(names)]] for i in range(32)]
    fill32, _, _ = walk(lib, batch, vocab, args.steps, seed=99)
    logits = torch.randn(32, vocab)
    mask = torch.randint(-(2**31), 2**31 - 1, (32, (vocab + 31) // 32), dtype=torch.int32)
    lib.apply(logits.clone(), mask)  # warm-up (torch.compile for llguidance's kernel)
    t0 = time.perf_counter()
    for _ in range(20):
        lib.apply(logits.clone(), mask)
    apply_ms = (time.perf_counter() - t0) / 20 * 1e3
    from core.structured_output import apply_bitmask

    apply_bitmask(logits.clone(), mask)
    t0 = time.perf_counter()
    for _ in range(20):
        apply_bitmask(logits.clone(), mask)
    core_apply_ms = (time.perf_counter() - t0) / 20 * 1e3
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {
        "lib": lib.name, "tokenizer": tname, "setup_s": round(setup, 2),
        "compile_ms_median": round(ms(compile_s), 2), "compile_ms_max": round(max(compile_s) * 1e3, 1),
        "compile_s_total": round(sum(compile_s), 2),
        "fill_ms_b1_median": round(ms(fill1), 3), "fill_ms_b32_median": round(ms(fill32), 3),
        "apply_ms_b32": round(apply_ms, 3), "core_apply_ms_b32": round(core_apply_ms, 3), "rss_mib": round(rss1 - rss0, 1),
        "valid": f"{valid}/{total}",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--walks", type=int, default=3)
    ap.add_argument("--lib", choices=["xgrammar", "llguidance"], action="append")
    args = ap.parse_args()
    libs = [c for c in (XGrammar, LLGuidance) if not args.lib or c.name in args.lib]
    torch.set_num_threads(2)
    for tname, tok, vocab in tokenizers():
        for lib_cls in libs:
            print(json.dumps(bench(lib_cls, tname, tok, vocab, args)), flush=True)


if __name__ == "__main__":
    main()
