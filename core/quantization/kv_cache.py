"""The FP8 KV cache (``--kv-cache-dtype fp8``): the flag's values, which platforms take it,
the per-layer scales a checkpoint provides, and the reference quantization that every
backend's cache write and read must reproduce.

Format. A layer's cache holds float8 e4m3 (OCP "fn": no infinities, max 448) codes
``q = fp8(clamp(x * (1 / scale), -448, 448))``, rounded to nearest even, with one scale for
the layer's keys (``k_scale``) and one for its values (``v_scale``); attention reads
``q * scale``. ``1 / scale`` is taken once in float32 and multiplied (not divided), so that
every kernel rounds exactly as :func:`quantize_kv` does. Scales default to 1.0 (fp8's range,
±448, is far wider than a normed model's keys and values); a checkpoint calibrated for an
FP8 KV cache publishes its own (:func:`checkpoint_kv_scales`).

Which platforms can store it is each platform's answer to
:meth:`core.platform.Platform.kv_cache_dtypes`; a backend declares it can read and write it
with :attr:`core.attention.AttentionBackend.supports_fp8_kv_cache`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field, replace
from glob import glob
from typing import Any

import torch

from core.quantization.tensors import FP8_MAX

logger = logging.getLogger(__name__)

AUTO = "auto"
FP8_E4M3 = "fp8_e4m3"
KV_CACHE_DTYPES = {AUTO: AUTO, "fp8": FP8_E4M3, FP8_E4M3: FP8_E4M3}
"""``--kv-cache-dtype`` spellings -> the name the engine keeps (vLLM's ``fp8`` is e4m3)."""
TORCH_DTYPES = {FP8_E4M3: torch.float8_e4m3fn}

_NOT_BUILT = {
    "fp8_e5m2": "the e5m2 format (2 mantissa bits) is not implemented",
    "fp8_inc": "Intel Gaudi's fp8 cache is not implemented",
    "fp8_ds_mla": "DeepSeek's MLA fp8 cache is not implemented",
}

# Checkpoint names of per-layer KV scales, after ``...layers.<i>.self_attn.``:
#   k_scale / v_scale                      compressed-tensors (llm-compressor kv_cache_scheme)
#   k_proj.output_scale / v_proj.output_scale   older compressed-tensors, Quark
#   k_proj.k_scale / v_proj.v_scale        NVIDIA ModelOpt
#   kv_scale                               AutoFP8 (one scale for keys and values)
KV_SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\."
    r"(k_scale|v_scale|kv_scale|k_proj\.output_scale|v_proj\.output_scale|k_proj\.k_scale|v_proj\.v_scale)$"
)
KV_SCALE_SUFFIXES = (".self_attn.k_scale", ".self_attn.v_scale", ".self_attn.kv_scale",
                     ".k_proj.k_scale", ".v_proj.v_scale")
"""Name endings the weight readers drop (the scales are read by :func:`checkpoint_kv_scales`,
not loaded as weights). ``.output_scale`` is dropped by the compressed-tensors reader."""


def normalize_kv_cache_dtype(value: Any) -> str:
    """``auto`` or ``fp8_e4m3`` for a ``--kv-cache-dtype`` value.

    :raises ValueError: any other value, naming it and what is accepted.
    """
    if value in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[value]
    why = _NOT_BUILT.get(value, "it is not a KV cache dtype core knows")
    raise ValueError(
        f"kv_cache_dtype (--kv-cache-dtype)={value!r} is not supported: {why}. Use auto (the "
        f"compute dtype) or fp8 (= fp8_e4m3: float8 e4m3 with per-layer scales)"
    )


def kv_cache_torch_dtype(name: str) -> torch.dtype | None:
    """The cache's torch dtype for a resolved name; None for ``auto`` (the compute dtype)."""
    return None if name == AUTO else TORCH_DTYPES[name]


def resolve_kv_cache_dtype(requested: str, platform: Any, platforms: dict[str, Any] | None = None) -> str:
    """The engine's KV cache dtype name, checked against ``platform``.

    :param platforms: every installed platform class by name, to say which take the dtype.
    :raises ValueError: the platform does not store that dtype; names the ones that do.
    """
    name = normalize_kv_cache_dtype(requested)
    if name == AUTO or name in platform.kv_cache_dtypes():
        return name
    others = sorted(n for n, cls in (platforms or {}).items() if name in cls.kv_cache_dtypes())
    where = f"platforms that do: {others}" if others else "see `core platforms`"
    raise ValueError(
        f"--kv-cache-dtype {requested} is not supported by platform {platform.name!r} (its KV "
        f"cache dtypes: {list(platform.kv_cache_dtypes())}); {where}. Leave --kv-cache-dtype "
        f"auto here, or pick such a platform with --platform"
    )


