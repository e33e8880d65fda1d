"""GGUF linear weights kept quantized: Q4_0, Q4_1, Q4_K and Q8_0 blocks as
:class:`~core.quantization.tensors.IntWeight` in groups of 32 inputs.

Block layouts (ggml's ggml-common.h; the ``gguf`` package's ``quants.py`` dequantizes the
same way), per row of K values, little-endian:

* Q4_0, 18 bytes per 32 values: fp16 ``d``, 16 bytes of codes (value ``j`` in the low nibble
  of byte ``j``, value ``j + 16`` in its high nibble); ``w = (q - 8) * d``.
* Q4_1, 20 bytes per 32: fp16 ``d``, fp16 ``m``, codes as Q4_0; ``w = q * d + m``.
* Q8_0, 34 bytes per 32: fp16 ``d``, 32 int8 codes; ``w = q * d``.
* Q4_K, 144 bytes per 256 (8 sub-blocks of 32): fp16 ``d``, fp16 ``dmin``, 12 bytes of
  6-bit sub-block scales ``sc`` and mins ``mn``, 128 bytes of codes (sub-blocks ``2j`` and
  ``2j + 1`` are the low and high nibbles of bytes ``32j .. 32j + 31``);
  ``w = (d * sc) * q - dmin * mn``.

Each becomes a per-32 scale and min computed exactly in float32 (``d * sc`` and
``dmin * mn`` are products of an fp16 and a 6-bit integer), so dequantizing the IntWeight
gives the numbers the ``gguf`` package gives, bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from core.quantization.base import QuantizationMethod
from core.quantization.tensors import IntWeight

Q4_0, Q4_1, Q8_0, Q4_K = 2, 3, 8, 12
"""ggml type ids (gguf.GGMLQuantizationType)."""
KEPT_TYPES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K"}
_BLOCK_BYTES = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (256, 144)}


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of every block, as float32 [rows, blocks]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16 * n] bytes -> [..., 32 * n] codes: per 16 bytes the low nibbles, then the high."""
    qs = qs.unflatten(-1, (-1, 16))
    return torch.cat([qs & 15, qs >> 4], dim=-1).flatten(-2)


def _k4_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes -> 6-bit (sc, mn) per sub-block, [..., 8] each."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc, mn


def gguf_int_weight(raw: np.ndarray, qtype: int, shape: tuple[int, int]) -> IntWeight:
    """A GGUF tensor's bytes ``[rows, row_bytes]`` (uint8) as an IntWeight [rows, cols]."""
    rows, cols = shape
    block, nbytes = _BLOCK_BYTES[qtype]
    b = torch.from_numpy(np.array(raw, copy=True)).reshape(rows, cols // block, nbytes)  # off the mmap
    if qtype == Q8_0:
        codes = b[..., 2:].contiguous().view(torch.int8).reshape(rows, cols)
        return IntWeight(8, codes, _f16(b, 0), None, 32)
    if qtype in (Q4_0, Q4_1):
        d = _f16(b, 0)
        codes = _nibbles(b[..., 2 if qtype == Q4_0 else 4 :]).reshape(rows, cols)
        mins = -8 * d if qtype == Q4_0 else _f16(b, 2)
        return IntWeight(4, codes, d, mins, 32)
    if qtype != Q4_K:
        raise ValueError(f"GGUF type {qtype} is not kept quantized (supported: {sorted(KEPT_TYPES.values())})")
    d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
    sc, mn = _k4_scales(b[..., 4:16])
    q = b[..., 16:].unflatten(-1, (4, 32))  # [rows, blocks, 4, 32]
    codes = torch.stack([q & 15, q >> 4], dim=-2).reshape(rows, cols)
    scales = (d * sc.float()).reshape(rows, -1)
    mins = -(dmin * mn.float()).reshape(rows, -1)
    return IntWeight(4, codes, scales, mins, 32)


class GgufMethod(QuantizationMethod):
    """A ``.gguf`` model file. Where the platform keeps GGUF weights quantized, linear layers
    stored as Q4_0 / Q4_1 / Q4_K / Q8_0 arrive as IntWeight (others, and embeddings,
    dequantized); elsewhere every tensor is dequantized while loading (core's GGUF path)."""

    name = "gguf"

    @classmethod
    def from_config(cls, config):
        return cls(config)

    def describe(self) -> str:
        return "gguf (linear weights Q4_0/Q4_1/Q4_K/Q8_0 kept quantized where the platform can)"
