"""Which quantization method an engine uses: the built-in methods plus those plugins add
(``core_quantization_methods`` hook), chosen from ``--quantization``, the checkpoint's
``quantization_config`` or a GGUF file, and checked against the platform."""

from __future__ import annotations

import logging
from typing import Any

from core.quantization.base import QuantizationMethod
from core.quantization.fp8 import CompressedTensorsMethod, Fp8Method
from core.quantization.gguf import GgufMethod
from core.quantization.int4 import AwqMethod, GptqMethod

logger = logging.getLogger(__name__)

BUILTIN: tuple[type[QuantizationMethod], ...] = (
    Fp8Method, CompressedTensorsMethod, AwqMethod, GptqMethod, GgufMethod,
)


def method_classes(extra: dict[str, type[QuantizationMethod]] | None = None) -> dict[str, type[QuantizationMethod]]:
    """Name (and alias) -> class: the built-ins, then plugin methods under new names (a
    plugin may not replace a built-in method; a warning names it)."""
    found: dict[str, type[QuantizationMethod]] = {}
    for cls in BUILTIN:
        for name in (cls.name, *cls.aliases):
            found[name] = cls
    for name, cls in (extra or {}).items():
        if name in found:
            logger.warning("a plugin registers quantization method %r, which is built in; ignored", name)
            continue
        found[name] = cls
    return found


def quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` as a plain dict, or None."""
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    if not isinstance(q, dict):  # transformers may keep a QuantizationConfigMixin
        q = q.to_dict() if hasattr(q, "to_dict") else dict(vars(q))
    return dict(q)


def resolve_quantization(
    requested: str | None,
    hf_config: Any,
    gguf_file: str | None,
    platform: Any,
    extra: dict[str, type[QuantizationMethod]] | None = None,
    platforms: dict[str, Any] | None = None,
) -> QuantizationMethod | None:
    """The engine's quantization method, or None for an unquantized model.

    :param requested: ``--quantization`` (None: from the checkpoint).
    :param extra: methods plugins add, by name.
    :param platforms: every installed platform class by name, to say which run a method the
        chosen ``platform`` does not.
    :raises ValueError: an unknown or unsupported method, a ``--quantization`` that contradicts
        the checkpoint, or a method the platform does not run; each names the method, what is
        supported and what to change.
    """
    classes = method_classes(extra)
    names = sorted({c.name for c in classes.values()})
    qconfig = quantization_config(hf_config)
    found = "gguf" if gguf_file else (qconfig or {}).get("quant_method")
    if found is not None and found not in classes:
        raise ValueError(
            f"the checkpoint is quantized with quant_method {found!r}, which core does not "
            f"support; supported quantization methods: {names}. Use an unquantized checkpoint or "
            f"one quantized with a supported method (a plugin can add one through the "
            f"core_quantization_methods hook)"
        )
    if requested is not None and requested not in classes:
        raise ValueError(f"--quantization {requested!r} is unknown; supported: {names}")
    if requested is not None and found is not None and classes[requested] is not classes[found]:
        raise ValueError(
            f"--quantization {requested} does not match the checkpoint, which is quantized with "
            f"{found}; leave --quantization out to use the checkpoint's method"
        )
    name = requested or found
    if name is None:
        return None
    if classes[name] is GgufMethod and not gguf_file:
        raise ValueError("--quantization gguf needs a .gguf file as --model; leave --quantization out")
    method = classes[name].from_config(qconfig if found is not None else None)
    if not method.supported_on(platform):
        others = sorted(n for n, cls in (platforms or {}).items() if method.supported_on(cls))
        where = f"platforms that do: {others}" if others else "see `core platforms`"
        raise ValueError(
            f"quantization method {method.name!r} is not supported by platform {platform.name!r} "
            f"(it supports: {sorted(platform.quantization_methods()) or 'none'}); {where}. Pick "
            f"one with --platform, or use an unquantized checkpoint"
        )
    return method


def quantization_for(requested: str | None, hf_config: Any, gguf_file: str | None, platform: Any,
                     plugins: Any = None) -> QuantizationMethod | None:
    """:func:`resolve_quantization` with the methods and platforms of ``plugins`` (a
    :class:`core.plugins.Plugins`, or None for the built-ins only); logs the choice."""
    extra = plugins.quantization_methods() if plugins is not None else None
    platforms = {n: cls for n, (_, cls) in plugins.platforms().items()} if plugins is not None else None
    method = resolve_quantization(requested, hf_config, gguf_file, platform, extra, platforms)
    if method is None:
        logger.info("quantization: none; platform %s runs %s", platform.name, platform_methods(platform))
    else:
        kept = platform.quantization_methods().get(method.name) is not None
        logger.info("quantization: %s, %s; platform %s runs %s", method.describe(),
                    "kept quantized" if kept else "dequantized while loading", platform.name,
                    platform_methods(platform))
    return method


def platform_methods(platform: Any) -> str:
    """What ``core platforms`` and the start-up log say about a platform's quantization
    methods, e.g. ``awq, fp8 (kept quantized); gguf (dequantized)``."""
    methods = platform.quantization_methods()
    kept = sorted(n for n, f in methods.items() if f is not None)
    dense = sorted(n for n, f in methods.items() if f is None)
    parts = [f"{', '.join(kept)} (kept quantized)"] if kept else []
    parts += [f"{', '.join(dense)} (dequantized)"] if dense else []
    return "; ".join(parts) or "no quantization methods"
