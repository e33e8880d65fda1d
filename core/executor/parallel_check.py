"""Refuse parallel settings that cannot work, at engine start, with the numbers.

Without this check a bad size fails deep inside weight loading or, on a device, inside
a collective with an opaque error. The rules follow the sharding in
:mod:`core.models.layers`: attention heads split evenly across ranks; KV heads split
evenly or are replicated (a whole number of ranks per KV head); the MLP's intermediate
size splits evenly; the vocabulary may be any size (the last rank's rows are padded).
Pipeline stages each need at least one decoder layer (see
:func:`core.executor.pipeline.split_layers`), and a host must see ``tp x pp`` devices.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from core.config import EngineConfig
from core.executor.pipeline import split_layers
from core.platform import Platform

logger = logging.getLogger(__name__)

EXECUTORS = ("auto", "uni", "mp", "ray")


def validate_parallel(config: EngineConfig, platform: Platform) -> None:
    """Raise ValueError when ``config.parallel`` does not fit the model or the host.

    Checks the executor name, that the tensor-parallel size divides the model's heads and
    intermediate size, that every pipeline stage gets a layer, and (for the one-host
    executors) that there are enough devices. Model fields an architecture does not have
    are not checked.
    """
    par = config.parallel
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    if par.executor not in EXECUTORS:
        raise ValueError(f"unknown executor {par.executor!r}; use one of {list(EXECUTORS)}")
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {tp}")
    if pp < 1:
        raise ValueError(f"--pipeline-parallel-size must be at least 1, got {pp}")
    if par.world_size > 1 and par.executor == "uni":
        raise ValueError(
            f"--executor uni runs the model in this process on one device, so it cannot run "
            f"--tensor-parallel-size {tp} x --pipeline-parallel-size {pp}; use --executor mp "
            f"(one host) or --executor ray"
        )
    _check_model(config.model.hf_config, tp)
    layers = getattr(config.model.hf_config, "num_hidden_layers", None)
    if par.pp_layer_split is not None and pp == 1:
        raise ValueError("--pp-layer-split needs --pipeline-parallel-size 2 or more")
    if pp > 1 and layers is not None:
        split_layers(layers, pp, par.pp_layer_split)
    # A Ray cluster's devices are checked when its placement group is created.
    if par.world_size > 1 and par.executor != "ray":
        _check_devices(platform, tp, pp)


def _model_sizes(hf_config: Any) -> tuple[int | None, int | None, int | None]:
    """(attention heads, KV heads, MLP intermediate size) of an HF config, None if absent."""
    heads = getattr(hf_config, "num_attention_heads", None)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    inter = getattr(hf_config, "intermediate_size", None)
    if inter is None and getattr(hf_config, "model_type", None) == "gpt2":
        inter = getattr(hf_config, "n_inner", None) or 4 * hf_config.n_embd
    return heads, kv_heads, inter


def _check_model(hf_config: Any, tp: int) -> None:
    heads, kv_heads, inter = _model_sizes(hf_config)
    if heads is not None and heads % tp:
        raise ValueError(
            f"--tensor-parallel-size {tp} does not divide the model's {heads} attention heads; "
            f"use a size that divides {heads}: {_divisors(heads)}"
        )
    if kv_heads is not None and kv_heads % tp and tp % kv_heads:
        raise ValueError(
            f"--tensor-parallel-size {tp} and the model's {kv_heads} KV heads fit neither way: "
            f"the size must divide {kv_heads} (split the KV heads) or be a multiple of it "
            f"(replicate each KV head); use one of {_fitting_kv(heads, kv_heads)}"
        )
    if inter is not None and inter % tp:
        raise ValueError(
            f"--tensor-parallel-size {tp} does not divide the model's intermediate size "
            f"{inter}; use a size that divides it (one of {_divisors(inter, limit=heads)})"
        )


def _divisors(n: int, limit: int | None = None) -> list[int]:
    top = min(n, limit) if limit else n
    return [d for d in range(1, min(top, 64) + 1) if n % d == 0]


def _fitting_kv(heads: int | None, kv_heads: int) -> list[int]:
    sizes = _divisors(heads) if heads else _divisors(kv_heads)
    return [s for s in sizes if kv_heads % s == 0 or s % kv_heads == 0]


def _check_devices(platform: Platform, tp: int, pp: int) -> None:
    world = tp * pp
    what = f"--tensor-parallel-size {tp}" + (f" x --pipeline-parallel-size {pp}" if pp > 1 else "")
    if platform.shares_host_memory():
        cores = os.cpu_count() or 1
        if world > cores:
            logger.warning(
                "%s starts %d worker processes on %d CPU cores; they will compete for cores "
                "and run slower than smaller sizes", what, world, cores,
            )
        return
    count = platform.device_count()
    if world > count:
        hint = (
            f" (check {platform.device_visibility_env})" if platform.device_visibility_env else ""
        )
        raise ValueError(
            f"{what} needs {world} {platform.name} devices but this host has {count} "
            f"visible{hint}; lower the sizes to at most {count} devices in all, or use "
            f"--executor ray to span several hosts"
        )
