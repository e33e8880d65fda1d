"""The TPU platform: import hygiene and probe everywhere; the XLA backend against the
float64 reference, and the whole engine compiling once per bucketed shape, where torch-xla
is installed (tests/envs/tpu.sh builds that environment and runs XLA on the CPU with
PJRT_DEVICE=CPU)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import platforms.tpu
from core.batch_shape import BucketedBatchShaper
from core.conformance.harness import SENTINEL, PagedCase, make_spec, mismatch, seeded
from core.platform import Capability
from core.plugins import Plugins
from platforms.tpu.attention import PallasTpuAttentionBackend, TpuAttentionBackend
from platforms.tpu.buckets import TpuBuckets
from platforms.tpu.platform import TpuPlatform

HAVE_XLA = importlib.util.find_spec("torch_xla") is not None


def test_importing_the_plugin_and_probing_import_no_torch_xla():
    code = (
        "import sys, platforms.tpu\n"
        "from platforms.tpu.platform import TpuPlatform\n"
        "TpuPlatform.probe()\n"
        "assert 'torch_xla' not in sys.modules, 'torch_xla was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_plugin_registers_the_platform():
    plugins = Plugins()
    plugins.register(platforms.tpu, "tpu")
    assert plugins.platforms()["tpu"] == ("tpu", TpuPlatform)


def test_probe_says_what_is_missing_or_how_it_runs():
    probe = TpuPlatform.probe()
    if not HAVE_XLA:
        assert probe.score == 0 and "pip install 'core[tpu]'" in probe.reason
    elif "no TPU found" in probe.reason:
        assert probe.score == 1 and probe.emulated and "--platform tpu" in probe.reason
    else:
        assert probe.score == 100 and "TPU chip" in probe.reason


def test_pallas_is_used_only_where_the_kernel_fits():
    assert not PallasTpuAttentionBackend(make_spec(torch.bfloat16, 16)).use_pallas  # head 64
    fits = make_spec(torch.bfloat16, 16)
    fits = type(fits)(8, 2, 128, torch.bfloat16, 16)
    assert PallasTpuAttentionBackend(fits).use_pallas
    assert not TpuAttentionBackend(fits).use_pallas
    windowed = type(fits)(8, 2, 128, torch.bfloat16, 16, sliding_window=64)
    assert not PallasTpuAttentionBackend(windowed).use_pallas


# ---- with torch-xla ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def platform() -> TpuPlatform:
    os.environ.setdefault("PJRT_DEVICE", "CPU")  # before the XLA runtime starts
    pytest.importorskip("torch_xla", reason="needs torch-xla (tests/envs/tpu.sh)")
    return TpuPlatform()


@pytest.fixture(scope="module")
def metrics(platform):
    return platform.get_extension("metrics")


def test_platform_facts(platform):
    import torch.distributed as dist

    assert platform.device(0).type == "xla"
    # a TPU has memory of its own; XLA on the host CPU is an emulation with no capabilities
    expected = frozenset({Capability.DEVICE_MEMORY}) if platform.on_tpu else frozenset()
    assert platform.capabilities == expected and platform.emulated == (not platform.on_tpu)
    backend = platform.distributed_backend()
    import torch_xla.distributed.xla_backend  # noqa: F401  (registers the backend)

    assert backend == "xla" and backend in dist.Backend.backend_list
    if not platform.on_tpu:
        assert platform.attention_backend_class(make_spec(torch.float32, 16)) is TpuAttentionBackend
        with pytest.raises(ValueError, match="need a TPU"):
            platform.attention_backend_class(make_spec(torch.float32, 16), "pallas_paged")


def test_steps_run_in_a_grad_mode_where_xla_can_view_weights(platform):
    weight = torch.randn(8, 4).to(platform.device(0))  # made outside, like loaded weights
    x = torch.randn(3, 4).to(platform.device(0))
    with platform.inference_context():
        y = torch.nn.functional.linear(x, weight)  # takes weight.t(), a view
        platform.step_boundary()
    assert torch.allclose(y.cpu(), x.cpu() @ weight.cpu().t(), atol=1e-5)


def _scenario(case: PagedCase, name: str):
    bs = case.spec.block_size
    if name == "prefill":
        seqs = [case.new_seq(n) for n in (bs + 3, 1, 2 * bs)]
        return [case.step([(s, len(s.keys)) for s in seqs], label=name)]
    if name == "chunked":
        a, b = case.new_seq(3 * bs), case.new_seq(bs + 6)
        steps = ((bs - 3, 5), (bs + 7, bs), (2, 1))
        return [case.step([(a, na), (b, nb)], label=f"{name} {na}/{nb}") for na, nb in steps]
    if name == "decode":
        seqs = [case.new_seq(n + 3) for n in (bs, 2 * bs + 3, 1)]
        for s, n in zip(seqs, (bs, 2 * bs + 3, 1)):
            case.write(s, n)
        return [case.step([], seqs, label=f"{name} {i}") for i in range(3)]
    a, b, c = case.new_seq(2 * bs), case.new_seq(bs + 2), case.new_seq(bs + 9)
    first = case.step([(b, bs + 1), (c, 7)], label="mixed setup")
    return [first, case.step([(a, 2 * bs), (c, bs + 2)], [b], label="mixed")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 11])
@pytest.mark.parametrize("name", ["prefill", "chunked", "decode", "mixed"])
def test_forward_matches_reference(platform, dtype, window, name):
    spec = make_spec(dtype, 16, "gqa", window)
    case = PagedCase(platform, spec, 24, seeded("tpu", name, dtype, window))
    results = _scenario(case, name)
    platform.synchronize()
    problems = [m for r in results if (m := mismatch(r, dtype))]
    assert not problems, "\n".join(problems)


def test_write_kv_skips_padding_slots(platform):
    spec = make_spec(torch.float32, 16)
    case = PagedCase(platform, spec, 8, seeded("tpu padding"))
    gen = seeded("tpu padding rows")
    key = torch.randn(6, spec.num_kv_heads, spec.head_size, generator=gen)
    value = torch.randn(6, spec.num_kv_heads, spec.head_size, generator=gen)
    dev = case.device
    slots = torch.tensor([-1, 35, -7, 16, 127, -1])  # padding first, between and last
    case.backend.write_kv(key.to(dev), value.to(dev), case.cache, slots.to(dev))
    cache = case.cache.cpu()  # [2, kv_heads, blocks, block, head]
    for row, slot in ((1, 35), (3, 16), (4, 127)):
        assert torch.equal(cache[0, :, slot // 16, slot % 16], key[row])
        assert torch.equal(cache[1, :, slot // 16, slot % 16], value[row])
    written = 2 * 3 * spec.num_kv_heads * spec.head_size
    assert case.sentinel_count(cache) == cache.numel() - written
    pad = torch.tensor([-1, -2]).to(dev)
    case.backend.write_kv(key[:2].to(dev), value[:2].to(dev), case.cache, pad)  # no-op
    assert torch.equal(case.cache.cpu(), cache)


class _StepCompiles:
    """Per engine step: the shaped step's sizes and the XLA compilations of its program.

    The shaper is the runner's, so the key is what the step really looked like on the
    device; the step boundary is where torch-xla compiles the step's traced program."""

    def __init__(self, metrics):
        self.metrics, self.keys, self.compiles, self.real_rows = metrics, [], [], []

    def wrap(self, monkeypatch) -> None:
        shape, boundary = BucketedBatchShaper.shape, TpuPlatform.step_boundary

        def recording_shape(shaper, step):
            shaped = shape(shaper, step)
            self.real_rows.append((len(step.input_ids), step.num_prefills, len(step.query_lens)))
            self.keys.append((len(shaped.input_ids), shaped.num_prefills, shaped.max_query_len,
                              len(shaped.query_lens) - shaped.num_prefills,
                              shaped.block_tables.shape[1]))
            return shaped

        def recording_boundary(platform):
            before = self.metrics.counter_value("UncachedCompile") or 0
            boundary(platform)
            self.compiles.append((self.metrics.counter_value("UncachedCompile") or 0) - before)

        monkeypatch.setattr(BucketedBatchShaper, "shape", recording_shape)
        monkeypatch.setattr(TpuPlatform, "step_boundary", recording_boundary)


