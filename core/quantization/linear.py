"""Linear methods that keep a quantized checkpoint's weights quantized on the device.

:class:`KeptQuantizedLinear` does the platform-neutral part: while the checkpoint loads, each
linear layer's slices (q, k and v of a fused QKV layer, say) are collected; ``prepare``
joins them into one quantized weight and asks the subclass to :meth:`~KeptQuantizedLinear.pack`
it for its kernels, then drops the dense placeholder. A layer whose checkpoint weight is dense
(a GGUF Q6_K tensor, a layer a checkpoint left unquantized), whose fused parts are quantized
in forms that cannot be joined (GGUF Q4_K beside Q8_0; logged) or that the kernels cannot take
is made dense in the compute dtype instead, so every model loads.

:class:`ReferenceQuantizedLinear` is the plain-torch subclass (dequantize, then multiply):
the reference the platforms' kernels are tested against, and what CPU tests use to exercise
the kept-quantized loading path.
"""

from __future__ import annotations

import logging
from abc import ABCMeta, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from core.models.layers import LinearMethod, hold_packed_tensors
from core.quantization.base import QuantizationMethod
from core.quantization.tensors import MixedFusedForms, QuantizedWeight, cat_rows, is_quantized

if TYPE_CHECKING:
    from core.config import ModelConfig
    from core.models import ModelContext
    from core.platform import Platform

logger = logging.getLogger(__name__)

_STAYS_DENSE = "dense"
"""``packed_weight`` of a layer that runs densely (a dense checkpoint weight, or a form the
kernels do not take)."""


class KeptQuantizedLinear(LinearMethod, metaclass=ABCMeta):
    """Keeps linear weights in ``quant``'s quantized form (see the module docstring).

    Subclasses implement :meth:`pack` and :meth:`matmul`. Invariant after ``prepare``: the
    layer's ``packed_weight`` is the subclass's packed weight (its tensors registered as
    buffers so memory accounting sees them) and ``weight`` an empty placeholder, or
    ``packed_weight`` is "dense" and ``weight`` the dense weight in the compute dtype.
    """

    keeps_quantized = True

    def __init__(self, quant: QuantizationMethod, dtype: torch.dtype):
        self.quant = quant
        self.dtype = dtype
        self.name = f"{quant.name} (kept quantized)"

    # ---- the platform's part ----------------------------------------------------------
    @abstractmethod
    def pack(self, weight: QuantizedWeight, device: torch.device) -> Any | None:
        """The device form of a joined quantized weight, or None when the kernels cannot
        take it (the layer then runs densely)."""

    @abstractmethod
    def matmul(self, packed: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., in] @ W.T + bias`` in ``x``'s dtype, for a packed weight."""

    # ---- loading ------------------------------------------------------------------------
    def create_weight(self, ctx: ModelContext, rows: int, cols: int) -> nn.Parameter:
        # A placeholder with the dense shape, on the meta device: nothing is allocated
        # until prepare() knows whether the layer stays quantized.
        self.device = ctx.device
        return nn.Parameter(torch.empty(rows, cols, dtype=ctx.dtype, device="meta"), requires_grad=False)

    def load_rows(self, layer: nn.Module, offset: int, src: Any, what: str) -> None:
        rows, cols = layer.weight.shape
        if src.shape[1] != cols or offset + src.shape[0] > rows:
            raise ValueError(
                f"checkpoint tensor for {what} has shape {tuple(src.shape)}; the layer expects "
                f"{cols} inputs and at most {rows - offset} rows at row {offset}; the checkpoint "
                f"does not match config.json"
            )
        if not is_quantized(src):
            quantized = self.quant.quantize_dense(src)
            # a copy: the checkpoint tensor may be a view of a file that closes after loading
            src = quantized if quantized is not None else src.to(self.dtype, copy=True)
        layer.__dict__.setdefault("_quant_parts", {})[offset] = src

    def set_dummy(self, layer: nn.Module, generator: torch.Generator, std: float) -> None:
        """Random weights in the method's format (``--load-format dummy``)."""
        rows, cols = layer.weight.shape
        w = self.quant.dummy_weight(rows, cols, generator, std)
        if w is None:
            w = torch.empty(rows, cols, device=generator.device).normal_(0.0, std, generator=generator).to(self.dtype)
        layer.__dict__["_quant_parts"] = {0: w}

    def prepare(self, layer: nn.Module) -> None:
        parts = layer.__dict__.pop("_quant_parts", None)
        if parts is None:
            if layer.packed_weight is None:
                raise ValueError(f"linear layer {layer.extra_repr()} received no weights")
            return
        rows = layer.weight.shape[0]
        ordered = [parts[k] for k in sorted(parts)]
        starts = sorted(parts)
        ends = [s + p.shape[0] for s, p in zip(starts, ordered)]
        if starts[0] != 0 or ends[-1] != rows or any(e != s for e, s in zip(ends, starts[1:])):
            raise ValueError(
                f"linear layer {layer.extra_repr()}: the checkpoint's slices cover rows "
                f"{list(zip(starts, ends))}, not [0, {rows}) exactly"
            )
        packed = None
        if all(is_quantized(p) for p in ordered):
            try:
                joined = cat_rows(ordered, layer.extra_repr())
            except MixedFusedForms as e:  # correct densely, at the dense weight's size and speed
                logger.warning("%s: this layer runs densely in %s", e, self.dtype)
            else:
                packed = self.pack(joined, self.device)
        if packed is None:
            dense = torch.cat([p.dequantize(self.dtype) if is_quantized(p) else p for p in ordered])
            layer.weight = nn.Parameter(dense.to(self.device), requires_grad=False)
            layer.packed_weight = _STAYS_DENSE
            return
        layer.weight = nn.Parameter(torch.empty(0, dtype=self.dtype, device=self.device), requires_grad=False)
        layer.packed_weight = packed
        hold_packed_tensors(layer, packed, "packed_")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.packed_weight is None:
            self.prepare(layer)
        packed = layer.packed_weight
        if packed is _STAYS_DENSE:
            return F.linear(x, layer.weight, bias)
        return self.matmul(packed, x, bias)


