"""Quantized checkpoints of a tiny random Llama, end to end on the CPU platform.

Each format is written from one seeded fp32 model: AWQ, GPTQ (4-bit with and without act-order,
symmetric 8-bit),
the ``fp8`` method's 128x128 blocks and compressed-tensors W4A16 with group act-order
(``weight_g_idx``, which the installed compressed-tensors no longer writes) by
core.quantization.writers (which follows each
format's layout and also writes the dense model the quantized one stands for, computed from
the writer's own integer codes), compressed-tensors ``float-quantized`` (per tensor, channel
and block) and ``pack-quantized`` (W4A16: int4, groups of 128; W8A16: int8) by the ``compressed-tensors``
library itself, dequantized for the reference by its definition (fp8: ``code * scale``) or by
the library's own fake quantization (int4). For each:

* the loaded (dequantized) linear weights equal that reference exactly;
* greedy tokens of the engine equal HF transformers' on the reference model (fp32: exact);
* the kept-quantized loading path (``ReferenceQuantizedLinear``: what a GPU keeps, multiplied
  in plain torch) gives the same logits as the dequantized one, also split over 2 ranks.

How often quantization changes the model's greedy choice is measured against the original
fp32 model (teacher-forced top-1 agreement) and printed; the figures are in
docs/quantization.md.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from core import LLM, SamplingParams
from core.model_loader import load_model
from core.models import ModelRegistry
from core.quantization.linear import ReferenceQuantizedLinear
from core.quantization.registry import resolve_quantization
from core.quantization.writers import write_quantized
from tests.helpers import cpu_context, model_config_for, run_ranks, run_schedule, tiny_llama_dir
from tests.integration.test_engine_hf import hf_greedy, random_prompts

# head_dim 64 and 2 KV heads (k/v projections of 128 rows, a partial fp8 block row beside
# q's 256), 256 and 512 inputs: two or four 128-input groups per row.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
WRITER_FORMATS = ("awq", "gptq", "gptq-act-order", "gptq-int8", "fp8-block", "ct-w4a16-group-actorder")
CT_SCHEMES = {"ct-channel": "FP8_DYNAMIC", "ct-tensor": "FP8", "ct-block": "FP8_BLOCK", "ct-w4a16": "W4A16",
              "ct-w4a16-channel": "W4A16/channel", "ct-w4a16-asym": "W4A16_ASYM",
              "ct-w8a16": "W8A16"}  # preset[/weight strategy]
CT_FULL_SCALES = {"ct-w4a16-channel"}
"""int4 presets whose scales keep all of float32's bits (they load as 8-bit codes, exactly);
the others' scales are rounded to bf16 first, as checkpoints store them (4-bit codes)."""
MAX_NEW = 10


