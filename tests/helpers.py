"""Test helpers: tiny random HF models on disk, a paged-KV driver, an in-process TP group.

* :func:`tiny_llama_dir` (and :func:`tiny_model_dir` for other architectures) writes a
  seeded random ``transformers`` model as safetensors plus a byte-level BPE tokenizer
  trained locally, so the directory loads with ``AutoTokenizer`` / ``from_pretrained`` and
  with our loader. Nothing is downloaded.
* :class:`PagedSession` runs a model step by step over a paged KV cache, building
  its metadata with :func:`core.attention.build_metadata`.
* :func:`run_ranks` runs one function per tensor-parallel rank in threads joined by
  :class:`ThreadComm`, a real (in-process) all-reduce / all-gather.
* :func:`wait_for_server` waits for a server subprocess to answer ``/health``, for as long as
  its log shows start-up advancing (a kernel build, a model load), not a fixed clock.
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from core.attention import build_metadata
from core.config import ModelConfig
from core.conformance.tiny_model import SPECIALS
from core.conformance.tiny_model import TINY_LLAMA as CONFORMANCE_TINY_LLAMA
from core.executor.distributed import Communicator
from core.model_loader import load_config, load_model
from core.models import ModelContext, ModelRegistry
from core.ops import Ops

SPECIAL_TOKENS = SPECIALS  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)

# The conformance suite's tiny Llama (same special ids, max length, 0.2 init for decisive
# logits), narrower and with a bigger vocabulary and more heads for these tests.
# The reference runs HF's plain ("eager") attention: its SDPA path drops what SDPA cannot
# express, and transformers 5.17 (the H200's) let Gemma 2 use SDPA, silently ignoring
# attn_logit_softcapping, so the "reference" there was an uncapped model (5.24 forces eager).
HF_ATTENTION = "eager"

TINY_LLAMA = {
    **CONFORMANCE_TINY_LLAMA,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

LLAMA3_ROPE = {
    # original_max_position_embeddings 64 with head_dim 16 puts some frequencies in each
    # of llama3's three bands (kept, blended, slowed by `factor`).
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


# ---- tiny models on disk ----------------------------------------------------------------------


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with exactly ``vocab_size`` tokens and a
    simple chat template (the conformance suite's builder, which vendors also use).

    Byte-level means every string encodes without unknown tokens and every id decodes.
    BOS (``<s>``, id 1) is prepended by the post-processor; EOS is ``</s>`` (id 2).
    """
    from core.conformance.tiny_model import build_tokenizer as build

    alphabet = 256
    if vocab_size < alphabet + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} < {alphabet + len(SPECIAL_TOKENS)} (bytes + specials)")
    return build(vocab_size, seed, chat_template=CHAT_TEMPLATE)


def save_tiny_model(path: Path, hf_model_cls: Any, config: Any, seed: int = 0, max_shard_size=None) -> Path:
    """Save a seeded random ``hf_model_cls(config)`` (safetensors) and a matching tokenizer.

    1-D parameters (biases, norm scales) are perturbed so that loading them wrongly shows.
    """
    torch.manual_seed(seed)
    model = hf_model_cls(config).eval()
    with torch.no_grad():  # HF starts biases at 0 and norm scales at 1: make them informative
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    build_tokenizer(config.vocab_size, seed).save_pretrained(path)
    return path


def tiny_llama_dir(tmp_path: Path, name: str = "tiny-llama", seed: int = 0, max_shard_size=None, **overrides) -> Path:
    """Write a tiny random Llama (see ``TINY_LLAMA``; keyword arguments override config
    fields) with its tokenizer to ``tmp_path / name`` and return the directory."""
    return tiny_model_dir(tmp_path, "llama", name, seed, max_shard_size, **overrides)


# family -> (transformers config class, model class, tiny config fields)
TINY_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", TINY_LLAMA),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**TINY_LLAMA, "sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", TINY_LLAMA),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**TINY_LLAMA, "head_dim": 16}),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=512,
            bos_token_id=1, eos_token_id=2, initializer_range=0.2,
        ),
    ),
}


def tiny_model_dir(
    tmp_path: Path, family: str, name: str | None = None, seed: int = 0, max_shard_size=None, **overrides
) -> Path:
    """Like :func:`tiny_llama_dir` for any family in ``TINY_FAMILIES``."""
    import transformers

    config_cls, model_cls, fields = TINY_FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**fields, **overrides})
    path = tmp_path / (name or f"tiny-{family}")
    return save_tiny_model(path, getattr(transformers, model_cls), config, seed, max_shard_size)