def kv_cache_dtype_for(requested: str, platform: Any, plugins: Any = None) -> str:
    """:func:`resolve_kv_cache_dtype` against the platforms of ``plugins`` (a
    :class:`core.plugins.Plugins`, or None for no list of alternatives)."""
    platforms = {n: cls for n, (_, cls) in plugins.platforms().items()} if plugins is not None else None
    return resolve_kv_cache_dtype(requested, platform, platforms)


# ---- the reference format -------------------------------------------------------------------


def inverse_scale(scale: float) -> torch.Tensor:
    """``1 / scale`` as the float32 every kernel multiplies by."""
    return torch.tensor(1.0 / scale, dtype=torch.float32)


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference FP8 cache codes of ``x``: ``fp8_e4m3(clamp(x.float() * (1/scale), ±448))``."""
    y = x.float() * inverse_scale(scale)
    return y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize_kv(codes: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What attention reads from FP8 codes: ``codes * scale`` (in float32, then ``dtype``)."""
    return (codes.float() * scale).to(dtype)


# ---- scales from the checkpoint -------------------------------------------------------------


@dataclass(frozen=True)
class KVCacheFormat:
    """How the runner's attention layers store their KV cache.

    :param dtype: the cache's torch dtype, None for the compute dtype.
    :param scales: layer index (construction order of the attention layers) -> (k_scale,
        v_scale); layers not named use 1.0.
    """

    dtype: torch.dtype | None = None
    scales: dict[int, tuple[float, float]] = field(default_factory=dict)

    def spec_for(self, spec: Any, layer: int) -> Any:
        """``spec`` (an AttentionSpec) with this format's cache dtype and layer's scales."""
        if self.dtype is None:
            return spec
        k, v = self.scales.get(layer, (1.0, 1.0))
        return replace(spec, kv_cache_dtype=self.dtype, k_scale=k, v_scale=v)

    def check_layers(self, num_layers: int) -> None:
        """Refuse scales for layers the model does not have (a name mapping gone wrong)."""
        extra = sorted(i for i in self.scales if i >= num_layers)
        if extra:
            raise ValueError(
                f"the checkpoint has KV cache scales for layers {extra[:5]}, but the model has "
                f"{num_layers} attention layers; the checkpoint does not match config.json"
            )


def kv_cache_format(model_config: Any, name: str) -> KVCacheFormat:
    """The cache format for ``--kv-cache-dtype`` ``name``: with fp8, the checkpoint's KV scales
    (:func:`checkpoint_kv_scales`) where it has them, else 1.0, logged either way."""
    dtype = kv_cache_torch_dtype(name)
    if dtype is None:
        if _kv_cache_scheme(model_config) is not None:
            logger.info("the checkpoint declares an FP8 KV cache (kv_cache_scheme); its scales "
                        "are used only with --kv-cache-dtype fp8")
        return KVCacheFormat()
    scales = checkpoint_kv_scales(model_config)
    if scales:
        ks = [k for k, _ in scales.values()]
        vs = [v for _, v in scales.values()]
        logger.info("KV cache fp8_e4m3 with the checkpoint's scales for %d layers (k %.4g..%.4g, "
                    "v %.4g..%.4g)", len(scales), min(ks), max(ks), min(vs), max(vs))
    else:
        logger.info("KV cache fp8_e4m3 with scale 1.0 for keys and values (the checkpoint has "
                    "no KV scales)")
    return KVCacheFormat(dtype, scales)


def describe_kv_dtype(specs: list[Any], num_blocks: int, block_size: int) -> str:
    """One log line: what the cache stores and how many more tokens that holds than a cache
    in the compute dtype would in the same bytes."""
    stored = sum(2 * s.num_kv_heads * s.head_size * s.cache_dtype.itemsize for s in specs)
    compute = sum(2 * s.num_kv_heads * s.head_size * s.dtype.itemsize for s in specs)
    names = sorted({str(s.cache_dtype).removeprefix("torch.") for s in specs})
    base = sorted({str(s.dtype).removeprefix("torch.") for s in specs})
    return (
        f"KV cache stores {'/'.join(names)}: {stored * block_size} bytes per block of {block_size} "
        f"tokens (a {'/'.join(base)} cache: {compute * block_size}); the {num_blocks} blocks hold "
        f"{compute / stored:.2f}x the tokens the same memory would in {'/'.join(base)}"
    )