def write_compressed_tensors(src: Path, dst: Path, ref: Path, preset: str, full_scales: bool = False) -> None:
    """A checkpoint written by compressed-tensors: scales set from each weight's range for the
    preset's strategy (int4: rounded to bf16 unless ``full_scales``), compressed and saved by
    the library (``float-quantized`` for the FP8
    presets, ``pack-quantized`` for W4A16, int4 in groups of 128). The reference: fp8 by the
    format's definition (``code * scale``), int4 by the library's own fake quantization of
    each weight with those scales (what its dequantization gives)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    preset, _, strategy = preset.partition("/")
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if strategy:
        scheme.weights = scheme.weights.model_copy(update={"strategy": strategy, "group_size": None})
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                                        quantization_status="frozen"))
    integer = scheme.weights.type == "int"
    int_ref = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if not hasattr(module, "weight_scale"):
                continue
            w, shape = module.weight.float(), module.weight_scale.shape
            if integer:  # int4 / int8 per group or channel: codes -8..7 / -128..127 (symmetric: largest |w| at 7 / 127)
                groups = w.reshape(shape[0], shape[1], -1)
                top = 2 ** (scheme.weights.num_bits - 1) - 1
                if scheme.weights.symmetric:
                    scale = groups.abs().amax(-1) / top
                else:  # the range [min, max] onto the codes, zero point rounded into them
                    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
                    scale = (hi - lo) / (2 * top + 1)
                    zero = (-(top + 1) - lo / scale.clamp(min=1e-8)).round().clamp(-(top + 1), top)
                    module.weight_zero_point.copy_(zero.to(module.weight_zero_point.dtype))
                scale = scale.clamp(min=1e-8)
                if not full_scales:
                    scale = scale.to(torch.bfloat16)
                module.weight_scale.copy_(scale.to(module.weight_scale.dtype))
                int_ref[name + ".weight"] = fake_quantize(module.weight, module.weight_scale,
                                                          module.weight_zero_point, scheme.weights).float()
                continue
            if shape.numel() == 1:
                scale = w.abs().amax()
            elif len(shape) == 2 and shape[1] == 1:
                scale = w.abs().amax(dim=1, keepdim=True)
            else:  # [ceil(N / 128), ceil(K / 128)] blocks
                padded = torch.zeros(shape[0] * 128, shape[1] * 128)
                padded[: w.shape[0], : w.shape[1]] = w
                scale = padded.reshape(shape[0], 128, shape[1], 128).abs().amax(dim=(1, 3))
            module.weight_scale.copy_((scale / 448.0).clamp(min=1e-12).reshape(shape))
            if hasattr(module, "input_scale"):
                module.input_scale.fill_(1.0)
    compressor = ModelCompressor.from_pretrained_model(
        model, quantization_format="pack-quantized" if integer else "float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (dst / f.name).write_bytes(f.read_bytes())
    # The reference: compressed-tensors' definition, w = code * scale (scales broadcast).
    state = load_file(str(dst / "model.safetensors"))
    dense = {}
    for name, t in state.items():
        if name.endswith((".weight_scale", ".input_scale", ".weight_zero_point", ".weight_shape")):
            continue
        if name.endswith(".weight_packed"):
            name = name.removesuffix("_packed")
            dense[name] = int_ref[name]
            continue
        scale = state.get(name + "_scale")
        if t.dtype == torch.float8_e4m3fn:
            s = scale.float()
            if s.dim() == 2 and s.shape[1] > 1:
                s = s.repeat_interleave(128, 0)[: t.shape[0]].repeat_interleave(128, 1)[:, : t.shape[1]]
            t = t.float() * s.reshape(s.shape[0] if s.numel() > 1 else 1, -1)
        dense[name] = t
    for f in dst.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            ref.mkdir(parents=True, exist_ok=True)
            (ref / f.name).write_bytes(f.read_bytes())
    save_file(dense, str(ref / "model.safetensors"))
    config = json.loads((ref / "config.json").read_text())
    config.pop("quantization_config")
    (ref / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """fmt -> (quantized dir, dense reference dir); plus "original" -> the fp32 model."""
    tmp = tmp_path_factory.mktemp("quant")
    src = tiny_llama_dir(tmp, name="original", seed=7, **SHAPE)
    out = {"original": (src, src)}
    for fmt in WRITER_FORMATS:
        out[fmt] = (write_quantized(src, tmp / fmt, fmt, seed=1, reference=tmp / f"{fmt}-ref"), tmp / f"{fmt}-ref")
    pytest.importorskip("compressed_tensors")
    for fmt, preset in CT_SCHEMES.items():
        write_compressed_tensors(src, tmp / fmt, tmp / f"{fmt}-ref", preset, full_scales=fmt in CT_FULL_SCALES)
        out[fmt] = (tmp / fmt, tmp / f"{fmt}-ref")
    return out


ALL_FORMATS = WRITER_FORMATS + tuple(CT_SCHEMES)


def _quantized_config(path: Path):
    config = model_config_for(path)
    quant = resolve_quantization(None, config.hf_config, None, _cpu())
    return dataclasses.replace(config, quantization=quant)


def _cpu():
    from platforms.cpu.platform import CpuPlatform

    return CpuPlatform


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_dequantized_weights_equal_the_reference(checkpoints, fmt):
    from safetensors.torch import load_file

    quantized, reference = checkpoints[fmt]
    model = load_model(_quantized_config(quantized), cpu_context(), ModelRegistry())
    ref = load_file(str(reference / "model.safetensors"))
    for i in range(2):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        layer = model.model.layers[i]
        want_qkv = torch.cat([ref[f"{attn}.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(layer.self_attn.qkv_proj.weight, want_qkv)
        assert torch.equal(layer.self_attn.o_proj.weight, ref[f"{attn}.o_proj.weight"])
        want_gate_up = torch.cat([ref[f"{mlp}.gate_proj.weight"], ref[f"{mlp}.up_proj.weight"]])
        assert torch.equal(layer.mlp.gate_up_proj.weight, want_gate_up)
        assert torch.equal(layer.mlp.down_proj.weight, ref[f"{mlp}.down_proj.weight"])


@pytest.mark.parametrize("fmt", ["ct-w4a16", "ct-w4a16-asym", "ct-w4a16-channel", "ct-w4a16-group-actorder"])
def test_compressed_tensors_int4_stays_4_bit_where_that_is_exact(checkpoints, fmt):
    """W4A16 layers load as 4-bit codes with mins (what the int4 GEMVs take) when their scales
    allow the same floats (16-bit scales), else as 8-bit codes; the weights above are exact
    either way."""
    from safetensors.torch import load_file

    from core.quantization.tensors import IntWeight

    quant = _quantized_config(checkpoints[fmt][0]).quantization
    state = load_file(str(checkpoints[fmt][0] / "model.safetensors"))
    layers = [w for _, w in quant.checkpoint_weights(iter(state.items())) if isinstance(w, IntWeight)]
    assert layers and {w.bits for w in layers} == ({8} if fmt in CT_FULL_SCALES else {4})


def _engine_greedy(path: Path, prompts, **engine_args) -> list[list[int]]:
    llm = LLM(model=str(path), platform="cpu", dtype="float32", block_size=16, kv_cache_memory="32MiB",
              **engine_args)
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_greedy_tokens_equal_hf_on_the_dequantized_model(checkpoints, fmt):
    quantized, reference = checkpoints[fmt]
    prompts = random_prompts(4, 512, seed=3)
    assert _engine_greedy(quantized, prompts) == hf_greedy(reference, prompts, MAX_NEW)


def test_fp8_quantization_on_load_of_a_dense_checkpoint(checkpoints, tmp_path):
    """--quantization fp8 on the fp32 model: per-channel scales (max |w| / 448), codes by
    torch's float8 cast; the engine matches HF on that dequantized model."""
    from safetensors.torch import load_file, save_file

    src = checkpoints["original"][0]
    state = load_file(str(src / "model.safetensors"))
    ref = tmp_path / "fp8-on-load-ref"
    ref.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (ref / f.name).write_bytes(f.read_bytes())
    dense = {}
    for name, w in state.items():
        if name.endswith("_proj.weight"):
            scale = w.abs().amax(dim=1, keepdim=True) / 448.0
            w = (w / scale).to(torch.float8_e4m3fn).float() * scale
        dense[name] = w
    save_file(dense, str(ref / "model.safetensors"))
    prompts = random_prompts(4, 512, seed=4)
    assert _engine_greedy(src, prompts, quantization="fp8") == hf_greedy(ref, prompts, MAX_NEW)


