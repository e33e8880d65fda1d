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

import json
from typing import Any

import torch

from core.quantization.base import QuantizationMethod, Weights
from core.quantization.grouping import group_parts
from core.quantization.int4 import act_order_perm, dummy_int4, unpack_int32
from core.quantization.kv_cache import KV_SCALE_SUFFIXES
from core.quantization.tensors import (
    FP8_MAX,
    Fp8Weight,
    IntWeight,
    eight_bit_weight,
    products_exact,
    quantize_fp8_rows,
)

ACTORDER_NONE = (None, False, "weight", "static")
"""compressed-tensors ``actorder`` values whose checkpoints are stored like none: "weight"
(alias "static") changes only how the quantizer walks the columns, the groups stay contiguous."""
ACTORDER_GROUP = ("group", "dynamic", True)
"""``actorder`` values whose checkpoints carry ``weight_g_idx`` (input -> group): written by
compressed-tensors before 0.20 (which removed them), read here, restated in group order."""

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


def four_bit_is_exact(scales: torch.Tensor) -> bool:
    """Whether ``q * s + (-z * s)`` equals ``(q - z) * s`` in float32 for every code q and zero
    point z of 0..15 and every scale s here: true when each scale is finite (with room for the
    products) and has at most 20 significant bits, since then q * s, z * s and (q - z) * s
    (|q - z| <= 15: 4 bits each) need at most 24, all exact, and so is their sum."""
    return products_exact(scales, 4)


