"""Quantized checkpoints: FP8 (compressed-tensors, ``fp8``), 4-bit AWQ and GPTQ, and GGUF.

A quantization method (:class:`~core.quantization.base.QuantizationMethod`) is an extension
point like an attention backend: the built-in ones are listed in
:mod:`core.quantization.registry`, plugins add more through the ``core_quantization_methods``
hook. One is chosen per engine from ``--quantization``, the checkpoint's
``quantization_config`` or a GGUF file; the checkpoint's tensors become canonical quantized
weights (:mod:`core.quantization.tensors`), which a platform either keeps quantized for its
kernels (:mod:`core.quantization.linear`) or dequantizes into its dense weights. Each
platform says which methods it runs in :meth:`core.platform.Platform.quantization_methods`.

See docs/quantization.md.
"""

from core.quantization.base import QuantizationMethod
from core.quantization.tensors import Fp8Weight, IntWeight, is_quantized

__all__ = ["Fp8Weight", "IntWeight", "QuantizationMethod", "is_quantized"]
