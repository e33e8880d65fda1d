"""FP8 (e4m3) weights: the ``fp8`` method and compressed-tensors' ``float-quantized`` format.

Checkpoints (tensor names per linear layer ``X``):

* ``fp8`` with ``weight_block_size: [128, 128]`` (DeepSeek-V3 / Qwen3-FP8 style):
  ``X.weight`` float8_e4m3fn ``[N, K]`` and ``X.weight_scale_inv`` float32
  ``[ceil(N / 128), ceil(K / 128)]``, ``w = code * scale_inv[n // 128, k // 128]`` (despite the
  name the tensor multiplies). Without ``weight_block_size``: ``X.weight_scale``, one scale
  per tensor.
* ``compressed-tensors`` ``format: float-quantized`` (what llm-compressor writes):
  ``X.weight`` float8_e4m3fn and ``X.weight_scale`` ``[1]`` (strategy ``tensor``) or
  ``[N, 1]`` (``channel``) or ``[ceil(N / bn), ceil(K / bk)]`` (``block``), symmetric (a
  ``weight_zero_point``, when written, is zero).

Activation scales in the checkpoint (``X.input_scale``, static per tensor) are not used: the
CUDA kernels quantize activations per token from their own range while running (at least
as accurate as one static scale), and the CPU platform multiplies unquantized activations.

Without a checkpoint config (``--quantization fp8`` on a bf16/fp32 checkpoint) every linear
weight is quantized per output channel while it loads (:func:`quantize_fp8_rows`).
"""

from __future__ import annotations

from typing import Any

import torch

from core.quantization.base import QuantizationMethod, Weights
from core.quantization.grouping import group_parts
from core.quantization.kv_cache import KV_SCALE_SUFFIXES
from core.quantization.tensors import FP8_MAX, Fp8Weight, quantize_fp8_rows

_FP8 = (torch.float8_e4m3fn,)


def _is_fp8_weight(part: str, tensor: Any) -> bool:
    return part != "weight" or getattr(tensor, "dtype", None) in _FP8


def block_scales_to_groups(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], what: str) -> Fp8Weight:
    """``[ceil(N / bn), ceil(K / bk)]`` block scales as per-row scales of ``bk``-input groups
    (each block row repeated over its ``bn`` rows: the same numbers, row-sliceable)."""
    rows, cols = codes.shape
    bn, bk = block
    want = (-(-rows // bn), -(-cols // bk))
    if tuple(scales.shape) != want:
        raise ValueError(
            f"{what}: block scales have shape {tuple(scales.shape)}, but a [{rows}, {cols}] weight "
            f"in {bn}x{bk} blocks needs {want}; the checkpoint does not match its config"
        )
    per_row = scales.float().repeat_interleave(bn, dim=0)[:rows].contiguous()
    return Fp8Weight(codes, per_row, bk)


def tensor_or_channel_scales(codes: torch.Tensor, scale: torch.Tensor, what: str) -> Fp8Weight:
    """A per-tensor (one value) or per-channel (``[N]`` / ``[N, 1]``) scale as per-row scales."""
    rows, cols = codes.shape
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        s = s.expand(rows)
    elif s.numel() != rows:
        raise ValueError(
            f"{what}: weight_scale has {s.numel()} values; a [{rows}, {cols}] weight needs 1 "
            f"(per tensor) or {rows} (per channel)"
        )
    return Fp8Weight(codes, s.reshape(rows, 1).contiguous(), cols)


def _drop(weights: Weights, suffixes: tuple[str, ...]) -> Weights:
    return ((n, t) for n, t in weights if not n.endswith(suffixes))


def dummy_fp8(rows: int, cols: int, generator: torch.Generator, std: float) -> Fp8Weight:
    """A random N(0, std) weight quantized per channel (``--load-format dummy``)."""
    w = torch.empty(rows, cols, device=generator.device).normal_(0.0, std, generator=generator)
    return quantize_fp8_rows(w)


class Fp8Method(QuantizationMethod):
    """``quant_method: fp8`` checkpoints, and ``--quantization fp8`` on a dense checkpoint."""

    name = "fp8"

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> Fp8Method:
        if config is None:
            return cls(None)  # on-load quantization
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 checkpoint with fmt {fmt!r} is not supported; supported: e4m3")
        block = config.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) <= 0):
            raise ValueError(f"fp8 weight_block_size {block!r} must be two positive sizes, e.g. [128, 128]")
        return cls(config)

    @property
    def on_load(self) -> bool:
        return not self.config

    @property
    def quantizes_on_load(self) -> bool:
        return self.on_load

    def describe(self) -> str:
        if self.on_load:
            return "fp8 (quantized on load: per-channel weight scales)"
        block = self.config.get("weight_block_size")
        return f"fp8 ({'x'.join(map(str, block)) + ' block' if block else 'per-tensor'} weight scales)"

    def checkpoint_weights(self, weights: Weights) -> Weights:
        if self.on_load:
            return weights
        block = self.config.get("weight_block_size")
        # KV cache scales are read by core.quantization.kv_cache, not loaded as weights
        weights = _drop(weights, (".input_scale", ".activation_scale", *KV_SCALE_SUFFIXES))
        if block:
            def build(module: str, p: dict[str, Any]) -> Fp8Weight:
                return block_scales_to_groups(p["weight"], p["weight_scale_inv"], tuple(block), module)

            return group_parts(weights, ("weight", "weight_scale_inv"), build, member=_is_fp8_weight, fmt="fp8")

        def build_tensor(module: str, p: dict[str, Any]) -> Fp8Weight:
            return tensor_or_channel_scales(p["weight"], p["weight_scale"], module)

        return group_parts(weights, ("weight", "weight_scale"), build_tensor, member=_is_fp8_weight, fmt="fp8")

    def quantize_dense(self, weight: torch.Tensor) -> Fp8Weight | None:
        # On-load quantization quantizes every linear layer; an fp8 checkpoint keeps the
        # layers it left unquantized (config "ignored_layers") dense.
        return quantize_fp8_rows(weight) if self.on_load else None

    def dummy_weight(self, rows, cols, generator, std) -> Fp8Weight:
        return dummy_fp8(rows, cols, generator, std)