@pytest.mark.parametrize("fmt", ["awq", "gptq-act-order", "gptq-int8", "fp8-block", "ct-tensor", "ct-w4a16",
                                 "ct-w4a16-channel", "ct-w4a16-group-actorder", "ct-w8a16"])
def test_kept_quantized_path_gives_the_dequantized_logits(checkpoints, fmt):
    config = _quantized_config(checkpoints[fmt][0])
    dense = load_model(config, cpu_context(), ModelRegistry())
    kept_ctx = dataclasses.replace(cpu_context(), linear_method=ReferenceQuantizedLinear(config.quantization,
                                                                                         torch.float32))
    kept = load_model(config, kept_ctx, ModelRegistry())
    layer = kept.model.layers[0].mlp.down_proj
    assert layer.weight.numel() == 0 and layer.packed_weight.weight.shape == (256, 512)
    want, got = run_schedule(dense, 512), run_schedule(kept, 512)
    for seq in want:
        assert torch.equal(got[seq][1], want[seq][1])


def test_kept_quantized_weights_split_over_two_ranks(checkpoints):
    config = _quantized_config(checkpoints["awq"][0])
    want = run_schedule(load_model(config, cpu_context(), ModelRegistry()), 512)

    def rank(comm):
        ctx = dataclasses.replace(cpu_context(comm=comm),
                                  linear_method=ReferenceQuantizedLinear(config.quantization, torch.float32))
        return run_schedule(load_model(config, ctx, ModelRegistry()), 512)

    for got in run_ranks(2, rank):
        for seq in want:
            torch.testing.assert_close(got[seq][1], want[seq][1], rtol=1e-4, atol=1e-4)  # sum order


