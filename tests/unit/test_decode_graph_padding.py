"""Decode-graph bucketing and padding (platforms/cuda/graphs.py), checked on CPU.

The CUDA-graph mechanics need a GPU (tests/cuda/test_cuda_engine_graphs.py); everything
around them does not: the buckets, the static input buffers and their padding rows, and the
runner's dispatch of decode-only steps. Here a platform that declares graph capture gets a
:class:`CudaDecodeGraphs` whose "graph" replays the model eagerly over the same static,
padded buffers, so the engine's greedy tokens must equal the plain eager run.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from core.attention import AttentionMetadata, build_metadata
from core.engine import LLMEngine, resolve_config
from core.engine_args import EngineArgs
from core.platform import Capability, DecodeGraphSpec
from core.plugins import Plugins
from core.sampling_params import SamplingParams
from platforms.cpu.platform import CpuPlatform
from platforms.cuda.graphs import CudaDecodeGraphs, StaticDecodeInputs, bucket_for, decode_buckets


def test_buckets_cover_every_batch_size_with_little_padding():
    buckets = decode_buckets(256)
    assert buckets[:5] == (1, 2, 4, 8, 16) and buckets[-1] == 256
    assert all(b % 8 == 0 for b in buckets[3:])
    for n in range(1, 257):
        b = bucket_for(n, buckets)
        assert b >= n and (b - n < 8) and (n > 4 or b < 2 * n)
    assert decode_buckets(3) == (1, 2, 4)
    assert decode_buckets(100)[-1] == 104
    with pytest.raises(ValueError, match="no graph bucket"):
        bucket_for(257, buckets)
    with pytest.raises(ValueError, match="at least 1"):
        decode_buckets(0)


def _decode_md(seq_lens: list[int], width: int, gen: torch.Generator) -> AttentionMetadata:
    tables = torch.randint(1, 50, (len(seq_lens), width), generator=gen, dtype=torch.int32)
    return build_metadata([1] * len(seq_lens), [n - 1 for n in seq_lens], tables.numpy(), 16,
                          num_prefills=0, slot_mapping=torch.randint(0, 1000, (len(seq_lens),), generator=gen))


def test_static_inputs_hold_the_step_then_padding_even_after_a_larger_step():
    gen = torch.Generator().manual_seed(0)
    inputs = StaticDecodeInputs(max_rows=16, max_blocks=8, device="cpu")
    big = _decode_md([30] * 16, 8, gen)
    inputs.load(torch.randint(0, 99, (16,), generator=gen), torch.full((16,), 29), big, 16)
    md = _decode_md([5, 17, 33], 3, gen)
    ids, pos = torch.tensor([7, 8, 9]), torch.tensor([4, 16, 32])
    inputs.load(ids, pos, md, rows=4)
    got = inputs.metadata(4, max_seq_len=128)
    assert got.num_decode_tokens == 4 and got.num_prefills == 0 and got.max_seq_len == 128
    assert got.slot_mapping.tolist() == md.slot_mapping.tolist() + [-1]
    assert got.seq_lens.tolist() == [5, 17, 33, 1]
    assert got.context_lens.tolist() == [4, 16, 32, 0]
    assert got.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(got.block_tables[:3, :3], md.block_tables)
    assert got.block_tables[3, 0] == 0  # the padding row reads the null block
    assert inputs.input_ids[:3].tolist() == [7, 8, 9] and inputs.positions[:3].tolist() == [4, 16, 32]


class _EagerReplay:
    """Stands in for a CUDA graph: replays the model eagerly over the static buffers."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


class _PaddedEagerGraphs(CudaDecodeGraphs):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.replays: list[tuple[int, int]] = []  # (real rows, bucket)

    def run(self, input_ids, positions, metadata):
        n = metadata.num_decode_tokens
        self.replays.append((n, bucket_for(n, self.buckets)))
        return super().run(input_ids, positions, metadata)

    def _capture(self, rows):
        ids, pos = self._inputs.input_ids[:rows], self._inputs.positions[:rows]
        md = self._inputs.metadata(rows, self._max_seq_len)
        out = torch.empty(0)

        def replay():
            nonlocal out
            out = self._model(ids, pos, self._caches, md)
            entry[1].resize_(out.shape).copy_(out)

        entry = (_EagerReplay(replay), torch.empty(0))
        self._graphs[rows] = entry
        return entry


