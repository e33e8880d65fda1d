"""The quantization-method contract: how one checkpoint format's quantized linear weights are
read, and which linear method runs them on a platform.

A method is chosen once per engine (see :mod:`core.quantization.registry`), from the
checkpoint's ``config.json`` ``quantization_config`` (its ``quant_method``), a GGUF file, or
``--quantization``. Instances are small, frozen and picklable (they travel in the
:class:`~core.config.ModelConfig` to every tensor-parallel rank).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from core.quantization.tensors import QuantizedWeight

if TYPE_CHECKING:
    from core.platform import Platform

Weights = Iterator[tuple[str, Any]]
"""``(hf_name, tensor)`` pairs; a quantized linear weight arrives as one
:data:`~core.quantization.tensors.QuantizedWeight` under ``<module>.weight``."""


class QuantizationMethod:
    """One quantization format. Subclasses set :attr:`name` and override what differs.

    Invariant: :meth:`checkpoint_weights` turns every quantized linear layer's checkpoint
    tensors (codes, scales, zero points, ...) into one quantized weight named
    ``<module>.weight`` and passes every other tensor through unchanged; whatever platform
    runs the model, the quantized weight's :meth:`dequantize` is the format's own definition.
    """

    name: ClassVar[str] = ""
    """The ``--quantization`` value (vLLM's name for the same format)."""
    aliases: ClassVar[tuple[str, ...]] = ()
    """Other ``quant_method`` / ``--quantization`` spellings that mean this format."""

    def __init__(self, config: dict[str, Any] | None = None):
        self.config = dict(config or {})
        """The checkpoint's ``quantization_config`` (empty for on-load quantization)."""

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> QuantizationMethod:
        """The method for a checkpoint's ``quantization_config``, or for ``None`` when
        ``--quantization`` asks to quantize an unquantized checkpoint while loading.

        :raises ValueError: a setting of the format this implementation does not read,
            naming the setting and what is supported.
        """
        if config is None:
            raise ValueError(
                f"--quantization {cls.name} needs a checkpoint quantized as {cls.name} "
                f"(config.json quantization_config with quant_method {cls.name!r}); this "
                f"checkpoint has none"
            )
        return cls(config)

    def describe(self) -> str:
        """One line for the start-up log: the method and its settings."""
        return self.name

    def checkpoint_weights(self, weights: Weights) -> Weights:
        """Group the checkpoint's tensors into quantized weights (see the class invariant).
        Default: nothing to group."""
        return weights

    @property
    def quantizes_on_load(self) -> bool:
        """Whether :meth:`quantize_dense` quantizes the linear weights of a dense checkpoint
        (``--quantization`` on an unquantized model). Default: False."""
        return False

    def quantize_dense(self, weight: torch.Tensor) -> QuantizedWeight | None:
        """What a kept-quantized linear layer does with a dense weight [rows, cols]: quantize
        it (on-load quantization) or return None to keep that layer dense."""
        return None

    def dummy_weight(self, rows: int, cols: int, generator: torch.Generator, std: float) -> QuantizedWeight | None:
        """Random weights in this format for ``--load-format dummy`` (benchmarks), made on
        ``generator.device``; None keeps such a layer dense."""
        return None

    def supported_on(self, platform: type[Platform] | Platform) -> bool:
        """Whether ``platform`` runs this method. Default: it names it in
        :meth:`~core.platform.Platform.quantization_methods`."""
        return self.name in platform.quantization_methods()

    def linear_method(self, platform: Platform, dtype: torch.dtype) -> Any:
        """The :class:`~core.models.layers.LinearMethod` for this method on ``platform``, or
        None to load the weights dequantized into the platform's dense weight format.
        Default: the factory ``platform.quantization_methods()`` maps this name to."""
        factory = platform.quantization_methods().get(self.name)
        return factory(self, dtype) if factory is not None else None

    def __repr__(self) -> str:
        return f"<quantization {self.describe()}>"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.config == self.config

    def __hash__(self) -> int:
        return hash((type(self), self.name))
