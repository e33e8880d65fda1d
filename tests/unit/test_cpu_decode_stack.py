"""The CPU's fused decode step (platforms/cpu/decode_stack.py, csrc/cpu/decode_stack.cpp).

Reference: the model's own modules on the same step. The fused step calls the same kernels in
the same order, so its hidden states and the KV cache it writes must equal theirs bit for bit,
on random caches and random tiny models of each family it takes (biases, sliding windows,
grouped-query attention, int4 and int8 codes, float32 and bfloat16); greedy generation must not change; models and
steps it does not reproduce must keep the modules.
"""

from __future__ import annotations

import pytest
import torch

from core.benchmarks.model_step import decode_schedule
from core.entrypoints.llm import LLM
from core.sampling_params import SamplingParams
from platforms.cpu.decode_stack import FusedDecode
from platforms.cpu.kernels import kernels_or_none
from tests.helpers import tiny_model_dir

pytestmark = pytest.mark.skipif(kernels_or_none() is None, reason="the CPU kernels do not build here")

FAMILIES = {  # family -> config overrides: what each case exercises
    "llama": {},  # grouped-query attention (4 heads, 2 kv heads), head 16
    "qwen2": {"num_key_value_heads": 4},  # q/k/v biases, no GQA
    "mistral": {"sliding_window": 6},  # windowed attention in every layer
    "llama-wide": {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
                   "intermediate_size": 96},  # head 64: the AVX2 attention path
}


def _engine(path, fmt: str = "int4", dtype: str = "float32", **kw) -> LLM:
    return LLM(model=str(path), dtype=dtype, weight_format=fmt, kv_cache_memory="16MiB",
               max_model_len=256, **kw)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    name = request.param
    family = name.split("-")[0]
    return name, tiny_model_dir(tmp_path_factory.mktemp(name), family, seed=3, **FAMILIES[name])


def _fill_random(caches: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=g))


@pytest.mark.parametrize(("dtype", "fmt"), [("float32", "int4"), ("float32", "int8"), ("bfloat16", "int4")])
@pytest.mark.parametrize("batch", [1, 5])
def test_fused_step_equals_the_modules_bit_for_bit(family_dir, dtype, fmt, batch):
    name, path = family_dir
    llm = _engine(path, fmt, dtype)
    try:
        runner = llm.engine.executor.runner
        assert isinstance(runner.graphs, FusedDecode), name
        params = SamplingParams(temperature=0.0, max_tokens=1000)
        for context in (1, 17, 40):  # first position, mid-block, past the window
            sched = decode_schedule(batch, context, runner.block_size, params, llm.engine.vocab_size)
            ids, pos, md = runner.prepare_inputs(sched)
            ids = torch.randint(3, llm.engine.vocab_size, ids.shape, generator=torch.Generator().manual_seed(context))
            assert runner.graphs.can_run(md)
            _fill_random(runner.kv_caches, seed=context)
            with torch.inference_mode():
                want = runner.model(ids, pos, runner.kv_caches, md).clone()
                want_caches = [c.clone() for c in runner.kv_caches]
                _fill_random(runner.kv_caches, seed=context)
                got = runner.graphs.run(ids, pos, md)
            assert torch.equal(got, want), (name, fmt, batch, context, (got - want).abs().max())
            for c, w in zip(runner.kv_caches, want_caches):
                assert torch.equal(c, w)
    finally:
        llm.engine.shutdown()


def test_greedy_tokens_match_the_eager_engine(tmp_path):
    path = tiny_model_dir(tmp_path, "llama", seed=5)
    prompts = [[5, 9, 33, 70, 100], [7] * 20, list(range(40, 75))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = []
    for eager in (True, False):
        llm = _engine(path, enforce_eager=eager)
        try:
            assert isinstance(llm.engine.executor.runner.graphs, FusedDecode) is not eager
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.engine.shutdown()
    assert outs[0] == outs[1]


def test_steps_it_does_not_take(tmp_path):
    llm = _engine(tiny_model_dir(tmp_path, "llama", seed=1))
    try:
        runner = llm.engine.executor.runner
        params = SamplingParams(temperature=0.0, max_tokens=1000)
        ids, pos, md = runner.prepare_inputs(decode_schedule(65, 4, runner.block_size, params, 512))
        assert not runner.graphs.can_run(md)  # above GROUPED_MAX_ROWS: the modules' dense path
        from core.benchmarks.model_step import prefill_schedule

        ids, pos, md = runner.prepare_inputs(prefill_schedule(1, 8, runner.block_size, params, 512))
        assert not runner.graphs.can_run(md)  # prompts
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(("family", "fmt", "dtype"), [
    ("llama", "dense", "float32"),  # exact against HF through torch's matmul
    ("llama", "int8", "bfloat16"),  # torch's int8 kernel: not taken
    ("qwen3", "int4", "float32"),  # q/k norms in its attention
])
def test_models_it_does_not_reproduce_keep_the_modules(tmp_path, family, fmt, dtype):
    llm = _engine(tiny_model_dir(tmp_path, family, seed=2), fmt, dtype)
    try:
        assert llm.engine.executor.runner.graphs is None
    finally:
        llm.engine.shutdown()


def test_fused_step_over_a_released_embedding_equals_the_modules(tmp_path):
    """A tied embedding on Q8_0's grid (the embedded SmolLM2's) keeps only its int8 codes; the
    fused step looks rows up from them as the modules do."""
    from safetensors.torch import load_file, save_file

    from platforms.cpu.linear import released_codes
    from tests.unit.test_cpu_embedding import q8_grid_table

    path = tiny_model_dir(tmp_path, "llama", seed=4, tie_word_embeddings=True)
    weights = load_file(path / "model.safetensors")
    table = q8_grid_table(*weights["model.embed_tokens.weight"].shape, seed=7)
    weights["model.embed_tokens.weight"] = table
    weights.pop("lm_head.weight", None)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    llm = _engine(path)
    try:
        runner = llm.engine.executor.runner
        embed = runner.model.model.embed_tokens
        assert released_codes(embed.weight) is not None and embed.weight.numel() == 0
        assert isinstance(runner.graphs, FusedDecode)
        params = SamplingParams(temperature=0.0, max_tokens=1000)
        sched = decode_schedule(3, 9, runner.block_size, params, llm.engine.vocab_size)
        ids, pos, md = runner.prepare_inputs(sched)
        ids = torch.randint(0, llm.engine.vocab_size, ids.shape, generator=torch.Generator().manual_seed(8))
        _fill_random(runner.kv_caches, seed=9)
        with torch.inference_mode():
            assert torch.equal(embed(ids), table[ids])
            want = runner.model(ids, pos, runner.kv_caches, md).clone()
            _fill_random(runner.kv_caches, seed=9)
            got = runner.graphs.run(ids, pos, md)
        assert torch.equal(got, want)
    finally:
        llm.engine.shutdown()
