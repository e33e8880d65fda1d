"""CPU weight formats (``--weight-format``): weight-only quantized matmuls for small steps.

A decode step of a few sequences multiplies a handful of activation rows by every weight of
the model, so it is bound by reading the weights: torch's weight-only int4 / int8 CPU
kernels read 4x / 2x fewer bytes than bf16 and beat oneDNN's bf16 GEMV by 3-4x at one row
(docs/benchmarks/cpu.md). With many rows (prompts, large decode batches) the multiply is
compute-bound and oneDNN's bf16 GEMM wins, so each format keeps the layer's dense weight
too and picks per call by the number of rows. Activations go to the quantized kernels as
bf16 (they take nothing else); the result returns in the model dtype.

Formats:

* ``int4``: groups of 32 input features share a bf16 scale and zero point (asymmetric, codes
  0..15). A GGUF Q4_1 checkpoint (the embedded SmolLM2) already lies on such a grid, its
  blocks spanning codes 0 to 15, so its codes come back exactly and only the scales are
  rounded to bf16.
* ``int8``: one bf16 scale per output row (symmetric, codes -127..127).

A float32 model takes another kernel (csrc/cpu/quant_linear.cpp, whichever ISA path the CPU
runs: AVX2, AVX-512, NEON or portable): weights in groups of 32 with fp32 scales
(:class:`GroupedQuant`; int4 with a min per group, GGUF Q4_1's grid; int8 symmetric, GGUF
Q8_0's grid), activations quantized per group of 32 to int8 for integer dot products,
accumulation in fp32, and no bf16 anywhere: on CPUs without native bf16 instructions
torch's bf16 paths are emulated and slower than float32.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core.models.layers import LinearMethod, hold_packed_tensors
from platforms.cpu.isa import isa_in_force
from platforms.cpu.kernels import kernels_or_none
from platforms.cpu.row_buckets import bucketed_linear


@dataclass(frozen=True)
class PackedInt4:
    weight: torch.Tensor
    """[out, in / 2] uint8, torch's CPU int4 layout (_convert_weight_to_int4pack_for_cpu)."""
    scales_and_zeros: torch.Tensor
    """[in / 32, out, 2] bf16: w = (code - 8) * scale + zero."""


@dataclass(frozen=True)
class PackedInt8:
    weight: torch.Tensor
    """[out, in] int8."""
    scales: torch.Tensor
    """[out] bf16: w = code * scale."""