def test_engine_steps_compile_once_per_bucket(platform, metrics, tmp_path, monkeypatch):
    """The whole engine on XLA: prompts of many lengths, chunked, then decoding, so the
    batch's token count changes from step to step; each step's program compiles the first
    time its bucketed shape is seen and never again (torch-xla's UncachedCompile), and
    the greedy tokens are the CPU platform's."""
    import core
    from core.conformance.tiny_model import build_tiny_llama

    model = build_tiny_llama(tmp_path / "tiny")
    lengths = (5, 23, 41, 12, 60, 9, 30, 2, 17)
    prompts = [[(7 * i + 3 * j) % 200 + 5 for j in range(n)] for i, n in enumerate(lengths)]
    args = dict(model=str(model), dtype="float32", seed=0, max_model_len=128, max_num_seqs=4,
                max_num_batched_tokens=24, kv_cache_memory=8 << 20)
    params = core.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cpu = core.LLM(platform="cpu", **args).generate(prompts, params, use_tqdm=False)
    steps = _StepCompiles(metrics)
    steps.wrap(monkeypatch)
    tpu = core.LLM(platform="tpu", **args).generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in tpu] == [list(o.outputs[0].token_ids) for o in cpu]
    assert len(steps.keys) == len(steps.compiles) > 20
    table = "\n".join(f"  step {i}: (rows, prefills, seqs) {r} -> shaped {k}: {c} compiled"
                      for i, (r, k, c) in enumerate(zip(steps.real_rows, steps.keys, steps.compiles)))
    assert len(set(steps.real_rows)) > len(set(steps.keys)), f"too little variety:\n{table}"
    seen, again = set(), []
    for i, (key, compiled) in enumerate(zip(steps.keys, steps.compiles)):
        if key in seen and compiled:
            again.append(i)
        seen.add(key)
    assert not again, f"steps {again} recompiled a shape seen before:\n{table}"
    assert sum(steps.compiles) <= len(seen), f"more compilations than shapes:\n{table}"


