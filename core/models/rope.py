"""RoPE scaling variants in one place: from a config's RoPE settings to the cos/sin table.

:func:`cos_sin_table` returns ``[max_position, rotary_dim]`` float32 (cos half, sin half), the
layout ``ops.rotary_embedding`` reads, for every variant transformers defines for the models
served here: ``default``, ``linear``, ``dynamic`` (NTK), ``yarn``, ``longrope`` and ``llama3``.
Attention factors (YaRN's and LongRoPE's mscale) are folded into the table, as HF multiplies
its cos and sin by them.

Length-dependent variants: HF recomputes ``dynamic`` and ``longrope`` frequencies from the
length of the sequence in the current forward. A paged cache keeps keys rotated when they were
written, so here row ``p`` holds what HF computes for position ``p`` of a sequence of length
``p + 1``: LongRoPE's short factors below ``original_max_position_embeddings``, its long
factors from there on (what HF's own cached generation does when it grows past that length);
for ``dynamic`` every position the engine serves lies below ``max_position_embeddings``
(the engine caps max_model_len there), where HF's dynamic frequencies are the default ones.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def _base_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base**exponents)


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any], max_position: int) -> torch.Tensor:
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p.get("original_max_position_embeddings", max_position))
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(medium, blended, out)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rotary_dim: int, p: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the slow dimensions by ``factor``, keep the fast ones, ramp between
    the correction dims of ``beta_fast`` / ``beta_slow`` rotations; scale by mscale."""
    base = float(p["rope_theta"])
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position / orig
    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = _base_inv_freq(rotary_dim, base)
    keep = 1 - ramp  # 1: keep the original frequency (fast dims), 0: interpolate
    inv_freq = extrapolation / factor * (1 - keep) + extrapolation * keep
    return inv_freq, float(attention)


def _longrope_attention(p: dict[str, Any], max_position: int) -> float:
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position / orig
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


def _table(angles_per_pos: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.cat((angles_per_pos.cos(), angles_per_pos.sin()), dim=-1) * scale


def cos_sin_table(rotary_dim: int, params: dict[str, Any], max_position: int) -> torch.Tensor:
    """The ``[max_position, rotary_dim]`` float32 cos/sin table of one RoPE variant.

    :param params: at least ``rope_type`` and ``rope_theta`` (see ``rope_parameters``) plus
        the variant's own fields, as in config.json.
    :raises ValueError: an unknown ``rope_type``, naming the supported ones.
    """
    kind = params["rope_type"]
    positions = torch.arange(max_position, dtype=torch.float32).unsqueeze(1)
    inv_freq, scale = _base_inv_freq(rotary_dim, float(params["rope_theta"])), 1.0
    if kind == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, params, max_position)
    elif kind == "yarn":
        inv_freq, scale = _yarn(rotary_dim, params, max_position)
    elif kind == "longrope":
        return _longrope_table(rotary_dim, params, max_position, positions)
    elif kind not in ("default", "dynamic"):  # dynamic: see the module docstring
        raise ValueError(
            f"rope type {kind!r} is not supported; supported: {', '.join(SUPPORTED)} "
            f"(from rope_parameters / rope_scaling in config.json)"
        )
    return _table(positions * inv_freq, scale)


def _longrope_table(rotary_dim: int, p: dict[str, Any], max_position: int, positions) -> torch.Tensor:
    """Short factors below original_max_position_embeddings, long factors from there on."""
    orig = p["original_max_position_embeddings"]
    base = _base_inv_freq(rotary_dim, float(p["rope_theta"]))
    short = base / torch.tensor(p["short_factor"], dtype=torch.float32)
    long = base / torch.tensor(p["long_factor"], dtype=torch.float32)
    inv_freq = torch.where(positions < orig, short, long)  # [max_position, rotary_dim / 2]
    return _table(positions * inv_freq, _longrope_attention(p, max_position))