@dataclass(frozen=True)
class GroupedQuant:
    """Weights of a float32 layer for csrc/cpu's ``quant_linear`` (groups of 32 inputs)."""

    bits: int
    codes: torch.Tensor
    """int4: [out, in / 2] uint8, per group element j in the low nibble of byte j and
    element j + 16 in its high nibble; int8: [out, in] int8."""
    scales: torch.Tensor
    """[out, in / 32] float32, or float16 where every scale (and min) is a float16 value
    (GGUF's blocks store them so: see :func:`compact_scales`)."""
    mins: torch.Tensor | None
    """int4: [out, in / 32] of the scales' dtype, w = code * scale + min; int8: None,
    w = code * scale."""

    def dequantize(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The float32 weight rows [start, stop) these codes stand for."""
        rows = slice(start, stop)
        scales = self.scales[rows, :, None].float()
        if self.bits == 8:
            return (self.codes[rows].float().unflatten(1, (-1, GROUP)) * scales).flatten(1)
        low, high = self.codes[rows] & 15, self.codes[rows] >> 4
        codes = torch.cat([low.unflatten(1, (-1, 16)), high.unflatten(1, (-1, 16))], dim=-1).float()
        return (codes * scales + self.mins[rows, :, None].float()).flatten(1)

    def reproduces(self, weight: torch.Tensor) -> bool:
        """Whether the codes stand for exactly ``weight`` (checked in row chunks)."""
        return all(
            torch.equal(self.dequantize(s, s + _GROUP_ROWS), weight[s : s + _GROUP_ROWS])
            for s in range(0, weight.shape[0], _GROUP_ROWS)
        )


GROUP = 32
"""Input features per scale of :class:`GroupedQuant`."""
ACT_INT8 = 1
"""``quant_linear``'s activation mode: 1 quantizes activations to int8 per group of 32 and
takes integer dot products; 0 dequantizes the weights to fp32 in registers. Mode 1 measured
faster on AVX2 at every row count from 1 to 4,096 (1.1-1.8x for int4; docs/benchmarks/cpu.md)."""

GROUPED_MAX_ROWS = 64
"""Most activation rows a float32 layer multiplies through ``quant_linear`` on a path without
the many-row kernel (NEON, portable); larger steps (prompts) take the dense weight there. Their
tile kernel against a float32 GEMM was measured on the AVX2 path before it had panels: 2-6x
faster at 1 row, level at 32-64 rows, 20-30 % slower from 128 rows (docs/benchmarks/cpu.md)."""

PANEL_PATHS = ("avx2", "avx512")
"""ISA paths whose ``quant_linear`` has the many-row panel kernel (csrc/cpu/quant_gemm.cpp). With
int4 codes it beats oneDNN's float32 GEMM at every row count measured (single core, SmolLM2's
shapes: 1.5-1.8x from 128 to 4,096 rows; docs/benchmarks/cpu.md), so int4 layers there take
their codes for every step, prompts included: prompts then see the int8 activation rounding
that decode steps and prompts of up to GROUPED_MAX_ROWS tokens always had. With int8 codes it
is only level with oneDNN from 128 rows (0.9-1.1x), so those keep the exact dense product."""


def grouped_takes(rows: int, bits: int) -> bool:
    """Whether a float32 step of ``rows`` activation rows multiplies by ``bits``-bit codes."""
    return 0 < rows and (rows <= GROUPED_MAX_ROWS or (bits == 4 and isa_in_force() in PANEL_PATHS))


def group_int4(weight: torch.Tensor) -> GroupedQuant:
    """Asymmetric 4-bit codes per 32 inputs (a GGUF Q4_1 weight's own codes come back)."""
    n, k = weight.shape
    out = GroupedQuant(4, torch.empty(n, k // 2, dtype=torch.uint8), torch.empty(n, k // GROUP),
                       torch.empty(n, k // GROUP))
    for start in range(0, n, _GROUP_ROWS):  # row chunks: small temporaries while loading
        w = weight[start : start + _GROUP_ROWS].float().unflatten(1, (-1, GROUP))
        low, high = w.amin(-1), w.amax(-1)
        scale = (high - low) / 15
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: code 0
        codes = torch.round((w - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
        out.codes[start : start + _GROUP_ROWS] = (codes[..., :16] | (codes[..., 16:] << 4)).flatten(1)
        out.scales[start : start + _GROUP_ROWS] = scale
        out.mins[start : start + _GROUP_ROWS] = low
    return compact_scales(out)


def group_int8(weight: torch.Tensor) -> GroupedQuant:
    """Symmetric 8-bit codes per 32 inputs (a GGUF Q8_0 weight's own codes come back)."""
    n, k = weight.shape
    out = GroupedQuant(8, torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // GROUP), None)
    for start in range(0, n, _GROUP_ROWS):
        w = weight[start : start + _GROUP_ROWS].float().unflatten(1, (-1, GROUP))
        scale = w.abs().amax(-1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(w / scale[..., None]).clamp_(-127, 127).to(torch.int8)
        out.codes[start : start + _GROUP_ROWS] = codes.flatten(1)
        out.scales[start : start + _GROUP_ROWS] = scale
    return compact_scales(out)


def compact_scales(q: GroupedQuant) -> GroupedQuant:
    """``q`` with float16 scales and mins when every one of them is a float16 value (the same
    numbers, so every product is unchanged), else ``q``. A GGUF checkpoint stores them as
    float16: an int4 weight then takes 0.625 bytes instead of 0.75, and a decode step, which
    reads every weight once, reads ~13 % fewer bytes for the embedded SmolLM2."""
    parts = [q.scales] if q.mins is None else [q.scales, q.mins]
    halves = [p.half() for p in parts]
    if not all(torch.equal(h.float(), p) for h, p in zip(halves, parts)):
        return q
    return GroupedQuant(q.bits, q.codes, halves[0], halves[1] if q.mins is not None else None)


_GROUP_ROWS = 4096
"""Rows quantized at a time by :func:`group_int4` / :func:`group_int8`."""


def grouped_matmul(kernels, x: torch.Tensor, packed: GroupedQuant, act_mode: int = ACT_INT8) -> torch.Tensor:
    """x [rows, in] float32 (contiguous rows) @ the packed weight^T -> [rows, out] float32."""
    out = torch.empty((x.shape[0], packed.codes.shape[0]), dtype=torch.float32)
    kernels.quant_linear(out, x, packed.codes, packed.scales, packed.mins, packed.bits, act_mode)
    return out


_PACK_ROWS = 64
"""Rows quantized at a time (torch's int4 CPU packing works in blocks of 64 rows)."""

_STAY_DENSE = "stay-dense"
"""``packed_weight`` of a layer whose shape the format cannot pack: it multiplies densely."""


class QuantizedLinear(LinearMethod):
    """Quantized weights (by ``codec``) for steps of at most ``codec.max_rows`` activation
    rows; the dense weight for larger steps."""

    def __init__(self, codec: Int4Codec | Int8Codec):
        self.codec = codec
        self.name = codec.name

    def prepare(self, layer: nn.Module) -> None:
        weight = layer.weight.detach()
        if is_released(layer):  # the codes are the weight (a bias load reset packed_weight)
            layer.packed_weight = layer.released_to
            return
        kernels = kernels_or_none() if weight.dtype == torch.float32 else None
        if kernels is not None:  # float32 model: the csrc/cpu kernel, no bf16 round trip
            if not (weight.dim() == 2 and weight.shape[1] % GROUP == 0):
                layer.packed_weight = _STAY_DENSE
                _hold_packed(layer, None)
                return
            packed = layer.packed_weight = self.codec.group(weight)
            _hold_packed(layer, packed)
            if _kernel_reproduces(kernels, packed, weight):
                _release_dense(layer)
            return
        packed = self.codec.quantize(weight)
        layer.packed_weight = _STAY_DENSE if packed is None else packed
        _hold_packed(layer, packed)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if layer.packed_weight is None:
            self.prepare(layer)
        packed = layer.packed_weight
        if isinstance(packed, GroupedQuant):
            if x.dtype == torch.float32 and grouped_takes(rows, packed.bits):
                return self._apply_grouped(x, bias, packed, rows, k)
            if is_released(layer):  # prompts: the exact weight, dequantized chunk by chunk
                return dequantized_linear(kernels_or_none(), x, packed, bias)
            return bucketed_linear(x, layer.weight, bias)
        if rows == 0 or packed is _STAY_DENSE or rows > self.codec.max_rows:
            return bucketed_linear(x, layer.weight, bias)
        # A decode step's activations are already 2-D contiguous bf16: no conversion calls.
        plain = x.dim() == 2 and x.dtype == torch.bfloat16 and x.is_contiguous()
        y = self.codec.matmul(x if plain else x.reshape(rows, k).to(torch.bfloat16).contiguous(), packed)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if bias is not None:
            y = y + bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])

    def prepare_embedding(self, layer: nn.Module) -> None:
        """A float32 table whose int8 codes give it back bit for bit (a GGUF Q8_0 embedding, the
        embedded SmolLM2's, tied to its LM head) drops its dense copy for them: lookups
        dequantize the rows they read (:meth:`embed`), the LM head multiplies by the codes
        (``CpuOps.lm_head``), which it does under a quantized format anyway."""
        weight = layer.weight.detach()
        if released_codes(layer.weight) is not None or weight.dtype != torch.float32 or weight.dim() != 2:
            return
        kernels = kernels_or_none()
        if kernels is None or weight.shape[1] % GROUP or weight.numel() == 0:
            return
        packed = group_int8(weight)
        if _kernel_reproduces(kernels, packed, weight):
            layer.weight.released_to = packed  # on the parameter: a tied LM head shares it
            layer.weight.data = torch.empty(0, dtype=weight.dtype)
            _hold_packed(layer, packed)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        packed = released_codes(layer.weight)
        if packed is None:
            return F.embedding(ids, layer.weight)
        flat = ids.reshape(-1)
        out = torch.empty((flat.numel(), packed.codes.shape[1]), dtype=torch.float32)
        kernels_or_none().quant_dequantize(out, packed.codes.index_select(0, flat),
                                           packed.scales.index_select(0, flat), None, packed.bits)
        return out.view(*ids.shape, out.shape[1])

    def _apply_grouped(self, x, bias, packed: GroupedQuant, rows: int, k: int) -> torch.Tensor:
        flat = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(rows, k).contiguous()
        y = grouped_matmul(kernels_or_none(), flat, packed)
        if bias is not None:
            y += bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


# ---- float32 layers without their dense weight ---------------------------------------------
# A float32 layer's codes that reproduce its dense weight bit for bit (every layer of a GGUF
# Q4_1 / Q8_0 checkpoint) make the dense copy redundant: it goes, and steps of more than
# GROUPED_MAX_ROWS rows (prompts) on a path without panels multiply by the weight dequantized again, a chunk of rows at a
# time, through the same dense GEMM, so their results do not change by a bit. That halves the
# embedded SmolLM2's resident weights (docs/benchmarks/cpu.md); dequantizing costs ~1 % of a
# prompt step's GEMM time.

_DEQUANT_ROWS = 4096
"""Weight rows dequantized at a time (SmolLM2's layers in one chunk; bounds the scratch for
larger models to 4,096 x in_features floats per thread)."""
_SCRATCH = threading.local()
"""Per thread (tensor-parallel ranks may run as threads): the reused dequantization buffer."""


def released_codes(weight: torch.Tensor) -> GroupedQuant | None:
    """The codes an embedding table (``weight``, shared with a tied LM head) was released
    for by :meth:`QuantizedLinear.prepare_embedding`, or None while it is dense."""
    return getattr(weight, "released_to", None)


def is_released(layer: nn.Module) -> bool:
    """Whether the layer's dense weight was dropped for its exact codes (see above)."""
    return getattr(layer, "released_to", None) is not None


def _hold_packed(layer: nn.Module, packed: object | None) -> None:
    """The layer's packed weight as buffers (core.models.layers.hold_packed_tensors), so the
    engine's weight count sees a released layer's codes (the embedded SmolLM2 logged "weights
    2.1 MiB" before; its codes are ~92 MiB, 94 MiB in all). Prefix ``held_``, not ``packed_``
    as in KeptQuantizedLinear: PackedInt4's ``weight`` field would collide with the layer's
    ``packed_weight`` attribute."""
    hold_packed_tensors(layer, packed, "held_")


def _release_dense(layer: nn.Module) -> None:
    """Drop the dense weight for ``layer.packed_weight``, kept as ``layer.released_to``. The
    weight parameter stays, empty: loading a new weight into it fails the shape check (a
    released layer cannot take new weights; load a fresh model)."""
    layer.released_to = layer.packed_weight
    layer.weight.data = torch.empty(0, dtype=layer.weight.dtype)


def _scratch(rows: int, k: int) -> torch.Tensor:
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < rows * k:
        buf = _SCRATCH.buf = torch.empty(rows * k)
    return buf[: rows * k].view(rows, k)


def _dequantize_rows(kernels, packed: GroupedQuant, start: int, stop: int) -> torch.Tensor:
    """Weight rows [start, stop) in the thread's scratch buffer (valid until its next use)."""
    out = _scratch(stop - start, packed.scales.shape[1] * GROUP)
    mins = None if packed.mins is None else packed.mins[start:stop]
    kernels.quant_dequantize(out, packed.codes[start:stop], packed.scales[start:stop], mins, packed.bits)
    return out


def _kernel_reproduces(kernels, packed: GroupedQuant, weight: torch.Tensor) -> bool:
    """Whether ``quant_dequantize`` gives back exactly ``weight`` (what prompts would use)."""
    return all(
        torch.equal(_dequantize_rows(kernels, packed, s, min(s + _DEQUANT_ROWS, weight.shape[0])),
                    weight[s : s + _DEQUANT_ROWS])
        for s in range(0, weight.shape[0], _DEQUANT_ROWS)
    )


def dequantized_linear(kernels, x: torch.Tensor, packed: GroupedQuant, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + bias`` for a released layer: W dequantized a chunk of rows at a time."""
    n, k = packed.codes.shape[0], x.shape[-1]
    flat = x.reshape(-1, k)
    out = None
    for start in range(0, n, _DEQUANT_ROWS):
        stop = min(n, start + _DEQUANT_ROWS)
        w = _dequantize_rows(kernels, packed, start, stop)
        y = F.linear(flat, w if x.dtype == w.dtype else w.to(x.dtype), None if bias is None else bias[start:stop])
        if stop - start == n:
            out = y
            break
        if out is None:
            out = torch.empty((flat.shape[0], n), dtype=y.dtype)
        out[:, start:stop] = y
    return out.view(*x.shape[:-1], n)


class Int4Codec:
    """``int4``: asymmetric 4-bit codes in groups of 32 input features (see module doc)."""

    name = "int4"
    group_size = 32
    max_rows = 12
    """Measured crossover with oneDNN bf16 on AVX-512 (Zen 4): int4 wins up to ~16 rows."""

    def __init__(self) -> None:
        self._mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default  # resolved once

    def __reduce__(self):  # op handles do not pickle; a new process resolves its own
        return type(self), ()

    def quantize(self, weight: torch.Tensor) -> PackedInt4 | None:
        """None when torch's CPU int4 packing cannot take the shape."""
        out_features, in_features = weight.shape
        if in_features % self.group_size or out_features % 16:
            return None
        # torch packs rows in independent blocks of 64: packing 64-row chunks keeps the
        # temporaries (fp32 copies, int32 codes) small, so loading does not leave hundreds
        # of MB of freed-but-held heap behind.
        step = _PACK_ROWS if out_features % _PACK_ROWS == 0 else out_features
        packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
        groups = in_features // self.group_size
        sz = torch.empty(groups, out_features, 2, dtype=torch.bfloat16)
        for start in range(0, out_features, step):
            codes, scale, zero = self._codes(weight[start : start + step])
            packed[start : start + step] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            sz[:, start : start + step, 0] = scale.t()
            sz[:, start : start + step, 1] = zero.t()
        return PackedInt4(packed, sz)

    def _codes(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int32 codes [rows, in], scale and zero [rows, groups] of a block of rows."""
        w = rows.float().unflatten(1, (-1, self.group_size))
        low, high = w.amin(-1), w.amax(-1)
        scale = (high - low) / 15
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: code 0
        codes = torch.round((w - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, 15)
        zero = low + 8 * scale  # the kernel computes (code - 8) * scale + zero
        return codes.flatten(1).to(torch.int32), scale, zero

    def matmul(self, x: torch.Tensor, packed: PackedInt4) -> torch.Tensor:
        return self._mm(x, packed.weight, self.group_size, packed.scales_and_zeros)

    group = staticmethod(group_int4)


class Int8Codec:
    """``int8``: symmetric 8-bit codes with one scale per output row."""

    name = "int8"
    max_rows = 8
    """Measured crossover with oneDNN bf16 on AVX-512 (Zen 4): int8 wins up to ~12 rows."""

    def __init__(self) -> None:
        self._mm = torch.ops.aten._weight_int8pack_mm.default  # resolved once

    def __reduce__(self):  # op handles do not pickle; a new process resolves its own
        return type(self), ()

    def quantize(self, weight: torch.Tensor) -> PackedInt8:
        codes = torch.empty(weight.shape, dtype=torch.int8)
        scales = torch.empty(weight.shape[0], dtype=torch.bfloat16)
        for start in range(0, weight.shape[0], _PACK_ROWS):  # small temporaries, as int4
            w = weight[start : start + _PACK_ROWS].float()
            scale = w.abs().amax(dim=1) / 127
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            codes[start : start + _PACK_ROWS] = torch.round(w / scale.unsqueeze(1)).clamp_(-127, 127)
            scales[start : start + _PACK_ROWS] = scale
        return PackedInt8(codes, scales)

    def matmul(self, x: torch.Tensor, packed: PackedInt8) -> torch.Tensor:
        return self._mm(x, packed.weight, packed.scales)

    group = staticmethod(group_int8)


class BucketedDense(LinearMethod):
    """``dense`` on the CPU: the dense weight, through :func:`bucketed_linear` (bf16 GEMMs see
    a bounded set of row counts, so oneDNN's per-shape caches stay bounded)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return bucketed_linear(x, layer.weight, bias)


def linear_method(weight_format: str) -> LinearMethod:
    """The method for a CPU weight format name (see :data:`WEIGHT_FORMATS`)."""
    if weight_format == "dense":
        return BucketedDense()
    if weight_format not in _CODECS:
        raise ValueError(
            f"weight format {weight_format!r} is not supported by platform 'cpu'; use one of "
            f"{list(WEIGHT_FORMATS)}"
        )
    return QuantizedLinear(_CODECS[weight_format]())


_CODECS = {"int4": Int4Codec, "int8": Int8Codec}
WEIGHT_FORMATS = ("dense", *_CODECS)
"""The CPU platform's weight formats (``--weight-format``)."""
