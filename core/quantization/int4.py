"""Integer weight-only checkpoints: AWQ (4-bit, GEMM packing) and GPTQ (4- or 8-bit, with or
without act-order).

Both store, per linear layer ``X`` with K inputs and N outputs, 4-bit codes packed eight to
an int32, float16 scales and packed 4-bit zero points per group of G inputs (G is
``group_size``, usually 128), and dequantize as ``w[k, n] = (q[k, n] - z[g, n]) * s[g, n]``.
They differ in the packing:

* AWQ (AutoAWQ ``WQLinear_GEMM``, awq/modules/linear/gemm.py; ``version: gemm``):
  ``X.qweight`` int32 ``[K, N / 8]`` and ``X.qzeros`` int32 ``[K / G, N / 8]`` are packed
  along the outputs, nibble ``i`` of word ``c`` holding output ``8c + (0, 2, 4, 6, 1, 3, 5,
  7)[i]``; ``X.scales`` float16 ``[K / G, N]``; ``g = k // G``.
* GPTQ (AutoGPTQ / GPTQModel ``checkpoint_format: gptq``): ``X.qweight`` int32 ``[K / 8, N]``
  packed along the inputs (nibble ``i`` of row ``r`` is input ``8r + i``); ``X.qzeros``
  int32 ``[K / G, N / 8]`` packed along the outputs in plain nibble order, storing ``z - 1``
  (``gptq_v2`` stores ``z``); ``X.scales`` float16 ``[K / G, N]``; ``X.g_idx`` int32 ``[K]``
  the group of each input: ``k // G`` without act-order, a permutation of it with
  ``desc_act: true``.

Both are restated as :class:`~core.quantization.tensors.IntWeight` ``[N, K]`` with
``scale = s`` and ``min = -z * s`` (exact in float32). For act-order GPTQ the inputs are
sorted by group so each group is contiguous, and the order is kept as ``perm``.

8-bit GPTQ (``bits: 8``, e.g. the GPTQ-Int8 releases) packs four codes to an int32 the same
ways (byte ``i`` of qweight row ``r`` is input ``4r + i``; qzeros four zero points a word,
``z - 1`` in v1). It becomes 8-bit codes ``q - 128`` (int8) with ``min = (128 - z) * s``, or
no mins where every ``z`` is 128 (``sym: true``): the same floats, exactly (every product and
sum fits float32's 24 bits), in the form the CUDA int8 GEMV keeps (without mins) or the
platforms dequantize (with them).
"""

from __future__ import annotations

from typing import Any

import torch

from core.quantization.base import QuantizationMethod, Weights
from core.quantization.grouping import group_parts
from core.quantization.tensors import IntWeight, eight_bit_weight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ's nibble order: nibble i of a packed word holds output 8c + AWQ_ORDER[i]."""


