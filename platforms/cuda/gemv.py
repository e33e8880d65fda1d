"""``core_C.gemv`` (csrc/gemv.cu): a bandwidth-bound dense GEMM for 1-8 rows, and the CUDA
platform's dense linear method, which sends decode steps of one or two rows through it.

Measured on the H200 against cuBLAS (docs/benchmarks/cuda_gemv.md, 2026-12-01): faster in
isolation at 1-2 rows on the layers of up to 8,192 inputs, slower on the 14,336-input down
projection (cuBLAS's split-K) and from 4 rows; in the graphed decode step it was then no
faster. Since 2026-12-06 the kernel runs under programmatic dependent launch (its CTAs are
resident while the norm or attention before it finishes; cuBLAS's kernels cannot be launched
so), which is what :class:`CudaDenseLinear` uses it for (docs/benchmarks/cuda_e2e.md); since
session 18 it splits long rows across a CTA's warps (the down projection, now faster than
cuBLAS's split-K on the H100) and applies the MLP's SiLU-and-mul in its epilogue
(:func:`gemv_silu_and_mul`); since session 21 it also folds the RMSNorm of its input into its
product and adds the residual in its epilogue (:meth:`CudaDenseLinear.folds_norm`,
:meth:`CudaDenseLinear.adds_residual`), so a decode step of 1-2 rows runs no norm kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from core.models.layers import LinearMethod, RotaryEmbedding
from platforms.cuda.build import load_ops

GEMV_MAX_ROWS = 8
"""Largest row count the kernel takes (csrc/gemv.h, kGemvMaxRows)."""

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rows_per_warp(n: int) -> int:
    """Output features per warp for an ``n``-feature layer (the best of the H200 sweep at one
    row: one per warp up to 8,192 features, two above)."""
    return 1 if n <= 8192 else 2


def gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``x`` [m, k] and ``weight`` [n, k] are laid out as the kernel reads them."""
    vec = 16 // x.element_size()
    return (
        x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_ROWS
        and x.dtype in _DTYPES and weight.dtype == x.dtype and weight.dim() == 2
        and x.shape[1] == weight.shape[1] and x.shape[1] % vec == 0
        and x.stride(1) == 1 and weight.stride(1) == 1
        and x.stride(0) % vec == 0 and weight.stride(0) % vec == 0
        and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
    )


GEMV_SPLIT_K = 4
"""Warps of a CTA that share one row group's inputs (csrc/gemv.h, kGemvSplitK), the default at
1-2 rows per warp: on an H100 it took the 14,336-input down projection from 44.0 to 39.2 us
(cuBLAS's split-K: 43.6) and the whole batch-1 decode step 1.8 % below splitting only the
down projection (docs/benchmarks/cuda_e2e.md, session 18)."""


def split_k_for(per_warp: int) -> int:
    """The default ``split_k`` for ``per_warp`` rows per warp (the kernel splits at 1 or 2)."""
    return GEMV_SPLIT_K if per_warp in (1, 2) else 1


_NO_NORM = (None, 0.0)
"""The op's ``norm_weight, norm_eps`` arguments without a folded norm."""


