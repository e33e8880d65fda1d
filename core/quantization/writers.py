"""Writers of quantized checkpoints from a dense HF checkpoint, following each format's
layout (see the readers: :mod:`core.quantization.int4`, :mod:`core.quantization.fp8`).

They quantize by round-to-nearest (not the AWQ or GPTQ search: what a checkpoint's numbers
are does not change how it is stored), so tests can write tiny checkpoints in every format
and know the exact dequantized weights (:func:`quantize_state`). compressed-tensors
checkpoints are written by the ``compressed-tensors`` library itself in the tests, except
group act-order, which the installed library no longer writes (ct-w4a16-group-actorder).

    python -m core.quantization.writers SRC DST --format awq|gptq|gptq-act-order|gptq-int8|fp8-block|ct-w4a16-group-actorder
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
from pathlib import Path

import torch

from core.quantization.int4 import AWQ_ORDER
from core.quantization.tensors import FP8_MAX

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Llama-family linear layers a writer quantizes (the LM head and embeddings stay dense)."""


def pack_int32(codes: torch.Tensor, dim: int, order: tuple[int, ...] | None = None, bits: int = 4) -> torch.Tensor:
    """uint8 codes of ``bits`` (4 or 8) bits -> int32 words of 32 / bits, along ``dim``; value
    ``i`` of a word holds the code at position ``order[i]`` of its group (None: ``i``)."""
    per = 32 // bits
    c = codes.to(torch.int64).movedim(dim, -1)
    c = c.unflatten(-1, (-1, per))
    if order is not None:
        c = c[..., list(order)]
    words = sum(c[..., i] << (bits * i) for i in range(per))
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def _asym_int4(w_groups: torch.Tensor, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., G] float -> codes (uint8), zero points (uint8, >= ``min_zero``), fp16 scales
    per group."""
    low, high = w_groups.amin(-1), w_groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-6).half()
    zero = torch.round(-low / scale.float()).clamp(min_zero, 15)
    codes = torch.round(w_groups / scale.float()[..., None] + zero[..., None]).clamp(0, 15)
    return codes.to(torch.uint8), zero.to(torch.uint8), scale


def _int4_reference(codes: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The formats' definition, (q - z) * s, from the writer's own integers: [..., G]."""
    return (codes.float() - zero.float()[..., None]) * scale.float()[..., None]


Quantized = tuple[dict[str, torch.Tensor], torch.Tensor]
"""A layer's checkpoint tensors, and the dense [N, K] weight they stand for."""