def unpack_int32(packed: torch.Tensor, dim: int, order: tuple[int, ...] | None = None, bits: int = 4) -> torch.Tensor:
    """int32 words holding 32 / bits values (4 or 8 bits) -> uint8 codes, that many times longer
    along ``dim``; ``order[i]`` is the position (within its word) of value i (None: i)."""
    words = packed.to(torch.int32)
    per = 32 // bits
    nibbles = torch.stack([(words >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], dim=-1)  # [..., per]
    if order is not None:
        inverse = [order.index(p) for p in range(per)]
        nibbles = nibbles[..., inverse]
    nibbles = nibbles.to(torch.uint8)
    if dim in (-1, packed.dim() - 1):
        return nibbles.flatten(-2)
    return nibbles.movedim(-1, dim + 1).flatten(dim, dim + 1)


def _int_weight(q_kn: torch.Tensor, z_gn: torch.Tensor, s_gn: torch.Tensor, group: int,
                perm: torch.Tensor | None = None, bits: int = 4) -> IntWeight | torch.Tensor:
    """IntWeight [N, K] from codes [K, N], zero points and scales [K / G, N] (8 bits: codes
    q - 128, mins (128 - z) * s, none where every z is 128; module docstring)."""
    scales = s_gn.float().t().contiguous()
    if bits == 8:
        return eight_bit_weight(q_kn.t().to(torch.int16) - 128, z_gn.t().to(torch.int16) - 128, scales, group, perm)
    return IntWeight(4, q_kn.t().contiguous(), scales, (-(z_gn.float().t() * scales)).contiguous(), group, perm)


def _check_bits(method: str, config: dict[str, Any], key: str = "bits", supported: tuple[int, ...] = (4,)) -> int:
    bits = config.get(key, config.get("w_bit"))
    if bits not in supported:
        raise ValueError(f"{method} checkpoint with {bits}-bit weights is not supported; supported: "
                         + ", ".join(f"{b}-bit" for b in supported))
    group = config.get("group_size", config.get("q_group_size", 128))
    if not isinstance(group, int) or group <= 0 or group % 32:
        raise ValueError(
            f"{method} group_size {group!r} is not supported; supported: a positive multiple of 32 "
            "(per-channel checkpoints, group_size -1, are not)"
        )
    return group


class AwqMethod(QuantizationMethod):
    """AWQ 4-bit checkpoints, GEMM packing (``version: gemm``)."""

    name = "awq"
    aliases = ("awq_marlin",)

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> AwqMethod:
        if config is None:
            return super().from_config(config)
        _check_bits("AWQ", config)
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported; supported: gemm")
        if config.get("zero_point", True) is False:
            raise ValueError("AWQ without zero points (zero_point: false) is not supported")
        return cls(config)

    @property
    def group(self) -> int:
        return self.config.get("group_size", self.config.get("q_group_size", 128))

    def describe(self) -> str:
        return f"awq (4-bit, group {self.group}, GEMM packing)"

    def checkpoint_weights(self, weights: Weights) -> Weights:
        def build(module: str, p: dict[str, Any]) -> IntWeight:
            q = unpack_int32(p["qweight"], 1, AWQ_ORDER)  # [K, N]
            z = unpack_int32(p["qzeros"], 1, AWQ_ORDER)  # [K / G, N]
            _check_shapes(module, q, z, p["scales"], self.group)
            return _int_weight(q, z, p["scales"], self.group)

        return group_parts(weights, ("qweight", "qzeros", "scales"), build, fmt="AWQ")

    def dummy_weight(self, rows, cols, generator, std) -> IntWeight:
        return dummy_int4(rows, cols, self.group, generator, std)


class GptqMethod(QuantizationMethod):
    """GPTQ 4- and 8-bit checkpoints (``checkpoint_format`` gptq or gptq_v2, ``desc_act`` either)."""

    name = "gptq"
    aliases = ("gptq_marlin",)

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> GptqMethod:
        if config is None:
            return super().from_config(config)
        _check_bits("GPTQ", config, supported=(4, 8))
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2")
        return cls(config)

    @property
    def group(self) -> int:
        return self.config.get("group_size", 128)

    @property
    def bits(self) -> int:
        return self.config.get("bits", 4)

    def describe(self) -> str:
        act = "act-order" if self.config.get("desc_act") else "no act-order"
        return f"gptq ({self.bits}-bit, group {self.group}, {act})"

    def checkpoint_weights(self, weights: Weights) -> Weights:
        v1 = self.config.get("checkpoint_format", "gptq") == "gptq"
        required = ("qweight", "qzeros", "scales") + (("g_idx",) if self.config.get("desc_act") else ())

        bits = self.bits

        def build(module: str, p: dict[str, Any]) -> IntWeight:
            q = unpack_int32(p["qweight"], 0, bits=bits)  # [K, N]
            z = unpack_int32(p["qzeros"], 1, bits=bits).to(torch.int16) + (1 if v1 else 0)  # [K / G, N]
            _check_shapes(module, q, z, p["scales"], self.group)
            perm = act_order_perm(module, p.get("g_idx"), q.shape[0], self.group)
            if perm is not None:
                q = q[perm]
            return _int_weight(q, z, p["scales"], self.group, perm, bits)

        return group_parts(weights, required, build, optional=("g_idx",), fmt="GPTQ")

    def dummy_weight(self, rows, cols, generator, std) -> IntWeight:
        if self.bits == 8:
            dev = generator.device
            codes = torch.randint(-127, 128, (rows, cols), generator=generator, device=dev).to(torch.int8)
            scales = torch.full((rows, cols // self.group), std / 73.3, device=dev)  # uniform -127..127: std ~73.3
            return IntWeight(8, codes, scales, None, self.group)
        return dummy_int4(rows, cols, self.group, generator, std)


def _check_shapes(module: str, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group: int) -> None:
    k, n = q.shape
    if k % group or tuple(z.shape) != (k // group, n) or tuple(s.shape) != (k // group, n):
        raise ValueError(
            f"{module}: codes [{k}, {n}] need zero points and scales [{k // group}, {n}] for group "
            f"size {group}, got {tuple(z.shape)} and {tuple(s.shape)}; check group_size in config.json"
        )


def act_order_perm(module: str, g_idx: torch.Tensor | None, k: int, group: int) -> torch.Tensor | None:
    """The input order that makes each group contiguous (None when it already is)."""
    if g_idx is None:
        return None
    g = g_idx.to(torch.int64)
    if g.shape != (k,):
        raise ValueError(f"{module}.g_idx has shape {tuple(g.shape)}; expected [{k}]")
    if torch.equal(g, torch.arange(k) // group):
        return None
    if g.min() < 0:  # (e.g. -1: compressed-tensors' value before calibration)
        raise ValueError(f"{module}.g_idx holds {int(g.min())}; group indices must be >= 0")
    counts = torch.bincount(g, minlength=k // group)
    if counts.numel() != k // group or not bool((counts == group).all()):
        raise ValueError(f"{module}.g_idx does not put exactly {group} inputs in each of {k // group} groups")
    return torch.sort(g, stable=True).indices


def dummy_int4(rows: int, cols: int, group: int, generator: torch.Generator, std: float) -> IntWeight:
    """Random codes and zero points with scales giving weights of about N(0, std) spread."""
    dev = generator.device  # drawn where the generator lives (the GPU for an 8B benchmark)
    codes = torch.randint(0, 16, (rows, cols), generator=generator, dtype=torch.uint8, device=dev)
    zeros = torch.randint(7, 9, (rows, cols // group), generator=generator, device=dev).float()
    scales = torch.full((rows, cols // group), std / 4.6, device=dev)  # uniform 0..15 around 8: std ~4.6
    return IntWeight(4, codes, scales, -zeros * scales, group)