def gemv(x: torch.Tensor, weight: torch.Tensor, per_warp: int | None = None, split_k: int | None = None,
         norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` through the kernel (callers check :func:`gemv_fits` first).

    :param norm: ``(gamma, eps)``: ``x`` is un-normed and the product is of its RMSNorm (one or
        two rows; the values of ``rms_norm`` followed by this kernel up to the rounding of the
        normed input, which the kernel skips: csrc/gemv.cu).
    :param residual: [m, n]: returns ``round(x @ weight.T) + residual`` rounded once more (one
        or two rows), the residual add ``fused_add_rms_norm`` does; not with ``norm``."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    per_warp = per_warp or rows_per_warp(weight.shape[0])
    load_ops().gemv(out, x, weight, per_warp, split_k or split_k_for(per_warp), False, *(norm or _NO_NORM), residual)
    return out


def gemv_rope(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
              rope_heads: int, head_size: int, rotary_dim: int,
              norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """``x @ weight.T`` of a fused QKV weight with its first ``rope_heads`` heads (query, then
    key) rotated by ``cos_sin[positions]`` in the epilogue: the values of :func:`gemv` followed
    by the platform's ``rotary_embedding`` (each projection rounded to the storage dtype first).
    ``norm``: as :func:`gemv`'s."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    load_ops().gemv_rope(out, x, weight, split_k_for(2), positions.contiguous(), cos_sin, rope_heads, head_size,
                         rotary_dim, *(norm or _NO_NORM))
    return out


def gemv_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``x @ weight.T`` for a ``[gate | up]`` weight [2d, k], in one
    kernel: out [m, d], equal to :func:`gemv` followed by the platform's ``silu_and_mul``
    (one gate and one up row per warp; the same sums, the same roundings). ``norm``: as
    :func:`gemv`'s."""
    out = torch.empty((x.shape[0], weight.shape[0] // 2), dtype=x.dtype, device=x.device)
    load_ops().gemv(out, x, weight, 2, split_k_for(2), True, *(norm or _NO_NORM))
    return out


DENSE_GEMV_ROWS = 2
"""Decode rows the dense method sends through the kernel (from 4 rows cuBLAS is faster)."""
DENSE_GEMV_MAX_K = 16384
"""Longest input the dense method sends through it. With each row split across a CTA's warps
(:data:`GEMV_SPLIT_K`) Llama-3-8B's 14,336-input down projection runs in one 39 us kernel on
the H100 instead of cuBLAS's split-K (two kernels, 43.6 us). Longer inputs were never measured
and keep cuBLAS."""


def dense_takes_gemv(rows: int, k: int, dtype: torch.dtype, has_bias: bool, major: int) -> bool:
    """Whether :class:`CudaDenseLinear` sends ``rows`` x ``k`` activations through the kernel:
    1-2 rows of fp16 / bf16, at most :data:`DENSE_GEMV_MAX_K` inputs, no bias (the kernel
    rounds its product once; adding a bias after would round twice where cuBLAS's epilogue
    rounds once) and a Hopper or newer GPU (compute capability ``major`` >= 9: the gain is the
    programmatic dependent launch, which older GPUs lack; without it the kernel was no faster
    than cuBLAS in the graphed step)."""
    return (1 <= rows <= DENSE_GEMV_ROWS and k <= DENSE_GEMV_MAX_K and not has_bias and major >= 9
            and dtype in (torch.float16, torch.bfloat16))


def _platform_op(name: str) -> Callable:
    """This platform's own implementation of op ``name`` (platforms/cuda/ops.py, which imports
    this module)."""
    from platforms.cuda import ops

    return getattr(ops, name)


def fuses_silu_and_mul(silu_and_mul: Callable, d: int, x: torch.Tensor) -> bool:
    """Whether a GEMV may apply ``silu_and_mul`` to a ``[gate | up]`` product of ``d`` outputs
    in its epilogue: only in place of this platform's own op (a plugin's override through
    core_op_overrides is called as given) and where that op would run its kernel (whole 16-byte
    vectors a row), whose values the epilogues reproduce (csrc/paired_epilogue.cuh)."""
    return silu_and_mul is _platform_op("silu_and_mul") and d % (16 // x.element_size()) == 0


def fuses_rope(layer: nn.Module, x2: torch.Tensor, positions: torch.Tensor, rotary: nn.Module) -> bool:
    """Whether a GEMV of the fused QKV ``layer`` over rows ``x2`` may rotate its query and key
    heads in its epilogue: only in place of this platform's own rotary op inside core's
    ``RotaryEmbedding`` (a plugin's override, or a subclass's own forward, runs as given: the
    caller rotates) and where that op would run its kernel on these heads (whole 16-byte
    vectors: rotary_dim / 2 and the unrotated tail)."""
    if type(rotary) is not RotaryEmbedding or rotary.ops.rotary_embedding is not _platform_op("rotary_embedding"):
        return False
    vec, d, rot = 16 // x2.element_size(), layer.head_size, rotary.rotary_dim
    cs = rotary.cos_sin_cache
    return (rot % 2 == 0 and (rot // 2) % vec == 0 and (d - rot) % vec == 0
            and cs.dtype == torch.float32 and cs.is_contiguous() and cs.device == x2.device
            and positions.dtype == torch.int64 and positions.numel() == x2.shape[0])


def _folded_norm(norm: nn.Module | None, x2: torch.Tensor | None) -> tuple[torch.Tensor, float] | None:
    """``norm``'s ``(gamma, eps)`` where the kernel may fold it into its product over rows
    ``x2`` (one or two; None: rows the kernel does not take, or no norm): core's own
    ``RMSNorm`` (not a subclass, whose forward may differ) calling this platform's
    ``rms_norm`` and ``fused_add_rms_norm`` ops (a plugin's override of either is called as
    given: the folded layer form replaces both), with a gamma the kernel reads as it reads x
    (x's dtype, device and length, contiguous, 16-byte aligned); else None."""
    from core.models.layers import RMSNorm

    if norm is None or x2 is None:
        return None
    g = norm.weight
    if not (type(norm) is RMSNorm and norm.ops.rms_norm is _platform_op("rms_norm")
            and norm.ops.fused_add_rms_norm is _platform_op("fused_add_rms_norm") and x2.shape[0] <= 2
            and g.dtype == x2.dtype and g.device == x2.device and g.dim() == 1 and g.shape[0] == x2.shape[1]
            and g.is_contiguous() and g.data_ptr() % 16 == 0):
        return None
    return g, norm.eps


class CudaDenseLinear(LinearMethod):
    """The dense format on CUDA: ``x @ W.T`` through :func:`gemv` where
    :func:`dense_takes_gemv` says so, else cuBLAS (``F.linear``). fp32 keeps cuBLAS everywhere
    (its sums then match the reference's order more closely than the kernel's lane order)."""

    def __init__(self):
        self._major: dict[int, int] = {}  # device index -> compute capability major

    def gemv_rows(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``x`` as the kernel's [m, k] rows where :func:`dense_takes_gemv` says so, else None."""
        k = x.shape[-1]
        if not (x.is_cuda and x.numel() <= DENSE_GEMV_ROWS * k):
            return None
        major = self._major.get(x.device.index)
        if major is None:
            major = self._major[x.device.index] = torch.cuda.get_device_capability(x.device)[0]
        x2 = x.reshape(-1, k)
        if dense_takes_gemv(x2.shape[0], k, x.dtype, bias is not None, major) and gemv_fits(x2, weight):
            return x2
        return None

    def folds_norm(self, layer: nn.Module, x: torch.Tensor, norm: nn.Module) -> bool:
        """Where the kernel takes ``layer`` at these rows (one or two) and ``norm`` is this
        platform's RMSNorm (:func:`_folded_norm`): the kernel normalises ``x`` itself, so a
        decode step runs no norm kernel (csrc/gemv.cu, kFoldNorm)."""
        return _folded_norm(norm, self.gemv_rows(x, layer.weight, layer.bias)) is not None

    def adds_residual(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Where the kernel takes ``layer`` at these rows (one or two), it adds ``residual`` in
        its epilogue (csrc/gemv.cu, kAddResidual)."""
        x2 = self.gemv_rows(x, layer.weight, layer.bias)
        return (x2 is not None and residual.dtype == x.dtype and residual.device == x.device
                and residual.shape == (*x.shape[:-1], layer.weight.shape[0]) and residual.stride(-1) == 1)

    def _rows_and_norm(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                       norm: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
        """``x`` (normed here where the kernel cannot fold ``norm``), its kernel rows (None:
        not the kernel's) and the folded norm's ``(gamma, eps)``."""
        x2 = self.gemv_rows(x, layer.weight, bias)
        folded = _folded_norm(norm, x2)
        if norm is not None and folded is None:
            x = norm(x)
            x2 = self.gemv_rows(x, layer.weight, bias)
        return x, x2, folded

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, norm: nn.Module | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias``; with ``norm`` (where :meth:`folds_norm`) of ``norm(x)``, with
        ``residual`` (where :meth:`adds_residual`, not with ``norm``) plus ``residual``."""
        if residual is not None and (norm is not None or not self.adds_residual(layer, x, residual)):
            return residual + self.apply(layer, x, bias, norm)
        x, x2, folded = self._rows_and_norm(layer, x, bias, norm)
        if x2 is None:  # (never with a residual: adds_residual said the kernel takes these rows)
            return F.linear(x, layer.weight, bias)
        res2 = residual.reshape(x2.shape[0], -1) if residual is not None else None
        y = gemv(x2, layer.weight, norm=folded, residual=res2)
        return y.view(*x.shape[:-1], y.shape[-1])

    def apply_silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, silu_and_mul: Callable,
        norm: nn.Module | None = None,
    ) -> torch.Tensor:
        """Where the kernel takes the gate/up projection, SiLU-and-mul runs in its epilogue
        (:func:`gemv_silu_and_mul`: the values of the kernel followed by the platform's
        ``silu_and_mul``, one kernel fewer a layer) when the op it is given is that op; else
        the two ops. ``norm``: as :meth:`apply`'s."""
        x, x2, folded = self._rows_and_norm(layer, x, bias, norm)
        if x2 is None or not fuses_silu_and_mul(silu_and_mul, layer.weight.shape[0] // 2, x):
            return silu_and_mul(self.apply(layer, x, bias, norm if folded is not None else None))
        y = gemv_silu_and_mul(x2, layer.weight, norm=folded)
        return y.view(*x.shape[:-1], y.shape[-1])

    def apply_rope(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                   rotary: nn.Module, norm: nn.Module | None = None) -> torch.Tensor | None:
        """Where the kernel takes the fused QKV projection, the query and key heads are rotated
        in its epilogue (:func:`gemv_rope`; the values of the kernel followed by the platform's
        ``rotary_embedding`` kernel, one kernel fewer a layer), if that op would run its kernel
        on these heads (whole 16-byte vectors: rotary_dim / 2 and the unrotated tail); else
        None. ``norm``: as :meth:`apply`'s (only where :meth:`folds_norm`: a None result leaves
        ``x`` to the caller un-normed)."""
        x2 = self.gemv_rows(x, layer.weight, bias)
        folded = _folded_norm(norm, x2)
        if x2 is None or (norm is not None and folded is None) or not fuses_rope(layer, x2, positions, rotary):
            return None
        d, rot = layer.head_size, rotary.rotary_dim
        y = gemv_rope(x2, layer.weight, positions.reshape(-1), rotary.cos_sin_cache,
                      layer.num_heads + layer.num_kv_heads, d, rot, norm=folded)
        return y.view(*x.shape[:-1], y.shape[-1])


CUDA_DENSE = CudaDenseLinear()
"""The CUDA platform's dense method (shared; it caches each device's compute capability)."""


LM_HEAD_GEMV = False
"""Whether the CUDA platform's ``lm_head`` op sends what :func:`dense_takes_gemv` takes (1-2
rows) through the kernel. Off: written in session 18 and not yet measured in the engine (the
H200's isolated figure, 239 against cuBLAS's 249 us, is docs/benchmarks/cuda_gemv.md's)."""


def lm_head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`core.ops.lm_head` (the product in the inputs' dtype, returned as float32), through
    the kernel where :data:`LM_HEAD_GEMV` and the dense method's routing allow."""
    x2 = CUDA_DENSE.gemv_rows(hidden, weight, None) if LM_HEAD_GEMV and hidden.dim() == 2 else None
    if x2 is None:
        return F.linear(hidden, weight).float()
    return gemv(x2, weight).float()