def _top1(path: Path, seqs: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.cat([model(torch.tensor([s])).logits[0].argmax(-1) for s in seqs])


def _bf16_rounded(src: Path, dst: Path) -> Path:
    """The model with its weights rounded to bf16: how sensitive it is to any rounding."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    state = load_file(str(src / "model.safetensors"))
    save_file({k: v.bfloat16().float() for k, v in state.items()}, str(dst / "model.safetensors"))
    return dst


def test_agreement_with_the_fp32_model_is_measured(checkpoints, capsys, tmp_path):
    """Teacher-forced top-1 agreement with the original fp32 model over 8 x 48 positions.

    A tiny random model (0.2-scale weights, 512 tokens) has small logit margins, so any
    rounding moves many argmaxes: bf16 weights are printed beside the formats for scale.
    Measured (docs/quantization.md): int4 group 128 ~0.3, fp8 ~0.7, int8 higher. A broken format (a wrong
    nibble order, scales on the wrong rows) agrees by chance only (1/512), far below the
    floors.
    """
    seqs = random_prompts(8, 512, seed=9, lo=48, hi=48)
    original = _top1(checkpoints["original"][0], seqs)
    paths = {fmt: checkpoints[fmt][1] for fmt in ALL_FORMATS}
    paths["bf16 weights"] = _bf16_rounded(checkpoints["original"][0], tmp_path / "bf16")
    rates = {fmt: float((_top1(p, seqs) == original).float().mean()) for fmt, p in paths.items()}
    with capsys.disabled():
        print("\ntop-1 agreement with fp32:", {k: round(v, 3) for k, v in rates.items()})
    for fmt in ALL_FORMATS:
        four_bit = fmt.startswith(("awq", "gptq", "ct-w4a16")) and fmt != "gptq-int8"  # (ct-w8a16: 8-bit)
        assert rates[fmt] >= (0.15 if four_bit else 0.5), (fmt, rates[fmt])


@pytest.mark.parametrize("method", [{"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"},
                                    None])
def test_dummy_weights_come_in_the_kept_format(tmp_path, method):
    """--load-format dummy (the GPU benchmarks) with an AWQ config, or --quantization fp8 on a
    dense one: every linear layer holds random weights in the method's own form."""
    from core.benchmarks.shapes import write_model_dir

    path = write_model_dir("llama3-tiny", tmp_path / "m")
    if method is not None:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "quantization_config": method}))
    config = dataclasses.replace(model_config_for(path, load_format="dummy"), max_model_len=512)
    quant = resolve_quantization(None if method else "fp8", config.hf_config, None, _cpu())
    config = dataclasses.replace(config, quantization=quant)
    ctx = dataclasses.replace(cpu_context(), linear_method=ReferenceQuantizedLinear(quant, torch.float32))
    model = load_model(config, ctx, ModelRegistry())
    form = model.model.layers[1].mlp.gate_up_proj.packed_weight.weight
    assert form.shape == (1024, 256) and type(form).__name__ == ("IntWeight" if method else "Fp8Weight")
    logits = run_schedule(model, config.hf_config.vocab_size, decode_steps=1)["a"][1]
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_engine_refuses_an_unsupported_quant_method_at_start(checkpoints, tmp_path):
    src = checkpoints["original"][0]
    dst = tmp_path / "bnb"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        LLM(model=str(dst), platform="cpu", dtype="float32")
    assert "'bitsandbytes'" in str(e.value) and "['awq', 'compressed-tensors', 'fp8', 'gguf', 'gptq']" in str(e.value)