class CompressedTensorsMethod(QuantizationMethod):
    """compressed-tensors checkpoints (what llm-compressor writes), in one of two formats for
    the whole model:

    * ``float-quantized``: fp8 e4m3 ``weight`` + ``weight_scale`` per tensor, channel or
      block (``FP8``, ``FP8_DYNAMIC``, ``FP8_BLOCK``);
    * ``pack-quantized`` with 8-bit integer weights (``W8A16``, since session 20): four codes a
      word (``weight_packed [N, K / 4]``, input ``4c + i`` in byte ``i``, stored as ``q + 128``;
      zero points likewise along the outputs), held as int8 codes q with no mins (symmetric:
      the form the CUDA int8 GEMV keeps) or mins ``-z * scale`` where every q * scale and
      z * scale is exact (scales of at most 16 significant bits), else loaded dense, the
      library's ``(q - z) * scale`` rounded once in every case;
    * ``pack-quantized`` with 4-bit integer weights per group or channel (``W4A16``,
      ``W4A16_ASYM``): ``weight_packed`` int32 ``[N, K / 8]`` (input ``8c + i`` in nibble
      ``i`` of word ``c``, stored as ``q + 8`` for the signed code ``q`` in -8..7),
      ``weight_scale`` ``[N, K / G]`` (``[N, 1]`` per channel), ``weight_shape`` ``[N, K]``,
      and when asymmetric ``weight_zero_point`` int32 ``[N / 8, K / G]`` (packed the same way
      along the outputs); ``w = (q - z) * scale`` rounded once, the library's own
      dequantization (checked against it in tests/integration/test_quant_checkpoints.py).
      Restated as a 4-bit :class:`IntWeight` (codes ``q + 8``, ``min = -(z + 8) * scale``,
      what the int4 kernels take, as for AWQ) where that dequantizes to exactly those floats:
      whenever every scale has at most 20 significant bits and is below 2^124
      (:func:`four_bit_is_exact`; fp16 and bf16 scales, what checkpoints store, always are,
      bar bf16 ones of 2^124 or more). Otherwise (float32 scales with more bits) as an 8-bit
      one holding ``q - z`` (-15..15), exact in any case: the CUDA platform then keeps int8
      codes (half of bf16's bytes, not a quarter). The choice is per module; a fused layer
      whose parts differ joins as 8-bit codes (:func:`core.quantization.tensors.cat_rows`).
      Activation order
      ``actorder: "group"`` (GPTQ's desc_act; older compressed-tensors) adds
      ``weight_g_idx`` int32 ``[K]``, input ``c`` in group ``g_idx[c]``: the codes are restated
      in group order with the permutation (:attr:`IntWeight.perm`), as for GPTQ; ``"weight"``
      is stored like none.
    """

    name = "compressed-tensors"
    STRATEGIES = ("tensor", "channel", "block")
    INT_STRATEGIES = ("group", "channel")

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> CompressedTensorsMethod:
        if config is None:
            return super().from_config(config)
        fmt = config.get("format")
        groups = config.get("config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        formats = set()
        for name, group in groups.items():
            fmt_g = group.get("format") or fmt
            formats.add(fmt_g)
            w = group.get("weights") or {}
            if fmt_g == "pack-quantized":
                cls._check_int_group(name, w)
                continue
            if fmt_g != "float-quantized" or w.get("type") != "float" or w.get("num_bits") != 8:
                raise ValueError(
                    f"compressed-tensors group {name!r} is format {fmt_g!r} with {w.get('num_bits')}-bit "
                    f"{w.get('type')} weights; supported: format 'float-quantized' with 8-bit float "
                    f"(fp8 e4m3) weights, or 'pack-quantized' with 4- or 8-bit int weights"
                )
            if w.get("strategy") not in cls.STRATEGIES:
                raise ValueError(
                    f"compressed-tensors group {name!r} has weight strategy {w.get('strategy')!r}; "
                    f"supported: {list(cls.STRATEGIES)}"
                )
            if w.get("symmetric") is False:
                raise ValueError(f"compressed-tensors group {name!r}: asymmetric fp8 weights are not supported")
        if len(formats) > 1:
            raise ValueError(
                f"compressed-tensors groups in several formats ({sorted(formats)}) are not supported; "
                "supported: one format for the whole model"
            )
        int_settings = {json.dumps(g.get("weights"), sort_keys=True) for g in groups.values()}
        if formats == {"pack-quantized"} and len(int_settings) > 1:
            raise ValueError(
                f"compressed-tensors pack-quantized groups with different weight settings "
                f"({sorted(int_settings)}) are not supported; supported: one setting for every group"
            )
        return cls(config)

    @staticmethod
    def _check_int_group(name: str, w: dict[str, Any]) -> None:
        if w.get("type") != "int" or w.get("num_bits") not in (4, 8):
            raise ValueError(
                f"compressed-tensors group {name!r} is pack-quantized with {w.get('num_bits')}-bit "
                f"{w.get('type')} weights; supported: 4-bit int (W4A16) or 8-bit int (W8A16)"
            )
        if w.get("actorder") not in ACTORDER_NONE + ACTORDER_GROUP:
            raise ValueError(
                f"compressed-tensors group {name!r}: activation ordering (actorder "
                f"{w.get('actorder')!r}) is not supported; supported: "
                f"{list(ACTORDER_NONE[1:] + ACTORDER_GROUP)} or none"
            )
        strategy, size = w.get("strategy"), w.get("group_size")
        if w.get("actorder") in ACTORDER_GROUP and strategy != "group":
            raise ValueError(
                f"compressed-tensors group {name!r}: actorder {w.get('actorder')!r} needs the group "
                f"weight strategy, not {strategy!r}"
            )
        if strategy not in CompressedTensorsMethod.INT_STRATEGIES:
            raise ValueError(
                f"compressed-tensors group {name!r} has int weight strategy {strategy!r}; supported: "
                f"{list(CompressedTensorsMethod.INT_STRATEGIES)}"
            )
        if strategy == "group" and (not isinstance(size, int) or size <= 0 or size % 32):
            raise ValueError(
                f"compressed-tensors group {name!r} has group_size {size!r}; supported: a positive "
                "multiple of 32"
            )
        if w.get("dynamic"):
            raise ValueError(f"compressed-tensors group {name!r}: dynamic int weights are not supported")

    @property
    def _int(self) -> bool:
        return any((g.get("format") or self.config.get("format")) == "pack-quantized"
                   for g in self.config["config_groups"].values())

    @property
    def _int_args(self) -> dict[str, Any]:
        """The pack-quantized weight settings (one for every group: from_config checks)."""
        return next(iter(self.config["config_groups"].values()))["weights"]

    @property
    def _int_bits(self) -> int:
        return self._int_args["num_bits"]

    @property
    def _group_actorder(self) -> bool:
        return self._int_args.get("actorder") in ACTORDER_GROUP

    @property
    def _asymmetric(self) -> bool:
        return self._int_args.get("symmetric") is False

    def _int_group(self, cols: int) -> int:
        return cols if self._int_args.get("strategy") == "channel" else self._int_args["group_size"]

    def _block(self) -> tuple[int, int] | None:
        for group in self.config["config_groups"].values():
            w = group.get("weights") or {}
            if w.get("strategy") == "block":
                return tuple(w.get("block_structure") or (128, 128))
        return None

    def describe(self) -> str:
        strategies = sorted({g["weights"]["strategy"] for g in self.config["config_groups"].values()})
        if self._int:
            kind = "asymmetric" if self._asymmetric else "symmetric"
            act = ", group act-order" if self._group_actorder else ""
            return (f"compressed-tensors (pack-quantized int{self._int_bits}, {kind}{act}, per {'/'.join(strategies)} "
                    "weight scales)")
        return f"compressed-tensors (float-quantized fp8, per {'/'.join(strategies)} weight scales)"

    def checkpoint_weights(self, weights: Weights) -> Weights:
        if self._int:
            return self._int_weights(weights)
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

    def _int_weights(self, weights: Weights) -> Weights:
        def build(module: str, p: dict[str, Any]) -> IntWeight | torch.Tensor:
            rows, cols = (int(v) for v in p["weight_shape"].tolist())
            packed, scale = p["weight_packed"], p["weight_scale"]
            group = self._int_group(cols)
            if cols % group or tuple(packed.shape) != (rows, -(-cols // per)) or tuple(scale.shape) != (rows, cols // group):
                raise ValueError(
                    f"{module}: weight_shape [{rows}, {cols}] with group {group} needs weight_packed "
                    f"[{rows}, {-(-cols // per)}] and weight_scale [{rows}, {cols // group}], got "
                    f"{tuple(packed.shape)} and {tuple(scale.shape)}"
                )
            codes = unpack_int32(packed, 1, bits=bits)[:, :cols].to(torch.int16)
            # Group act-order: input c belongs to group weight_g_idx[c]; the codes are put in
            # group order (each group contiguous) and the layer permutes x the same way.
            perm = act_order_perm(module, p.get("weight_g_idx"), cols, group)
            if perm is not None:
                codes = codes[:, perm]
            if asymmetric:
                zero = p["weight_zero_point"]
                if tuple(zero.shape) != (-(-rows // per), cols // group):
                    raise ValueError(
                        f"{module}: weight_zero_point {tuple(zero.shape)}; expected "
                        f"[{-(-rows // per)}, {cols // group}] (packed along the outputs)"
                    )
                z = unpack_int32(zero, 0, bits=bits)[:rows].to(torch.int16)  # [N, K / G], stored as z + offset
            else:
                z = torch.full((rows, cols // group), offset, dtype=torch.int16)
            scale = scale.float()
            if bits == 8:
                return eight_bit_weight(codes - offset, z - offset, scale, group, perm)
            if four_bit_is_exact(scale):  # codes q + 8, min -(z + 8) * scale: the same floats
                mins = -(z.float() * scale)
                return IntWeight(4, codes.to(torch.uint8).contiguous(), scale.contiguous(), mins.contiguous(), group,
                                 perm)
            codes = codes - z.repeat_interleave(group, 1)
            return IntWeight(8, codes.to(torch.int8).contiguous(), scale.contiguous(), None, group, perm)

        asymmetric, bits = self._asymmetric, self._int_bits
        per, offset = 32 // bits, 1 << (bits - 1)  # codes a word; stored as code + offset
        required = ("weight_packed", "weight_scale", "weight_shape") + (("weight_zero_point",) if asymmetric else ())
        if self._group_actorder:
            required += ("weight_g_idx",)
        unused = (".input_scale", ".input_zero_point", ".output_scale", ".output_zero_point", *KV_SCALE_SUFFIXES)
        if not asymmetric:
            unused += (".weight_zero_point",)  # zeros by definition, where a writer keeps them
        # (a weight_g_idx under "weight" act-order or none is read too: it must be the identity
        # or a valid grouping, which act_order_perm checks)
        return group_parts(_drop(weights, unused), required, build, optional=("weight_g_idx",),
                           fmt="compressed-tensors")

    def dummy_weight(self, rows, cols, generator, std) -> Fp8Weight | IntWeight:
        if self._int and self._int_bits == 8:  # a symmetric W8A16 checkpoint's form
            dev = generator.device
            codes = torch.randint(-127, 128, (rows, cols), generator=generator, device=dev).to(torch.int8)
            group = self._int_group(cols)
            return IntWeight(8, codes, torch.full((rows, cols // group), std / 73.3, device=dev), None, group)
        if self._int:  # 4-bit codes with zero point 8: a symmetric checkpoint's 16-bit-scale form
            w = dummy_int4(rows, cols, self._int_group(cols), generator, std)
            return IntWeight(4, w.codes, w.scales, -8 * w.scales, w.group)
        return dummy_fp8(rows, cols, generator, std)


__all__ = ["FP8_MAX", "CompressedTensorsMethod", "Fp8Method", "four_bit_is_exact"]