def model_config_for(path: str | Path, load_format: str = "auto", dtype: str = "float32", seed: int = 0) -> ModelConfig:
    """The ModelConfig the engine would build for ``path`` (fp32 by default)."""
    arch, hf_config, gguf_file, tok_path = load_config(str(path))
    return ModelConfig(
        model=str(path),
        tokenizer=tok_path,
        architecture=arch,
        hf_config=hf_config,
        dtype=dtype,
        load_format=load_format,
        seed=seed,
        gguf_file=gguf_file,
    )


def cpu_context(block_size: int = 4, comm: Communicator | None = None, dtype=torch.float32) -> ModelContext:
    """A ModelContext on the CPU platform's attention backend and the default ops."""
    from platforms.cpu.attention import CpuAttentionBackend

    extra = {"comm": comm} if comm is not None else {}
    return ModelContext(
        dtype=dtype,
        device=torch.device("cpu"),
        block_size=block_size,
        ops=Ops(),
        make_attention=CpuAttentionBackend,
        **extra,
    )


def load_tiny(path: str | Path, block_size: int = 4, comm: Communicator | None = None, **kw):
    """Our model for ``path`` loaded on CPU (fp32)."""
    return load_model(model_config_for(path, **kw), cpu_context(block_size, comm), ModelRegistry())


# ---- driving a model over a paged KV cache -------------------------------------------------------


class PagedSession:
    """Runs steps of a model over a paged KV cache with shuffled, non-contiguous blocks.

    ``step(prefills, decodes)`` takes ``{seq_id: new token ids}`` chunks (a prefill chunk may
    continue an already cached context; a decode is exactly one token) and returns, per
    chunk in order, the logits [num_new, vocab] of its new tokens.
    """

    def __init__(self, model, block_size: int = 4, num_blocks: int = 128, seed: int = 0):
        from platforms.cpu.attention import CpuAttentionBackend

        self.model = model
        self.block_size = block_size
        self.caches = [
            CpuAttentionBackend(spec).allocate_kv_cache(num_blocks, "cpu")
            for spec in model.attention_specs()
        ]
        self.free = list(range(1, num_blocks))  # block 0 stays the null block
        random.Random(seed).shuffle(self.free)
        self.tables: dict[Any, list[int]] = {}
        self.lens: dict[Any, int] = {}

    def _slots(self, seq: Any, n_new: int) -> list[int]:
        table, start = self.tables.setdefault(seq, []), self.lens.get(seq, 0)
        slots = []
        for pos in range(start, start + n_new):
            if pos // self.block_size >= len(table):
                table.append(self.free.pop())
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
        return slots

    def step(self, prefills: list[tuple[Any, list[int]]], decodes: list[tuple[Any, int]] = ()) -> list[torch.Tensor]:
        chunks = list(prefills) + [(s, [t]) for s, t in decodes]
        ids, positions, slots, ctx_lens, q_lens = [], [], [], [], []
        for seq, toks in chunks:
            ctx = self.lens.get(seq, 0)
            slots += self._slots(seq, len(toks))
            ids += toks
            positions += range(ctx, ctx + len(toks))
            ctx_lens.append(ctx)
            q_lens.append(len(toks))
            self.lens[seq] = ctx + len(toks)
        tables = [self.tables[s] for s, _ in chunks]
        md = build_metadata(q_lens, ctx_lens, tables, self.block_size, num_prefills=len(prefills),
                            slot_mapping=slots)
        starts = md.query_start_loc.tolist()
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.caches, md)
            logits = self.model.compute_logits(hidden)
        return [logits[starts[i] : starts[i + 1]] for i in range(len(chunks))]