def awq_tensors(w: torch.Tensor, group: int) -> Quantized:
    """A dense [N, K] weight as AWQ GEMM tensors (qweight, qzeros, scales)."""
    n, k = w.shape
    grouped = w.float().t().reshape(k // group, group, n).transpose(1, 2)  # [K / G, N, G]
    codes, zero, scale = _asym_int4(grouped)
    ref = _int4_reference(codes, zero, scale).transpose(1, 2).reshape(k, n).t()
    codes = codes.transpose(1, 2).reshape(k, n)  # [K, N]
    parts = {"qweight": pack_int32(codes, 1, AWQ_ORDER), "qzeros": pack_int32(zero, 1, AWQ_ORDER),
             "scales": scale.contiguous()}
    return parts, ref.contiguous()


def _sym_int8(w_groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., G] float -> GPTQ's symmetric 8-bit form: codes round(w / s) + 128 in 0..255,
    zero points 128, fp16 scales 2 max|w| / 255 per group."""
    scale = (w_groups.abs().amax(-1) * 2 / 255).clamp(min=1e-6).half()
    codes = (torch.round(w_groups / scale.float()[..., None]) + 128).clamp(0, 255)
    return codes.to(torch.uint8), torch.full(scale.shape, 128, dtype=torch.uint8), scale


def gptq_tensors(w: torch.Tensor, group: int, perm: torch.Tensor | None = None, bits: int = 4) -> Quantized:
    """A dense [N, K] weight as GPTQ v1 tensors (zero points stored minus one, so 4-bit ones
    are kept >= 1; 8-bit: symmetric, as the GPTQ-Int8 releases); with ``perm`` (act-order)
    inputs ``perm[j * group : (j + 1) * group]`` form group ``j``."""
    n, k = w.shape
    order = perm if perm is not None else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    grouped = w.float().t()[order].reshape(k // group, group, n).transpose(1, 2)  # [K / G, N, G]
    codes, zero, scale = _sym_int8(grouped) if bits == 8 else _asym_int4(grouped, min_zero=1)
    ref_sorted = _int4_reference(codes, zero, scale).transpose(1, 2).reshape(k, n)
    ref = torch.empty_like(ref_sorted)
    ref[order] = ref_sorted
    codes_sorted = codes.transpose(1, 2).reshape(k, n)
    codes_kn = torch.empty_like(codes_sorted)
    codes_kn[order] = codes_sorted
    parts = {"qweight": pack_int32(codes_kn, 0, bits=bits), "qzeros": pack_int32(zero - 1, 1, bits=bits),
             "scales": scale.contiguous(), "g_idx": g_idx}
    return parts, ref.t().contiguous()


def ct_w4a16_tensors(w: torch.Tensor, group: int, perm: torch.Tensor | None = None) -> Quantized:
    """A dense [N, K] weight as compressed-tensors ``pack-quantized`` symmetric int4 tensors
    (weight_packed, weight_scale, weight_shape); with ``perm`` (``actorder: "group"``) inputs
    ``perm[j * group : (j + 1) * group]`` form group ``j``, named by ``weight_g_idx``. Codes
    are ``round(w / scale)`` in -8..7 with ``scale = max |w| / 7`` per group, stored plus 8."""
    n, k = w.shape
    order = perm if perm is not None else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    grouped = w.float()[:, order].reshape(n, k // group, group)  # [N, K / G, G] in group order
    scale = (grouped.abs().amax(-1) / 7).clamp(min=1e-6).half()
    q = torch.round(grouped / scale.float()[..., None]).clamp(-8, 7)
    ref_sorted = (q * scale.float()[..., None]).reshape(n, k)
    ref = torch.empty_like(ref_sorted)
    ref[:, order] = ref_sorted
    codes = torch.empty(n, k, dtype=torch.uint8)
    codes[:, order] = (q + 8).to(torch.uint8).reshape(n, k)
    parts = {"weight_packed": pack_int32(codes, 1), "weight_scale": scale.contiguous(),
             "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if perm is not None:
        parts["weight_g_idx"] = g_idx
    return parts, ref.contiguous()


def fp8_block_tensors(w: torch.Tensor, block: int = 128) -> Quantized:
    """A dense [N, K] weight as ``fp8`` method tensors (weight, weight_scale_inv)."""
    n, k = w.shape
    wf = w.float()
    bn, bk = -(-n // block), -(-k // block)
    padded = torch.zeros(bn * block, bk * block)
    padded[:n, :k] = wf
    amax = padded.reshape(bn, block, bk, block).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    codes = (wf / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale_inv": scale}, codes.float() * full


FORMATS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False,
             "checkpoint_format": "gptq"},
    "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False,
                       "checkpoint_format": "gptq"},
    "gptq-int8": {"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False, "sym": True,
                  "checkpoint_format": "gptq"},
    "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128]},
    # compressed-tensors W4A16 with group act-order: what compressed-tensors < 0.20 wrote (the
    # installed library no longer writes it), by the format's layout (core.quantization.fp8)
    "ct-w4a16-group-actorder": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
            "actorder": "group", "dynamic": False}}}},
}


ORDERED_INT4_WRITERS = {
    "gptq": (gptq_tensors, False),
    "gptq-act-order": (gptq_tensors, True),
    "gptq-int8": (functools.partial(gptq_tensors, bits=8), False),
    "ct-w4a16-group-actorder": (ct_w4a16_tensors, True),
}
"""Formats whose writer takes an input order: (writer, whether the format is act-order)."""


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR_NAMES


def quantize_state(state: dict[str, torch.Tensor], fmt: str, seed: int = 0
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The state dict of a dense checkpoint in format ``fmt`` (a key of :data:`FORMATS`),
    and the dense state dict it stands for (float32 linear weights computed from the
    writer's own codes by the format's definition; other tensors unchanged).

    Act-order GPTQ draws one random input order per distinct input (projections that share
    an input share it, as GPTQ's Hessian ordering does)."""
    group = FORMATS[fmt].get("group_size", 128)  # (128 for every integer format here)
    gen = torch.Generator().manual_seed(seed)
    perms: dict[str, torch.Tensor] = {}
    out, reference = {}, {}
    for name, w in state.items():
        if not _is_linear(name):
            out[name] = reference[name] = w
            continue
        module = name.removesuffix(".weight")
        if fmt == "awq":
            parts, ref = awq_tensors(w, group)
        elif fmt in ORDERED_INT4_WRITERS:
            write, act_order = ORDERED_INT4_WRITERS[fmt]
            perm = None
            if act_order:
                shared = module.rsplit(".", 1)[0] + ("/in" if module.endswith(("q_proj", "k_proj", "v_proj",
                                                                              "gate_proj", "up_proj")) else module)
                perm = perms.setdefault(shared, torch.randperm(w.shape[1], generator=gen))
            parts, ref = write(w, group, perm)
        else:
            parts, ref = fp8_block_tensors(w, FORMATS[fmt]["weight_block_size"][0])
        out.update({f"{module}.{k}": v for k, v in parts.items()})
        reference[name] = ref
    return out, reference


def write_quantized(src: Path, dst: Path, fmt: str, seed: int = 0, reference: Path | None = None) -> Path:
    """Copy the HF checkpoint ``src`` (single safetensors file) to ``dst`` in format ``fmt``;
    with ``reference``, also write there the dense checkpoint the quantized one stands for."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(src / "model.safetensors"))
    quantized, dense = quantize_state(state, fmt, seed)
    config = json.loads((src / "config.json").read_text())
    for out, tensors, qconfig in ((dst, quantized, FORMATS[fmt]), (reference, dense, None)):
        if out is None:
            continue
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
                shutil.copy(f, out / f.name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
        cfg = dict(config, quantization_config=qconfig) if qconfig else dict(config, dtype="float32")
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--format", choices=sorted(FORMATS), required=True)
    ns = p.parse_args()
    write_quantized(ns.src, ns.dst, ns.format)


if __name__ == "__main__":
    main()