def _kv_cache_scheme(model_config: Any) -> dict[str, Any] | None:
    q = getattr(model_config.hf_config, "quantization_config", None)
    if q is not None and not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else dict(vars(q))
    return (q or {}).get("kv_cache_scheme")


def check_kv_cache_scheme(scheme: dict[str, Any] | None) -> None:
    """Refuse a compressed-tensors ``kv_cache_scheme`` core cannot honour (per-head scales,
    dynamic scales, integer or non-8-bit caches), naming the setting."""
    if scheme is None:
        return
    wanted = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    bad = {k: scheme.get(k) for k, v in wanted.items() if scheme.get(k, v) != v}
    if scheme.get("dynamic") not in (None, False):
        bad["dynamic"] = scheme.get("dynamic")
    if bad:
        raise ValueError(
            f"the checkpoint's kv_cache_scheme has {bad}; core's FP8 KV cache takes 8-bit float "
            f"(e4m3) with static per-tensor scales (strategy 'tensor'). Use --kv-cache-dtype auto"
        )


def checkpoint_kv_scales(model_config: Any) -> dict[int, tuple[float, float]]:
    """Per-layer ``(k_scale, v_scale)`` from a safetensors checkpoint (names: see
    :data:`KV_SCALE_NAME`); empty when it has none (or is not a safetensors directory).

    :raises ValueError: a ``kv_cache_scheme`` core cannot honour, a layer with a key scale and
        no value scale (or the reverse), or a scale that is not a positive finite number.
    """
    check_kv_cache_scheme(_kv_cache_scheme(model_config))
    directory = model_config.model
    if model_config.gguf_file or model_config.load_format == "dummy" or not os.path.isdir(directory):
        return {}
    found: dict[int, dict[str, float]] = {}
    for path, names in _scale_tensor_files(directory).items():
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            for name in names:
                layer, what = _scale_kind(name)
                found.setdefault(layer, {})[what] = _scale_value(f.get_tensor(name), name)
    return {layer: _pair(layer, parts) for layer, parts in sorted(found.items())}


def _scale_tensor_files(directory: str) -> dict[str, list[str]]:
    """safetensors file -> the KV-scale tensor names in it (from the index when there is
    one, else from each file's header)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    files: dict[str, list[str]] = {}
    if os.path.isfile(index):
        with open(index) as fh:
            for name, file in json.load(fh)["weight_map"].items():
                if KV_SCALE_NAME.search(name):
                    files.setdefault(os.path.join(directory, file), []).append(name)
        return files
    from safetensors import safe_open

    for path in sorted(glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            names = [n for n in f.keys() if KV_SCALE_NAME.search(n)]
        if names:
            files[path] = names
    return files


def _scale_kind(name: str) -> tuple[int, str]:
    m = KV_SCALE_NAME.search(name)
    layer, part = int(m.group(1)), m.group(2)
    return layer, "kv" if part == "kv_scale" else part[0]  # "k", "v" or "kv"


def _scale_value(t: torch.Tensor, name: str) -> float:
    if t.numel() != 1:
        raise ValueError(
            f"KV cache scale {name} has {t.numel()} values; core takes one scale per layer for "
            f"keys and one for values (per-head scales are not supported): use --kv-cache-dtype auto"
        )
    v = float(t.float().reshape(()))
    if not (v > 0 and v < float("inf")):
        raise ValueError(f"KV cache scale {name} is {v}; a scale must be a positive finite number")
    return v


def _pair(layer: int, parts: dict[str, float]) -> tuple[float, float]:
    if "kv" in parts:
        return parts.get("k", parts["kv"]), parts.get("v", parts["kv"])
    if set(parts) != {"k", "v"}:
        missing = "value" if "k" in parts else "key"
        raise ValueError(
            f"the checkpoint has a KV cache scale for layer {layer}'s "
            f"{'keys' if missing == 'value' else 'values'} but none for its {missing}s"
        )
    return parts["k"], parts["v"]