def run_schedule(model, vocab: int, decode_steps: int = 4, seed: int = 0, lengths=(11, 3, 17)):
    """Drive ``model`` through a mixed schedule over a paged cache (block size 4).

    Step 1 prefills a and b and the first 9 tokens of c (a chunk); step 2 prefills the rest of
    c over its cached context while a and b decode; then all three decode ``decode_steps``
    times (random next tokens). Returns ``{seq: (all token ids, logits [len, vocab])}``: a
    logits row for every token fed, comparable with one full-sequence forward of a reference.
    """
    rng = random.Random(seed)
    a, b, c = ([rng.randrange(3, vocab) for _ in range(n)] for n in lengths)
    session = PagedSession(model, block_size=4)
    seqs = {"a": list(a), "b": list(b), "c": list(c)}
    rows: dict[str, list[torch.Tensor]] = {s: [] for s in seqs}
    for s, out in zip("abc", session.step([("a", a), ("b", b), ("c", c[:9])])):
        rows[s].append(out)
    nxt = {s: rng.randrange(3, vocab) for s in "ab"}
    out = session.step([("c", c[9:])], list(nxt.items()))
    rows["c"].append(out[0])
    for (s, t), o in zip(nxt.items(), out[1:]):
        seqs[s].append(t)
        rows[s].append(o)
    for _ in range(decode_steps):
        nxt = {s: rng.randrange(3, vocab) for s in seqs}
        for (s, t), o in zip(nxt.items(), session.step([], list(nxt.items()))):
            seqs[s].append(t)
            rows[s].append(o)
    return {s: (seqs[s], torch.cat(rows[s])) for s in seqs}


def hf_logits(path, sequences: dict[Any, list[int]]) -> dict[Any, torch.Tensor]:
    """HF transformers' logits [len, vocab] for each full sequence (fp32, one at a time)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=HF_ATTENTION).eval()
    with torch.no_grad():
        return {s: hf(torch.tensor([ids])).logits[0] for s, ids in sequences.items()}


# ---- in-process tensor parallelism ---------------------------------------------------------------


class _Exchange:
    def __init__(self, world_size: int):
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * world_size

    def share(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read them
        return parts


class ThreadComm(Communicator):
    """A communicator for ranks that are threads of one process (tests only)."""

    def __init__(self, exchange: _Exchange, rank: int, world_size: int):
        self.exchange, self.rank, self.world_size = exchange, rank, world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.exchange.share(self.rank, x)
        total = parts[0].clone()
        for p in parts[1:]:  # same order on every rank: identical results everywhere
            total += p
        return x.copy_(total)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self.exchange.share(self.rank, x), dim=dim)


def run_ranks(world_size: int, fn: Callable[[Communicator], Any]) -> list[Any]:
    """Run ``fn(comm)`` once per rank, each in its own thread; return results by rank."""
    exchange = _Exchange(world_size)
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(ThreadComm(exchange, rank, world_size))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
            exchange.barrier.abort()  # release ranks waiting on a collective

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:  # the first real failure, not the broken barriers it caused elsewhere
        errors.sort(key=lambda e: isinstance(e, threading.BrokenBarrierError))
        raise errors[0]
    return results


# ---- servers under test ----------------------------------------------------------------------

SERVER_STALL_S = 300.0
"""A starting server whose log has not grown for this long is stuck. The kernel build logs
every 15 s (platforms/jit_build.py); the longest silent step, importing torch and loading a
model on a busy 2-core machine, takes well under a minute."""
SERVER_BOUND_S = 2400.0
"""The overall bound: a first-run kernel build under heavy load plus the model load."""


def wait_for_server(proc: subprocess.Popen, url: str, log: Path, stall_s: float = SERVER_STALL_S,
                    bound_s: float = SERVER_BOUND_S, poll_s: float = 0.25) -> float:
    """Wait until ``GET {url}/health`` answers 200; return the seconds it took.

    Keeps waiting while ``log`` (the server's stdout and stderr) grows, so a server busy
    building kernels or loading a model on a loaded machine is given the time it needs; fails
    (killing the server, showing its log) when it exits, when its log stalls for ``stall_s``,
    or after ``bound_s`` in all.
    """
    import httpx
    import pytest

    start = last_growth = time.monotonic()
    size = -1
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{_tail(log)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        now = time.monotonic()
        new_size = log.stat().st_size if log.exists() else 0
        if new_size != size:
            size, last_growth = new_size, now
        why = (f"its log stalled for {stall_s:.0f} s" if now - last_growth > stall_s
               else f"not ready after {bound_s:.0f} s" if now - start > bound_s else None)
        if why:
            proc.kill()
            proc.wait()
            pytest.fail(f"server not ready: {why} (started {now - start:.0f} s ago):\n{_tail(log)}")
        time.sleep(poll_s)


def _tail(log: Path, n: int = 60) -> str:
    if not log.exists():
        return "(no log)"
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