class _GraphCpuPlatform(CpuPlatform):
    capabilities = CpuPlatform.capabilities | {Capability.GRAPH_CAPTURE}

    def decode_graph_runner(self, model, kv_caches, spec):
        # Decode graphs only: piecewise capture of steps with prefills needs a GPU
        # (tests/cuda/test_cuda_mixed_graphs.py).
        assert len(spec.attention_sites) == len(kv_caches) and spec.max_mixed_tokens > 0
        spec = dataclasses.replace(spec, attention_sites=())
        self.runner = _PaddedEagerGraphs(model, kv_caches, spec)
        return self.runner


def _greedy(engine: LLMEngine, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    ids = [engine.add_request(None, p, sp) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[i] for i in ids]


def _engine(path, platform, **kw) -> LLMEngine:
    args = EngineArgs(model=str(path), dtype="float32", block_size=16, max_num_seqs=6, **kw)
    return LLMEngine(resolve_config(args, platform), platform, Plugins())


def test_padded_decode_steps_give_the_eager_tokens(tiny_llama):
    path = tiny_llama(seed=3)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 40))] for _ in range(5)]
    eager = _greedy(_engine(path, CpuPlatform()), prompts, 10)
    platform = _GraphCpuPlatform()
    padded = _greedy(_engine(path, platform), prompts, 10)
    assert padded == eager
    replays = platform.runner.replays
    assert replays and any(b > n for n, b in replays)  # padding rows really took part
    assert _engine(path, _GraphCpuPlatform(), enforce_eager=True).executor.runner.graphs is None


def test_prefill_steps_replay_only_piecewise(tiny_llama):
    platform = _GraphCpuPlatform()
    engine = _engine(tiny_llama(seed=5), platform)
    runner = engine.executor.runner
    md = dataclasses.replace(
        _decode_md([4, 9], 1, torch.Generator().manual_seed(1)), num_prefills=1,
        num_prefill_tokens=3, num_decode_tokens=1,
    )
    assert not runner.graphs.can_run(md)  # decode graphs alone (the sites were left out)
    spec = DecodeGraphSpec(max_batch_size=6, max_model_len=128, block_size=16,
                           attention_sites=tuple(runner._sites), max_mixed_tokens=32)
    graphs = CudaDecodeGraphs(runner.model, runner.kv_caches, spec)
    assert graphs.mixed.buckets == (16, 32)
    assert graphs.can_run(md)
    assert not graphs.can_run(dataclasses.replace(md, num_prefill_tokens=40))


def test_token_buckets_for_steps_with_prefills():
    from platforms.cuda.piecewise import token_buckets

    assert token_buckets(512) == (16, 32, 64, 128, 256, 512)
    assert token_buckets(300)[-1] == 512 and token_buckets(7) == (16,)
    with pytest.raises(ValueError, match="at least 1"):
        token_buckets(0)


def test_an_attention_site_forwards_unless_split(tiny_llama):
    """Where graphs may run, each layer's attention reaches the model through a site; with no
    split hook it is the backend's call, with one the hook sees every layer's call once."""
    from core.attention_sites import AttentionSite

    platform = _GraphCpuPlatform()
    path = tiny_llama(seed=6)
    engine = _engine(path, platform)
    runner = engine.executor.runner
    sites = runner._sites
    assert sites and all(isinstance(s, AttentionSite) for s in sites)
    assert [s.backend for s in sites] == runner._backends
    assert sites[0].spec == runner._backends[0].spec  # other attributes are the backend's
    want = _greedy(engine, [[5, 6, 7, 8]], 4)
    seen = []

    def hook(site, q, k, v, cache, md):
        seen.append(site)
        return site.backend.forward(q, k, v, cache, md)

    for s in sites:
        s.split = hook
    assert _greedy(engine, [[5, 6, 7, 8]], 4) == want
    assert len(seen) == 4 * len(sites) and seen[: len(sites)] == sites
