"""An rms_norm for platform cpu, installed through the ``core_op_overrides`` hook.

It computes the same function as ``core.ops.rms_norm`` by another route (the vector
2-norm, ``rms = ||x|| / sqrt(n)``), and counts its calls so a test can prove the engine
used it. The counter lives in the closure of one engine's op table (a fresh one per
engine), never in a module global.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


def rms_norm_by_vector_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden] -> x / sqrt(mean(x^2) + eps) * weight, computed in float32,
    returned in x's dtype (the contract of ``core.ops.rms_norm``)."""
    xf = x.float()
    rms = torch.linalg.vector_norm(xf, dim=-1, keepdim=True) / math.sqrt(x.shape[-1])
    return (xf / torch.sqrt(rms * rms + eps) * weight.float()).to(x.dtype)


@dataclass
class CallCounter:
    calls: int = 0


def counting_rms_norm() -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    """A fresh rms_norm whose ``.counter.calls`` counts how often the engine called it."""
    counter = CallCounter()

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        counter.calls += 1
        return rms_norm_by_vector_norm(x, weight, eps)

    rms_norm.counter = counter
    return rms_norm
