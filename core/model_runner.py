"""Turns a schedule into tensors, runs the model, and samples.

The runner owns the model, the KV caches (device, plus a host pool for swapping) and the
sampler. It is the only place where the schedule meets the device.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from core.attention import AttentionBackend, AttentionMetadata, AttentionSpec, build_metadata
from core.attention_sites import AttentionSite
from core.config import EngineConfig
from core.executor.distributed import Communicator, SingleRank
from core.input_batch import PersistentBatch, StepInputs
from core.model_loader import load_model
from core.models import ModelContext, ModelRegistry
from core.ops import Ops
from core.outputs import Logprob
from core.platform import Capability, DecodeGraphRunner, DecodeGraphSpec, Platform
from core.pooling import PoolingState
from core.quantization.kv_cache import KVCacheFormat, describe_kv_dtype, kv_cache_format
from core.quantization.linear import linear_method_for
from core.sampler import Sampler, Staging, prompt_logprobs
from core.sampler.padding import pad_sampled_rows
from core.sampling_params import SamplingParams
from core.scheduler import ScheduledSequence, SchedulerOutput
from core.step_handle import (
    DoneStep,
    HostCopy,
    ModelRunnerOutput,
    PendingStep,
    SampledToken,
    StepHandle,
    device_event_factory,
)

__all__ = ["ModelRunner", "ModelRunnerOutput", "RunnerSetup", "SampledToken", "StepHandle"]

logger = logging.getLogger(__name__)

MAX_MIXED_GRAPH_TOKENS = 512
"""Steps with prefills of at most this many tokens may replay from graphs (where the
platform's graph strategy replays them): above it a step is compute-bound and graphs gain
little for the static buffers each token bucket keeps."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass(frozen=True)
class RunnerSetup:
    """The pieces a runner is built from (chosen by the engine/executor)."""

    config: EngineConfig
    platform: Platform
    ops: Ops
    registry: ModelRegistry
    attention_backend_cls: type[AttentionBackend] | None = None
    """A plugin-provided backend class, or None for the platform's choice."""
    comm: Communicator = SingleRank()
    device_index: int = 0
    stage: Any = None
    """Pipeline parallelism: this rank's :class:`core.executor.pipeline.PipelineStage`
    (its layers and its links to the neighbouring stages); None: the whole model."""


class ModelRunner:
    def __init__(self, setup: RunnerSetup, eos_token_ids: frozenset[int]):
        self.setup = setup
        self.config = setup.config
        self.platform = setup.platform
        self.device = setup.platform.device(setup.device_index)
        self.dtype = torch_dtype(self.config.model.dtype)
        self.block_size = self.config.cache.block_size
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.host_caches: list[torch.Tensor] = []
        self._backends: list[AttentionBackend] = []
        self._sites: list[AttentionSite] = []
        self._kv_format = KVCacheFormat()  # set by load_model (--kv-cache-dtype, KV scales)
        self.graphs: DecodeGraphRunner | None = None
        self.graph_capture_s = 0.0
        """Seconds :meth:`allocate_kv_cache` spent capturing decode graphs."""
        caps = self.platform.capabilities
        # Page-locked staging only pays where the device has memory of its own.
        self.pin_host = Capability.PINNED_HOST_MEMORY in caps and Capability.DEVICE_MEMORY in caps
        # Penalties from a per-sequence device state where the device has memory of its own
        # (no host history per step); the CPU keeps the host-built path, faster there
        # (docs/benchmarks/sampler.md).
        self.sampler = Sampler(
            eos_token_ids, staging=Staging(pinned=self.pin_host), kernel=setup.ops.sampling_kernel,
            penalty_state=self.pin_host,
        )
        self.pooling = PoolingState()
        # Sampled ids come back through pinned memory and an event where the device has
        # both; elsewhere the read-back is a plain copy in result().
        self._make_event = device_event_factory(self.device) if self.pin_host else None
        self.batch = PersistentBatch(
            max_rows=self.config.scheduler.max_num_seqs,
            max_blocks=-(-self.config.model.max_model_len // self.block_size),
            block_size=self.block_size,
            device=self.device,
            pin=self.pin_host,
            shaper=self.platform.batch_shaper(self.block_size),
        )

    # ---- setup --------------------------------------------------------------------------
    def _make_attention(self, spec: AttentionSpec) -> AttentionBackend | AttentionSite:
        spec = self._kv_format.spec_for(spec, len(self._backends))
        cls = self.setup.attention_backend_cls or self.platform.attention_backend_class(
            spec, self.config.attention_backend
        )
        backend = cls(spec)
        self._backends.append(backend)
        if not self._may_use_graphs():
            return backend
        # A seam a graph strategy can split its graphs at (steps with prefills).
        site = AttentionSite(backend)
        self._sites.append(site)
        return site

    def _may_use_graphs(self) -> bool:
        # Collectives inside captured graphs are not part of the communicator contract, so
        # tensor-parallel ranks run eagerly.
        return (
            not self.config.enforce_eager
            and Capability.GRAPH_CAPTURE in self.platform.capabilities
            and self.setup.comm.world_size == 1
            and self.setup.stage is None  # pipeline stages run eagerly too
        )

    def load_model(self) -> int:
        """Load weights onto the device; returns the bytes the weights occupy."""
        self._kv_format = kv_cache_format(self.config.model, self.config.cache.cache_dtype)
        ctx = ModelContext(
            dtype=self.dtype,
            device=self.device,
            block_size=self.block_size,
            ops=self.setup.ops,
            make_attention=self._make_attention,
            comm=self.setup.comm,
            weight_format=self.config.model.weight_format,
            linear_method=linear_method_for(self.platform, self.config.model, self.dtype),
            graph_capture=self._may_use_graphs(),
            stage=self.setup.stage.layers if self.setup.stage is not None else None,
        )
        self.model = load_model(self.config.model, ctx, self.setup.registry)
        self._kv_format.check_layers(len(self._backends))
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) + sum(
            b.numel() * b.element_size() for b in self.model.buffers()
        )

    def kv_bytes_per_block(self) -> int:
        """Bytes one block of every layer's cache takes (keys and values)."""
        total = 0
        for spec in (b.spec for b in self._backends):  # the specs the caches are made from
            total += 2 * spec.num_kv_heads * spec.head_size * self.block_size * spec.cache_dtype.itemsize
        return total

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        """Allocate the caches, then (where the platform captures graphs, and not under
        ``enforce_eager``) set up decode-step graphs over them and capture one for every
        batch size now: a capture on first use stalls every running request for its length
        (tens of ms on an 8B model), which a server shows as TTFT and TPOT outliers."""
        self.kv_caches = [b.allocate_kv_cache(num_blocks, self.device) for b in self._backends]
        if self._kv_format.dtype is not None:
            logger.info(describe_kv_dtype([b.spec for b in self._backends], num_blocks, self.block_size))
        self.host_caches = [
            b.allocate_kv_cache(num_host_blocks, "cpu", pin_memory=self.pin_host)
            for b in self._backends
            if num_host_blocks > 0
        ]
        self.graphs = self._make_graph_runner()
        if self.graphs is not None:
            self.graph_capture_s = self.graphs.capture_all()
            if self.graph_capture_s:
                logger.info("captured the decode graphs in %.2f s", self.graph_capture_s)

    def _make_graph_runner(self) -> DecodeGraphRunner | None:
        graphs = self._may_use_graphs()
        if not graphs and not self._may_fuse_decode():
            return None
        spec = DecodeGraphSpec(
            max_batch_size=self.config.scheduler.max_num_seqs,
            max_model_len=self.config.model.max_model_len,
            block_size=self.block_size,
            attention_sites=tuple(self._sites),
            max_mixed_tokens=min(MAX_MIXED_GRAPH_TOKENS,
                                 self.config.scheduler.max_num_batched_tokens) if graphs else 0,
        )
        return self.platform.decode_graph_runner(self.model, self.kv_caches, spec)

    def _may_fuse_decode(self) -> bool:
        # A platform's own fused decode forward (Capability.FUSED_DECODE) replaces the module
        # calls of one rank's model; --enforce-eager keeps the modules.
        return (
            not self.config.enforce_eager
            and Capability.FUSED_DECODE in self.platform.capabilities
            and self.setup.comm.world_size == 1
        )

    def profile_run(self) -> int | None:
        with self.platform.inference_context():
            return self._profile_run()

    def _profile_run(self) -> int | None:
        """Peak device bytes (weights + activations) of the largest step, measured before
        the KV cache exists: one forward over ``max_num_batched_tokens`` prompt tokens
        (padding slots, so no cache is written) and a sampler pass over ``max_num_seqs``
        rows. None when the platform cannot measure (see Platform.peak_memory_bytes)."""
        platform = self.platform
        platform.reset_peak_memory()
        if platform.peak_memory_bytes() is None:
            return None
        sched_cfg = self.config.scheduler
        tokens = sched_cfg.max_num_batched_tokens
        chunk = min(tokens, self.config.model.max_model_len)
        lens = [chunk] * (tokens // chunk) + ([tokens % chunk] if tokens % chunk else [])
        caches = [b.allocate_kv_cache(1, self.device) for b in self._backends]
        md = _profile_metadata(lens, self.block_size, self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        input_ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        if self.setup.stage is not None:  # pipeline parallelism (core/executor/pipeline.py)
            hidden = self.setup.stage.profile_forward(self.model, input_ids, positions, caches, md)
            if hidden is None:  # not the last stage: no logits, no sampler
                return _profile_done(platform, caches)
        else:
            hidden = self.model(input_ids, positions, caches, md)
        rows = sched_cfg.max_num_seqs
        logits = self.model.compute_logits(hidden[:1].expand(rows, -1))
        params = SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, seed=None)
        self.sampler(logits, [_profile_row(i, params) for i in range(rows)])
        platform.synchronize()
        peak = platform.peak_memory_bytes()
        del hidden, logits, caches
        platform.empty_cache()
        return peak

    # ---- one step -----------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its output: ``launch(sched).result()``."""
        return self.launch(sched).result()

    def launch(self, sched: SchedulerOutput) -> StepHandle:
        """Queue one step (block moves, forward, sampling) and start copying its sampled ids
        to the host; the handle's ``result()`` waits for that copy only.

        A decode row whose token is ``core.input_batch.PLACEHOLDER_TOKEN`` (-1) is fed the
        token this runner sampled for it in the previous step, without a host round trip
        (asynchronous scheduling); see :mod:`core.input_batch`. Steps that ask for top or
        prompt logprobs read those back here (their handle is already done)."""
        with self.platform.inference_context():
            return self._launch(sched)

    def _launch(self, sched: SchedulerOutput) -> StepHandle:
        self._move_blocks(sched)
        self.sampler.begin_step((s.seq_id for s in sched.scheduled), sched.preempted)
        if not sched.scheduled:
            return DoneStep(ModelRunnerOutput({}, {}))
        step = self._prepare(sched)
        input_ids, positions, md = step.input_ids, step.positions, step.metadata
        if self.setup.stage is not None:  # pipeline parallelism (core/executor/pipeline.py)
            hidden = self.setup.stage.forward(self.model, input_ids, positions, self.kv_caches, md)
            if hidden is None:  # not the last stage: its activations went to the next one
                return DoneStep(ModelRunnerOutput({}, {}))
        elif self.graphs is not None and self.graphs.can_run(md):
            hidden = self.graphs.run(input_ids, positions, md)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, md)
        self.platform.step_boundary()
        return self._sample(sched, hidden, step.rows)

    def _move_blocks(self, sched: SchedulerOutput) -> None:
        backend = self._backends[0] if self._backends else None
        if backend is None:
            return
        if sched.blocks_to_swap_out:
            pairs = torch.tensor(sched.blocks_to_swap_out, dtype=torch.int64)
            for dev, host in zip(self.kv_caches, self.host_caches):
                backend.swap_blocks(dev, host, pairs)
        if sched.blocks_to_swap_in:
            pairs = torch.tensor(sched.blocks_to_swap_in, dtype=torch.int64)
            for dev, host in zip(self.kv_caches, self.host_caches):
                backend.swap_blocks(host, dev, pairs)
        if sched.blocks_to_copy:
            pairs = torch.tensor(sched.blocks_to_copy, dtype=torch.int64, device=self.device)
            backend.copy_blocks(self.kv_caches, pairs)

    def prepare_inputs(
        self, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata of a step (see core.input_batch)."""
        step = self._prepare(sched)
        return step.input_ids, step.positions, step.metadata

    def _prepare(self, sched: SchedulerOutput) -> StepInputs:
        return self.batch.prepare(sched.scheduled, sched.num_prefills, sched.preempted)

    def _sample(
        self, sched: SchedulerOutput, hidden: torch.Tensor, batch_rows: tuple[int, ...]
    ) -> StepHandle:
        # Row offsets from the host-side schedule: reading md.query_start_loc back would
        # make the host wait for the whole forward before it can queue the LM head.
        qsl = [0, *itertools.accumulate(len(s.token_ids) for s in sched.scheduled)]
        rows, scheduled, special = [], [], []
        for i, s in enumerate(sched.scheduled):  # one pass: this runs per row per step
            if s.sample:
                rows.append(i)
                scheduled.append(s)
            if s.params.prompt_logprobs is not None or s.params.pooling is not None:
                special.append(i)
        prompt_lp = self._prompt_logprobs(sched, hidden, qsl, special)
        pooled = self._pool(sched, hidden, qsl, special)
        if not rows:
            return DoneStep(ModelRunnerOutput({}, prompt_lp, pooled))
        # Static-shape devices: the LM head and sampler run on a bucketed number of rows.
        size = self.batch.shaper.pad_sampled(len(rows)) if self.batch.shaper is not None else len(rows)
        padded = pad_sampled_rows(scheduled, [qsl[i + 1] - 1 for i in rows], [batch_rows[i] for i in rows], size)
        last = self.sampler.staging(padded.hidden_rows, torch.int64, hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, last))
        if self.setup.comm.rank != 0:
            return DoneStep(ModelRunnerOutput({}, {}))
        mask = None
        if sched.grammar is not None:
            mask = sched.grammar.for_rows([s.seq_id for s in scheduled], self.setup.ops.grammar_bitmask)
        drawn = self.sampler.draw(logits, padded.rows, bitmask=mask)
        # The next step's placeholder tokens read these without a host round trip.
        self.batch.record_sampled(padded.batch_rows, padded.recorded(drawn.token_ids, self.sampler.staging))
        if any(s.params.logprobs is not None for s in scheduled):
            # Top logprobs are built on the host from a read-back: this step waits now.
            out = self.sampler.finish(padded.rows, drawn)
            sampled = {
                s.seq_id: SampledToken(out.token_ids[j], out.logprobs[j], out.top_logprobs[j])
                for j, s in enumerate(scheduled)
            }
            return DoneStep(ModelRunnerOutput(sampled, prompt_lp, pooled))
        copy = HostCopy(drawn.token_ids, drawn.logprobs, self.pin_host, self._make_event,
                        self.platform.synchronize)
        return PendingStep([s.seq_id for s in scheduled], copy, prompt_lp, pooled)

    def _pool(
        self, sched: SchedulerOutput, hidden: torch.Tensor, qsl: list[int], candidates: list[int]
    ) -> dict[int, tuple[float, ...]]:
        """Pooled vectors of the embedding requests whose prompt ends this step (see
        core/pooling.py); ``candidates``: the indices of the rows that may be one."""
        self.pooling.begin_step()
        result: dict[int, tuple[float, ...]] = {}
        for i in candidates:
            s = sched.scheduled[i]
            if s.params.pooling is None:
                continue
            vec = self.pooling.add_chunk(s.seq_id, s.start_pos, hidden[qsl[i]:qsl[i + 1]], s.params.pooling, s.sample)
            if vec is not None and self.setup.comm.rank == 0:
                result[s.seq_id] = vec if isinstance(vec, tuple) else tuple(vec.tolist())
        return result

    def _prompt_logprobs(
        self, sched: SchedulerOutput, hidden: torch.Tensor, qsl: list[int], candidates: list[int]
    ) -> dict[int, list[dict[int, Logprob]]]:
        """Prompt logprobs of the rows that asked for them (``candidates``: the indices of
        the rows that may have)."""
        result: dict[int, list[dict[int, Logprob]]] = {}
        for i in candidates:
            s = sched.scheduled[i]
            if s.params.prompt_logprobs is None or not s.prompt_token_ids:
                continue
            nxt = _next_prompt_tokens(s)
            if not nxt:
                continue
            h = hidden[qsl[i] : qsl[i] + len(nxt)]
            logits = self.model.compute_logits(h)
            if self.setup.comm.rank == 0:
                ids = torch.tensor(nxt, device=logits.device)
                result[s.seq_id] = prompt_logprobs(logits, ids, s.params.prompt_logprobs)
        return result


def _next_prompt_tokens(s: ScheduledSequence) -> list[int]:
    """Prompt tokens that follow each computed position of this chunk (within the prompt)."""
    p = len(s.prompt_token_ids)
    first = s.start_pos + 1
    last = min(s.start_pos + len(s.token_ids), p - 1)
    return list(s.prompt_token_ids[first : last + 1]) if first <= last else []


def _profile_done(platform: Platform, caches: list[torch.Tensor]) -> int | None:
    """The peak of a profile that stops before the logits (a pipeline stage but the last)."""
    platform.synchronize()
    peak = platform.peak_memory_bytes()
    del caches[:]
    platform.empty_cache()
    return peak


def _profile_metadata(lens: list[int], block_size: int, device: torch.device) -> AttentionMetadata:
    """Fresh prompts of ``lens`` tokens whose slots are all padding (-1): attention runs,
    nothing is written to the (one-block) caches, and every block table entry is block 0."""
    tables = [[0] * -(-max(lens) // block_size)] * len(lens)
    return build_metadata(lens, [0] * len(lens), tables, block_size, num_prefills=len(lens),
                          device=device, slot_mapping=[-1] * sum(lens))


def _profile_row(i: int, params: SamplingParams) -> ScheduledSequence:
    return ScheduledSequence(
        seq_id=i, request_id="profile", token_ids=(0,), start_pos=0, block_table=(),
        sample=True, params=params, output_index=0,
    )
