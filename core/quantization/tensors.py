"""Quantized linear weights as they leave a checkpoint: two canonical forms every reader
(compressed-tensors, fp8, AWQ, GPTQ, GGUF) converts its tensors into.

* :class:`Fp8Weight`: float8 e4m3 codes with float32 scales per output row and per group of
  ``group`` inputs (per-tensor and per-channel scales have one group per row; the ``fp8``
  method's 128x128 blocks become 128-input groups repeated over each block's rows).
* :class:`IntWeight`: 4- or 8-bit integer codes with float32 scales (and, for asymmetric
  formats, float32 mins) per group of ``group`` inputs: ``w = code * scale + min``. GPTQ's
  act-order keeps its input permutation beside the codes.

Both forms are exact restatements of their checkpoint: every reader derives scales and mins
with float32 operations that introduce no rounding (products of small integers and floats of
at most 20 significant bits, e.g. 16-bit ones), so :meth:`dequantize` in float32 gives the
same numbers as the format's own definition. A form is what a linear layer's loader shards (``narrow``), reorders
(``index_rows``) and joins (:func:`cat_rows`) like a dense weight, before a platform's
linear method packs it for its kernels or dequantizes it into a dense weight.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FP8_MAX = 448.0
"""Largest finite float8 e4m3 (``torch.float8_e4m3fn``) value."""


def _expand(groups: torch.Tensor, group: int, cols: int) -> torch.Tensor:
    """[rows, G] per-group values -> [rows, cols] per-element values."""
    return groups.repeat_interleave(group, dim=1)[:, :cols]


def _narrow_groups(what: str, start: int, length: int, group: int, cols: int) -> tuple[int, int]:
    """(first group, number of groups) of an input-feature slice that must start and end on
    group boundaries (a row-parallel shard of a grouped weight)."""
    end = start + length
    if start % group or (end % group and end != cols):
        raise ValueError(
            f"{what}: cannot split the input features at [{start}, {end}): the checkpoint "
            f"shares one scale per {group} inputs; choose a --tensor-parallel-size for which "
            f"each rank's share of the {cols} inputs is a multiple of {group}"
        )
    return start // group, -(-length // group)


@dataclass(frozen=True)
class Fp8Weight:
    """float8 e4m3 codes ``[rows, cols]`` and float32 ``scales [rows, ceil(cols / group)]``:
    ``w[r, c] = codes[r, c] * scales[r, c // group]``."""

    codes: torch.Tensor
    scales: torch.Tensor
    group: int

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        cols = self.codes.shape[1]
        return (self.codes.float() * _expand(self.scales.float(), self.group, cols)).to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> Fp8Weight:
        if start == 0 and length == self.codes.shape[dim]:
            return self  # one rank takes everything
        if dim == 0:
            return replace(self, codes=self.codes.narrow(0, start, length),
                           scales=self.scales.narrow(0, start, length))
        cols = self.codes.shape[1]
        if self.scales.shape[1] == 1:  # one scale per row: any slice of the inputs keeps it
            return replace(self, codes=self.codes.narrow(1, start, length), group=length)
        first, count = _narrow_groups("fp8 weight", start, length, self.group, cols)
        return replace(self, codes=self.codes.narrow(1, start, length),
                       scales=self.scales.narrow(1, first, count))

    def index_rows(self, index: torch.Tensor) -> Fp8Weight:
        return replace(self, codes=self.codes[index], scales=self.scales[index])

    def regroup(self, group: int) -> Fp8Weight:
        """The same weight with scales per ``group`` inputs (per-row scales repeated)."""
        if self.group == group:
            return self
        if self.scales.shape[1] != 1:
            raise ValueError(f"fp8 weight with {self.group}-input scale groups cannot be regrouped to {group}")
        groups = -(-self.codes.shape[1] // group)
        return replace(self, scales=self.scales.expand(-1, groups).contiguous(), group=group)


@dataclass(frozen=True)
class IntWeight:
    """Integer codes ``[rows, cols]`` (4-bit: uint8 0..15; 8-bit: int8), float32
    ``scales`` and optional float32 ``mins`` ``[rows, cols / group]``:
    ``w[r, c] = codes[r, c] * scales[r, c // group] (+ mins[r, c // group])``.

    ``perm`` (act-order: GPTQ's, compressed-tensors' "group"): column ``j`` of the codes is
    input feature ``perm[j]``, so the layer computes ``x[:, perm] @ dequantized.T``; None
    means the identity.
    """

    bits: int
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group: int
    perm: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def as_signed_int8(self) -> IntWeight | None:
        """This 4-bit weight as 8-bit codes ``code - z`` without mins, where every min is
        ``-z * scale`` for an integer zero point z in 0..15 (else None): the same floats
        wherever ``code * scale + min`` is exact, as for the 4-bit form of compressed-tensors
        W4A16 (core.quantization.fp8.four_bit_is_exact)."""
        if self.bits != 4:
            return None
        z = torch.zeros_like(self.scales.float()) if self.mins is None else integer_zero_points(self.scales,
                                                                                               self.mins, 15)
        if z is None:
            return None
        codes = self.codes.to(torch.int16) - _expand(z, self.group, self.codes.shape[1]).to(torch.int16)
        return IntWeight(8, codes.to(torch.int8), self.scales, None, self.group, self.perm)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight in input-feature order (``perm`` undone)."""
        cols = self.codes.shape[1]
        w = self.codes.float() * _expand(self.scales.float(), self.group, cols)
        if self.mins is not None:
            w += _expand(self.mins.float(), self.group, cols)
        if self.perm is not None:
            out = torch.empty_like(w)
            out[:, self.perm] = w
            w = out
        return w.to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> IntWeight:
        if start == 0 and length == self.codes.shape[dim]:
            return self  # one rank takes everything
        if dim == 0:
            mins = None if self.mins is None else self.mins.narrow(0, start, length)
            return replace(self, codes=self.codes.narrow(0, start, length),
                           scales=self.scales.narrow(0, start, length), mins=mins)
        if self.perm is not None:
            raise ValueError(
                "an act-order weight (GPTQ desc_act, compressed-tensors actorder 'group') cannot be "
                "split along its input features; "
                "run this checkpoint with --tensor-parallel-size 1"
            )
        first, count = _narrow_groups(f"{self.bits}-bit weight", start, length, self.group,
                                      self.codes.shape[1])
        mins = None if self.mins is None else self.mins.narrow(1, first, count)
        return replace(self, codes=self.codes.narrow(1, start, length),
                       scales=self.scales.narrow(1, first, count), mins=mins)

    def index_rows(self, index: torch.Tensor) -> IntWeight:
        mins = None if self.mins is None else self.mins[index]
        return replace(self, codes=self.codes[index], scales=self.scales[index], mins=mins)


QuantizedWeight = Fp8Weight | IntWeight


def integer_zero_points(scales: torch.Tensor, mins: torch.Tensor, limit: int) -> torch.Tensor | None:
    """The zero points z (float32, integers in 0..limit) with ``mins == -z * scales`` exactly in
    float32, or None where the scales are not all finite, any group's min is not such a
    multiple (GGUF Q4_1 and Q4_K have free mins) or a z falls outside 0..limit. A zero scale's
    group takes z = 0 (all its weights are its min, which must then be 0)."""
    s, m = scales.float(), mins.float()
    if not torch.isfinite(s).all():
        return None
    z = torch.where(s == 0, 0.0, -m / s).round()
    if (z < 0).any() or (z > limit).any() or not torch.equal(-(z * s), m):
        return None
    return z


def products_exact(scales: torch.Tensor, bits: int) -> bool:
    """Whether every scale times any integer of ``bits`` bits (magnitude <= 2^bits) is exact in
    float32: the scales are finite with room for the products and have at most 24 - bits
    significant bits."""
    s = scales.float().contiguous()
    return bool(torch.isfinite(s * 2.0**bits).all()) and bool(((s.view(torch.int32) & ((1 << bits) - 1)) == 0).all())


def eight_bit_weight(q: torch.Tensor, z: torch.Tensor, scale: torch.Tensor, group: int,
                     perm: torch.Tensor | None) -> IntWeight | torch.Tensor:
    """Signed 8-bit codes q and zero points z ([N, K] and [N, K / G]; compressed-tensors W8A16,
    GPTQ 8-bit) as the formats' floats (q - z) * scale rounded once: int8 codes without mins
    where every z is 0, with mins -z * scale where every product is exact (then their sum
    rounds once, as the formats' one product does), else the dense float32 weight itself."""
    if bool((z == 0).all()):
        return IntWeight(8, q.to(torch.int8).contiguous(), scale.contiguous(), None, group, perm)
    if products_exact(scale, 8):
        return IntWeight(8, q.to(torch.int8).contiguous(), scale.contiguous(), (-(z.float() * scale)).contiguous(),
                         group, perm)
    w = (q - z.repeat_interleave(group, 1)).float() * scale.repeat_interleave(group, 1)
    if perm is not None:  # back to the checkpoint's input order
        dense = torch.empty_like(w)
        dense[:, perm] = w
        w = dense
    return w


def is_quantized(t: object) -> bool:
    return isinstance(t, (Fp8Weight, IntWeight))


class MixedFusedForms(ValueError):
    """The parts of a fused layer are quantized in forms that cannot be joined exactly (a GGUF
    Q4_K q projection beside a Q8_0 v projection, different group sizes, act-order orders);
    a kept-quantized linear method then runs that layer densely."""


def cat_rows(parts: list[QuantizedWeight], what: str) -> QuantizedWeight:
    """Stack the rows of several quantized weights of one kind (fused q/k/v, gate/up); raises
    :class:`MixedFusedForms` where they cannot be joined exactly."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if any(type(p) is not type(first) or p.shape[1] != first.shape[1] for p in parts):
        raise MixedFusedForms(f"{what}: the fused projections are stored in different quantized forms")
    if isinstance(first, Fp8Weight):
        group = min(p.group for p in parts)
        parts = [p.regroup(group) for p in parts]
        return Fp8Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), group)
    if any(p.bits != first.bits for p in parts):
        # compressed-tensors W4A16 picks 4 or 8 bits per module (by its scales: fp8.py): a fused
        # layer whose parts came out differently joins as 8-bit codes, exact for both
        as_8 = [p if p.bits == 8 else p.as_signed_int8() for p in parts]
        if all(p is not None and p.mins is None for p in as_8):
            parts, first = as_8, as_8[0]
    if any(p.bits != first.bits or p.group != first.group or (p.mins is None) != (first.mins is None)
           for p in parts):
        raise MixedFusedForms(f"{what}: the fused projections use different bit widths or group sizes")
    perms = [p.perm for p in parts]
    if any((q is None) != (perms[0] is None) or (q is not None and not torch.equal(q, perms[0]))
           for q in perms):
        raise MixedFusedForms(
            f"{what}: the fused projections have different act-order permutations (g_idx); "
            "core fuses q/k/v and gate/up, which needs one input order per fused layer"
        )
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])
    return IntWeight(first.bits, torch.cat([p.codes for p in parts]),
                     torch.cat([p.scales for p in parts]), mins, first.group, first.perm)


def quantize_fp8_rows(weight: torch.Tensor) -> Fp8Weight:
    """Per-output-row (per-channel) float8 e4m3 quantization of a dense weight, the
    ``--quantization fp8`` of a bf16/fp32 checkpoint: scale = max |w| of the row / 448."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: codes 0
    codes = (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(codes, scale, w.shape[1])