class CompressedTensorsMethod(QuantizationMethod):
    """compressed-tensors checkpoints in the ``float-quantized`` format (8-bit float weights,
    per tensor, channel or block)."""

    name = "compressed-tensors"
    STRATEGIES = ("tensor", "channel", "block")

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> CompressedTensorsMethod:
        if config is None:
            return super().from_config(config)
        fmt = config.get("format")
        groups = config.get("config_groups") or {}
        for name, group in groups.items():
            fmt_g = group.get("format") or fmt
            w = group.get("weights") or {}
            if fmt_g != "float-quantized" or w.get("type") != "float" or w.get("num_bits") != 8:
                raise ValueError(
                    f"compressed-tensors group {name!r} is format {fmt_g!r} with {w.get('num_bits')}-bit "
                    f"{w.get('type')} weights; supported: format 'float-quantized' with 8-bit float "
                    f"(fp8 e4m3) weights"
                )
            if w.get("strategy") not in cls.STRATEGIES:
                raise ValueError(
                    f"compressed-tensors group {name!r} has weight strategy {w.get('strategy')!r}; "
                    f"supported: {list(cls.STRATEGIES)}"
                )
            if w.get("symmetric") is False:
                raise ValueError(f"compressed-tensors group {name!r}: asymmetric fp8 weights are not supported")
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        return cls(config)

    def _block(self) -> tuple[int, int] | None:
        for group in self.config["config_groups"].values():
            w = group.get("weights") or {}
            if w.get("strategy") == "block":
                return tuple(w.get("block_structure") or (128, 128))
        return None

    def describe(self) -> str:
        strategies = sorted({g["weights"]["strategy"] for g in self.config["config_groups"].values()})
        return f"compressed-tensors (float-quantized fp8, per {'/'.join(strategies)} weight scales)"

    def checkpoint_weights(self, weights: Weights) -> Weights:
        block = self._block()
        weights = _drop(weights, (".input_scale", ".input_zero_point", ".weight_zero_point",
                                  ".output_scale", ".output_zero_point", *KV_SCALE_SUFFIXES))

        def build(module: str, p: dict[str, Any]) -> Fp8Weight:
            codes, scale = p["weight"], p["weight_scale"]
            if block is not None and scale.dim() == 2 and scale.shape[1] > 1:
                return block_scales_to_groups(codes, scale, block, module)
            return tensor_or_channel_scales(codes, scale, module)

        return group_parts(weights, ("weight", "weight_scale"), build, member=_is_fp8_weight,
                           fmt="compressed-tensors")

    def dummy_weight(self, rows, cols, generator, std) -> Fp8Weight:
        return dummy_fp8(rows, cols, generator, std)


__all__ = ["FP8_MAX", "CompressedTensorsMethod", "Fp8Method"]