MIXED = [
    dict(temperature=0),
    dict(temperature=0.8, top_k=20),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.7, min_p=0.1),
    dict(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1),
    dict(temperature=0, repetition_penalty=1.2),
    dict(temperature=1.1, top_k=30, top_p=0.8, logit_bias={7: 1.5}),
    dict(temperature=0.9, min_tokens=3),
]
"""Per-request parameters of the mixed workload (request i takes MIXED[i % 8])."""


def _knobs(sampling: str, i: int) -> dict:
    if sampling == "greedy":
        return dict(temperature=0)
    if sampling == "temperature-top-k":
        return dict(temperature=0.8, top_k=20)
    return MIXED[i % len(MIXED)]


@pytest.mark.parametrize("sampling", ["greedy", "temperature-top-k", "mixed"])
def test_sampling_compiles_once_per_bucket_of_sampled_rows(platform, metrics, tmp_path, monkeypatch, sampling):
    """The LM head and the sampler run on the sequence bucket of the sampled-row count
    (TpuBuckets.pad_seqs: 8 or 16 here), not on the count itself. Two workloads of 16
    requests with the same prompts: in the first the requests finish in pairs, so decode
    steps sample 16, 14, ..., 2 rows; in the second one finishes first, so they sample 15,
    13, ..., 1, with the same forward shapes and the same buckets (checked). From its first
    decode step on, the second workload must compile nothing it has not met (the first two
    cuts of a run also execute what the previous run left queued, its last row removals,
    beside the new prefill); without bucketing each new count compiles the step's sampling
    program again. Greedy and seeded tokens equal the CPU platform's. Workloads: all greedy;
    seeded temperature + top-k rows (every row the same parameters, as a server's default);
    and rows mixing greedy, temperature, top-k, top-p, min-p, penalties, logit bias and
    min_tokens, which the TPU samples without row subsets (core/sampler/static.py; the
    subset pipeline would compile per subset size). There the sampling program is also
    keyed by the padded edit count, so the second workload may compile only for a
    (rows bucket, edit bucket) pair or forward shape the first did not meet."""
    import core
    import core.model_runner as runner_module
    import core.sampler.sampler as sampler_module
    from core.conformance.tiny_model import build_tiny_llama

    model = build_tiny_llama(tmp_path / "tiny")
    # prompts of 4-6 tokens and at most 10 new ones: every context fits one 16-token block
    prompts = [[(7 * i + 3 * j) % 200 + 5 for j in range(4 + i % 3)] for i in range(16)]
    runs = {"pairs": [2 + i // 2 for i in range(16)], "one first": [2 + (i + 1) // 2 for i in range(16)]}
    args = dict(model=str(model), dtype="float32", seed=0, max_model_len=64, max_num_seqs=16,
                max_num_batched_tokens=128, kv_cache_memory=8 << 20)
    cpu = core.LLM(platform="cpu", **args)
    tpu = core.LLM(platform="tpu", **args)

    # per launched step: [forward shape key, sampled rows, compiles before its cut, padded edits]
    steps: list = []
    shape, pad, pad_edits = BucketedBatchShaper.shape, runner_module.pad_sampled_rows, sampler_module.pad_edits

    def recording_shape(shaper, host):
        mark = metrics.counter_value("UncachedCompile") or 0
        shaped = shape(shaper, host)
        key = (len(shaped.input_ids), shaped.num_prefills, shaped.max_query_len, shaped.block_tables.shape[1])
        steps.append([key, None, mark, None])
        return shaped

    def recording_pad(rows, hidden_rows, batch_rows, size):
        steps[-1][1] = len(rows)
        return pad(rows, hidden_rows, batch_rows, size)

    def recording_pad_edits(inputs):
        padded = pad_edits(inputs)
        steps[-1][3] = padded.edits.shape[0]
        return padded

    monkeypatch.setattr(BucketedBatchShaper, "shape", recording_shape)
    monkeypatch.setattr(runner_module, "pad_sampled_rows", recording_pad)
    monkeypatch.setattr(sampler_module, "pad_edits", recording_pad_edits)
    seen, late = {}, {}
    for name, max_tokens in runs.items():
        params = [core.SamplingParams(max_tokens=m, ignore_eos=True, seed=i, **_knobs(sampling, i))
                  for i, m in enumerate(max_tokens)]
        steps.clear()
        out = tpu.generate(prompts, params, use_tqdm=False)
        late[name] = (metrics.counter_value("UncachedCompile") or 0) - steps[2][2]
        seen[name] = [(key, rows, edits) for key, rows, _, edits in steps]
        if sampling != "temperature-top-k":
            want = cpu.generate(prompts, params, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in out] == [list(o.outputs[0].token_ids) for o in want]
    first, second = ({rows for _, rows, _ in seen[k][2:]} for k in runs)
    assert len(first) >= 7 and len(second) >= 7 and not first & second, seen
    assert {TpuBuckets().pad_seqs(r) for r in first} == {TpuBuckets().pad_seqs(r) for r in second} == {8, 16}
    assert {key for key, _, _ in seen["one first"]} <= {key for key, _, _ in seen["pairs"]}, seen
    sampled = {k: {(TpuBuckets().pad_seqs(r), e) for _, r, e in seen[k] if r} for k in runs}
    new = sampled["one first"] - sampled["pairs"]
    if sampling != "mixed":
        assert not new, seen
    else:
        assert len({e for _, e in sampled["pairs"]}) >= 2, f"the edit count never changed bucket: {seen}"
    assert late["one first"] <= len(new), (
        f"compiled {late['one first']} programs; new (rows bucket, edit bucket) pairs: {new}; steps: {seen}")


def test_grammar_masks_apply_on_the_xla_device(platform):
    """The TPU keeps the default grammar_bitmask op: the unpack runs on the XLA device and
    agrees with the host path on fresh random logits and masks."""
    from core.ops import DEFAULT_OPS
    from core.structured_output import apply_bitmask_host

    op = {**DEFAULT_OPS, **platform.ops()}["grammar_bitmask"]
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 1000, generator=gen)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, 32), generator=gen, dtype=torch.int64).to(torch.int32)
    want = logits.clone()
    apply_bitmask_host(want, mask, rows=[4, 0, 2])
    got = logits.to(platform.device(0))
    op(got, mask, [4, 0, 2])
    assert torch.equal(got.cpu(), want)


def test_copy_and_swap_blocks_move_whole_blocks(platform):
    spec = make_spec(torch.float32, 16)
    case = PagedCase(platform, spec, 10, seeded("tpu blocks"))
    host_layers = [torch.randn(case.cache.shape, generator=seeded("layer", i)) for i in range(2)]
    layers = [h.to(case.device) for h in host_layers]
    pairs = torch.tensor([[2, 7], [5, 1], [2, 9]])
    case.backend.copy_blocks(layers, pairs)
    for old, new in zip(host_layers, layers):
        want = old.clone()
        for src, dst in pairs.tolist():
            want[:, :, dst] = old[:, :, src]
        assert torch.equal(new.cpu(), want)
    host = case.backend.allocate_kv_cache(4, "cpu").fill_(SENTINEL)
    case.backend.swap_blocks(layers[0], host, torch.tensor([[7, 0], [3, 2]]))
    src = layers[0].cpu()
    assert torch.equal(host[:, :, 0], src[:, :, 7]) and torch.equal(host[:, :, 2], src[:, :, 3])
    assert bool((host[:, :, 1] == SENTINEL).all()) and bool((host[:, :, 3] == SENTINEL).all())
