"""Collecting the several checkpoint tensors of one quantized linear layer into one weight.

A quantized layer ``X`` is stored as ``X.qweight``, ``X.scales``, ... (the names differ per
format), in any order and possibly spread over shards; the model loaders expect one tensor
per ``X.weight``. :func:`group_parts` buffers each layer's parts until it has them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.quantization.base import Weights


def group_parts(
    weights: Weights,
    required: tuple[str, ...],
    build: Callable[[str, dict[str, Any]], Any],
    optional: tuple[str, ...] = (),
    member: Callable[[str, Any], bool] | None = None,
    fmt: str = "",
) -> Weights:
    """Yield ``(X.weight, build(X, parts))`` once every ``required`` part of layer ``X`` has
    arrived, and every other tensor unchanged.

    :param optional: parts taken when they arrive before the layer is complete (dropped
        when they come later: they are then redundant, e.g. GPTQ's trivial ``g_idx``).
    :param member: ``member(part, tensor)`` says whether a tensor named like a part is one
        (fp8: ``X.weight`` belongs to a quantized layer only when its dtype is fp8).
    :raises ValueError: the checkpoint ends with a layer missing a part.
    """
    pending: dict[str, dict[str, Any]] = {}
    done: set[str] = set()
    for name, tensor in weights:
        module, _, part = name.rpartition(".")
        if part not in required and part not in optional or (member and not member(part, tensor)):
            yield name, tensor
            continue
        if module in done:
            if part in optional:
                continue
            raise ValueError(f"the {fmt} checkpoint has tensor {name!r} twice")
        parts = pending.setdefault(module, {})
        parts[part] = tensor
        if all(p in parts for p in required):
            done.add(module)
            yield f"{module}.weight", build(module, pending.pop(module))
    for module, parts in pending.items():
        if all(p in optional for p in parts):
            continue  # optional parts of a layer the checkpoint keeps dense
        missing = [p for p in required if p not in parts]
        raise ValueError(
            f"the {fmt} checkpoint is incomplete: layer {module!r} has {sorted(parts)} but no "
            f"{missing}; re-download or re-export it"
        )
