"""Fused MoE on CUDA: two grouped GEMMs over expert-sorted tokens (``torch._grouped_mm``).

Same contract and result as :func:`core.ops.fused_moe` (weighted sum accumulated in fp32), but
without a host sync: per-expert token counts come from a ``scatter_add_`` on the device and
become the grouped GEMM's end offsets, so the op can sit inside a captured decode graph.
``torch._grouped_mm`` runs its CUTLASS kernel for bf16 on Hopper (sm90) and newer; other
dtypes and devices go to the reference (eager) or to a dense sync-free form (under capture).
"""

from __future__ import annotations

import torch

from core import ops as reference


def grouped_fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """:func:`core.ops.fused_moe` through ``torch._grouped_mm`` (any device that has it)."""
    num_tokens, k = topk_ids.shape
    num_experts = w13.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)  # end row of each expert's group
    rows = order // k
    xs = x.index_select(0, rows)  # [T*K, hidden], expert-contiguous
    # weights are [E, out, in]; transposed views are the column-major [E, in, out] it wants
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offsets)  # [T*K, 2 * ffn]
    y = torch._grouped_mm(reference.silu_and_mul(h), w2.transpose(1, 2), offs=offsets)
    weighted = y.float() * topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, rows, weighted).to(x.dtype)


def _grouped_ok(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The CUTLASS path's conditions: bf16 on sm90+, 16-byte aligned rows (8 elements)."""
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == w13.dtype == w2.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device)[0] >= 9
        and x.shape[1] % 8 == 0
        and w2.shape[2] % 8 == 0
        and x.is_contiguous()
        and w13.is_contiguous()
        and w2.is_contiguous()
    )


def dense_fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Every expert over every token, weighted by a dense [T, E] routing matrix (zero for
    experts not chosen): E times the FLOPs but no host sync, for graph capture of dtypes the
    grouped GEMM does not take (decode batches, where reading the weights dominates anyway)."""
    dense = torch.zeros(x.shape[0], w13.shape[0], dtype=torch.float32, device=x.device)
    dense.scatter_(1, topk_ids, topk_weights.float())
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        h = torch.nn.functional.linear(x, w13[e])
        y = torch.nn.functional.linear(reference.silu_and_mul(h), w2[e])
        out += dense[:, e : e + 1] * y.float()
    return out.to(x.dtype)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The ``fused_moe`` override: grouped GEMMs where they run; otherwise the reference,
    or while a graph is being captured (the reference syncs) the dense formulation."""
    if _grouped_ok(x, w13, w2):
        return grouped_fused_moe(x, w13, w2, topk_weights, topk_ids)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return dense_fused_moe(x, w13, w2, topk_weights, topk_ids)
    return reference.fused_moe(x, w13, w2, topk_weights, topk_ids)
