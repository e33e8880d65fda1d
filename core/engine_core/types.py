"""What crosses between the engine core and a front end: requests in, token deltas out.

Every type here is a ``msgspec.Struct`` (or holds only builtins, dataclasses and Structs), so
the same objects are returned in-process and sent over ZeroMQ as MessagePack without
pickling. Invariants:

- the engine core sees token ids only; text (prompts, detokenization, stop strings) stays in
  the front end;
- a :class:`RequestDelta` holds what one step added; the front end accumulates them;
- after a delta with ``finished`` the engine core has forgotten the request and freed its
  blocks; later commands for it are ignored.
"""

from __future__ import annotations

import msgspec

from core.outputs import Logprob
from core.sampling_params import SamplingParams


class EngineRequest(msgspec.Struct, frozen=True, array_like=True):
    """A request as the engine core takes it: already tokenized and validated."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    """max_tokens is already capped to what fits max_model_len."""
    priority: int = 0
    arrival_time: float = 0.0
    """``time.monotonic()`` at arrival (CLOCK_MONOTONIC: comparable across processes)."""


class SampleDelta(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One sample's token from one step."""

    index: int
    """Which of the request's n samples."""
    token_id: int
    logprob: float
    """Log-probability of ``token_id`` under the sampling distribution."""
    top_logprobs: dict[int, Logprob] | None = None
    """When SamplingParams.logprobs is set: the top-k plus the chosen token."""
    finish_reason: str | None = None
    """'stop' (EOS or a stop token id: ``token_id`` is that token) or 'length'
    (max_tokens or max_model_len reached); None while the sample runs."""
    stop_reason: int | None = None
    """The stop token id that finished the sample (None for EOS or length)."""


class RequestDelta(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What one step did for one request."""

    request_id: str
    samples: tuple[SampleDelta, ...] = ()
    """New tokens, at most one per sample per step."""
    finished: bool = False
    """Every sample has finished in the engine core; the request is forgotten there."""
    first_scheduled: float | None = None
    """On the delta of the step that computed the request's first tokens: when the engine
    core scheduled that step (``time.monotonic()``, CLOCK_MONOTONIC: comparable across
    processes); None on every other delta."""
    prompt_logprobs: tuple[int, tuple[dict[int, Logprob], ...]] | None = None
    """(first prompt position, entries): prompt logprobs computed this step; entry k
    belongs to prompt token ``first + k``."""
    abort_reason: str | None = None
    """Set when the engine core gave up on the request (it can no longer fit the cache);
    every unfinished sample ends with finish_reason 'abort'."""
    pooled: tuple[float, ...] | None = None
    """A pooling request's vector, on the delta of the step that finished its prompt."""
    received: float | None = None
    """With ``first_scheduled``: when the engine core took the request (``time.monotonic()``):
    arrival -> received is the front end's tokenization and the IPC, received ->
    first_scheduled the wait in the engine core."""


class EngineInfo(msgspec.Struct, frozen=True):
    """What a front end needs to know about the engine core it talks to."""

    model: str
    """The model path as given (or the default model's)."""
    tokenizer: str
    gguf_file: str | None
    cache_dir: str | None
    architecture: str
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    num_blocks: int
    """Usable KV blocks (the null block excluded)."""
    block_size: int
    disable_log_stats: bool
    pid: int
    """The engine core's process id."""