@dataclass(frozen=True)
class ReferencePacked:
    weight: QuantizedWeight
    """The joined quantized weight, on the device."""


class ReferenceQuantizedLinear(KeptQuantizedLinear):
    """Plain torch: the weight dequantized to ``x``'s dtype at every call, then multiplied."""

    def pack(self, weight: QuantizedWeight, device: torch.device) -> ReferencePacked:
        moved = {f.name: getattr(weight, f.name) for f in fields(weight)}
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
        return ReferencePacked(type(weight)(**moved))

    def matmul(self, packed: ReferencePacked, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, packed.weight.dequantize(x.dtype), bias)


class QuantizeOnLoad(LinearMethod):
    """On-load quantization (``--quantization fp8`` of a dense checkpoint) where the platform
    runs the method dequantized: each dense weight goes through the method's quantization
    while loading, so the layer holds exactly the weights the quantized model has; loading
    and multiplying are otherwise ``inner``'s (the platform's ``--weight-format`` method)."""

    def __init__(self, inner: LinearMethod, quant: QuantizationMethod):
        self.inner, self.quant = inner, quant
        self.name = f"{inner.name} ({quant.name} weights)"

    def create_weight(self, ctx: ModelContext, rows: int, cols: int) -> nn.Parameter:
        return self.inner.create_weight(ctx, rows, cols)

    def load_rows(self, layer: nn.Module, offset: int, src: Any, what: str) -> None:
        quantized = None if is_quantized(src) else self.quant.quantize_dense(src)
        self.inner.load_rows(layer, offset, quantized if quantized is not None else src, what)

    def prepare(self, layer: nn.Module) -> None:
        self.inner.prepare(layer)

    def folds_norm(self, layer: nn.Module, x: torch.Tensor, norm: nn.Module) -> bool:
        return self.inner.folds_norm(layer, x, norm)

    def adds_residual(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> bool:
        return self.inner.adds_residual(layer, x, residual)

    # The norm and residual keywords reach the inner method only where it said it takes them.
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, **folded: Any) -> torch.Tensor:
        return self.inner.apply(layer, x, bias, **folded)

    def apply_silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, silu_and_mul: Callable, **folded: Any
    ) -> torch.Tensor:
        return self.inner.apply_silu_and_mul(layer, x, bias, silu_and_mul, **folded)

    def apply_rope(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                   rotary: nn.Module, **folded: Any) -> torch.Tensor | None:
        return self.inner.apply_rope(layer, x, bias, positions, rotary, **folded)


def linear_method_for(platform: Platform, model: ModelConfig, dtype: torch.dtype) -> LinearMethod:
    """The linear method of an engine: the quantization method's on this platform when it
    keeps weights quantized, else the platform's method for ``--weight-format`` (wrapped in
    :class:`QuantizeOnLoad` when the method quantizes dense checkpoints while loading)."""
    quant = model.quantization
    if quant is not None:
        method = quant.linear_method(platform, dtype)
        if method is not None:
            return method
    method = platform.linear_method(model.weight_format)
    if quant is not None and quant.quantizes_on_load:
        return QuantizeOnLoad(method, quant)
    return method
