"""Parallel-aware building blocks shared by the model files.

Every layer takes the :class:`~core.models.ModelContext` and reads the tensor-parallel
group from ``ctx.comm``; with one rank the layers are plain layers and no collective runs.
Sharding follows the usual Megatron split:

* column-parallel linear layers split the *output* features; each rank computes its slice
  and the result stays sharded (attention heads, MLP intermediate);
* row-parallel linear layers split the *input* features; the partial products are summed
  with one ``all_reduce``;
* the vocabulary is split by rows for the embedding (masked lookup + ``all_reduce``) and the
  LM head (``all_gather`` of the logit slices).

Loading: each layer has ``load_weight(param_name, tensor, shard=None)`` that takes the full
checkpoint tensor (usually a memory-mapped view) and copies only this rank's slice into the
parameter, so a rank never materialises more than its shard on its device.
Parameters are created on ``ctx.device`` in ``ctx.dtype`` with ``requires_grad=False``.

Weight formats: the column/row-parallel layers multiply through ``ctx.linear_method``, a
:class:`LinearMethod` strategy chosen by the platform for ``--weight-format``. The dense
``weight`` parameter stays the source of truth (loading and sharding above only see it); a
method may derive a compact form from it, kept on the layer as ``packed_weight``.

Quantized checkpoints (:mod:`core.quantization`): a linear layer's checkpoint weight may
arrive as a quantized weight (``Fp8Weight`` / ``IntWeight``), which shards like a dense
tensor. The layer hands each slice to its method's :meth:`LinearMethod.load_rows`: the dense
methods dequantize it into ``weight``; a method that keeps weights quantized (a platform's
kernels) collects the slices and joins them in ``prepare``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields, is_dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from core.models.rope import cos_sin_table
from core.quantization.tensors import is_quantized

if TYPE_CHECKING:
    from core.models import ModelContext


# ---- helpers ---------------------------------------------------------------------------


def hold_packed_tensors(layer: nn.Module, packed: Any, prefix: str) -> None:
    """Register the tensor fields of ``packed`` (a linear method's packed-weight dataclass;
    None or a marker string: no tensors) as ``layer``'s non-persistent buffers
    ``<prefix><field>``, dropping those an earlier call registered. The engine counts a
    model's weights as its parameters and buffers (``ModelRunner.load_model``: the start-up
    log, and the KV budget where a platform cannot profile), so a method that keeps its weight
    outside ``layer.weight`` registers it here."""
    for name in [n for n in layer._buffers if n.startswith(prefix)]:
        del layer._buffers[name]
    for f in fields(packed) if is_dataclass(packed) else ():
        value = getattr(packed, f.name)
        if isinstance(value, torch.Tensor):
            layer.register_buffer(f"{prefix}{f.name}", value, persistent=False)


def _param(ctx: ModelContext, *shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    data = torch.empty(shape, dtype=dtype or ctx.dtype, device=ctx.device)
    return nn.Parameter(data, requires_grad=False)


def _copy_into(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """Copy with a shape check whose message names the parameter and both shapes."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"checkpoint tensor for {what} has shape {tuple(src.shape)} but the model expects "
            f"{tuple(dst.shape)}; the checkpoint does not match config.json"
        )
    dst.copy_(src)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(
            f"{what} ({total}) is not divisible by the tensor-parallel size ({parts}); "
            f"choose a --tensor-parallel-size that divides {total}"
        )
    return total // parts


def _shard(src: torch.Tensor, dim: int, rank: int, size: int, what: str) -> torch.Tensor:
    """Rank ``rank``'s slice of ``size`` rows/cols of ``src`` along ``dim`` (a view)."""
    if src.shape[dim] < (rank + 1) * size:
        raise ValueError(
            f"checkpoint tensor for {what} has {src.shape[dim]} entries along dim {dim}; "
            f"rank {rank} needs [{rank * size}, {(rank + 1) * size})"
        )
    return src.narrow(dim, rank * size, size)


def load_parameter(model: nn.Module, name: str, tensor: torch.Tensor, shard: Any = None) -> None:
    """Load one checkpoint tensor into the parameter named ``name`` of ``model``.

    Uses the owning module's ``load_weight`` (which shards it for this rank) when it has one,
    otherwise copies the whole tensor after a shape check.
    """
    module_name, _, param_name = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise KeyError(f"the model has no module {module_name!r} (for weight {name!r})") from None
    if is_quantized(tensor) and not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        tensor = tensor.dequantize(torch.float32)  # e.g. MoE experts: loaded dense
    loader = getattr(module, "load_weight", None)
    if loader is not None:
        loader(param_name, tensor, shard)
        return
    param = getattr(module, param_name, None)
    if not isinstance(param, torch.Tensor):
        raise KeyError(f"module {module_name!r} has no parameter {param_name!r}")
    _copy_into(param.data, tensor, name)


class MissingLayer(nn.Module):
    """Stands where a module of another pipeline stage would be: no parameters, and its
    checkpoint weights are skipped on load (see :func:`load_checkpoint`)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a module held by another pipeline stage was called on this one")


def _on_other_stage(model: nn.Module, name: str) -> bool:
    """Whether ``name`` lies under a :class:`MissingLayer` of ``model``."""
    parts = name.split(".")
    for n in range(1, len(parts)):
        try:
            module = model.get_submodule(".".join(parts[:n]))
        except AttributeError:
            return False
        if isinstance(module, MissingLayer):
            return True
    return False


def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: Sequence[tuple[str, str, Any]] = (),
    skip: tuple[str, ...] = (),
) -> None:
    """Load HF-named tensors into ``model``.

    :param stacked: ``(checkpoint part, our part, shard id)``: a checkpoint name containing
        ``checkpoint part`` (e.g. ``".q_proj."``) goes into the fused parameter named with
        ``our part`` (``".qkv_proj."``) as shard ``shard id``.
    :param skip: name suffixes to ignore (e.g. a tied ``lm_head.weight``).
    :raises ValueError: a checkpoint name matches no parameter, or a parameter (or one
        shard of a fused one) received nothing — a truncated or mismatched checkpoint
        would otherwise run with uninitialised weights.
    """
    params = {name for name, _ in model.named_parameters()}
    needed = {name: {s for _, ours, s in stacked if ours in name} or {None} for name in params}
    loaded: dict[str, set] = {name: set() for name in params}
    for name, tensor in weights:
        if name.endswith(skip):
            continue
        target, shard = name, None
        for theirs, ours, shard_id in stacked:
            if theirs in name:
                target, shard = name.replace(theirs, ours), shard_id
                break
        if target not in params and _on_other_stage(model, target):
            continue  # pipeline parallelism: another stage holds this weight
        if target not in params:
            raise ValueError(
                f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}; "
                f"is the architecture in config.json right for these weights?"
            )
        with torch.no_grad():
            load_parameter(model, target, tensor, shard)
        loaded[target].add(shard)
    missing = sorted(f"{n}{'' if s is None else f'[{s}]'}" for n in params for s in needed[n] - loaded[n])
    if missing:
        raise ValueError(
            f"the checkpoint has no weights for {len(missing)} parameter(s) of "
            f"{type(model).__name__}, e.g. {missing[:5]}; it is incomplete or does not match "
            f"config.json"
        )
    with torch.no_grad():
        prepare_weights(model)


# ---- weight formats ------------------------------------------------------------------------


class LinearMethod:
    """How linear layers keep and multiply by their weights: one object per weight format,
    shared by every linear layer of a model. This base class is the ``dense`` format.

    Invariants: a layer's dense ``weight`` [out_per_rank, in_per_rank] (in ``ctx.dtype``) is
    what checkpoints load into, shard by shard; whatever a method derives from it lives in
    ``layer.packed_weight``, which ``load_weight`` resets to None and :meth:`prepare` (run by
    :func:`prepare_weights` after loading, or by :meth:`apply` on first use) rebuilds.
    ``apply`` returns ``x``'s dtype and shape ``[..., out_per_rank]``.
    """

    name = "dense"

    def create_weight(self, ctx: ModelContext, rows: int, cols: int) -> nn.Parameter:
        """The layer's ``weight`` [rows, cols]. Dense formats: allocated in ``ctx.dtype``."""
        return _param(ctx, rows, cols)

    def load_rows(self, layer: nn.Module, offset: int, src: Any, what: str) -> None:
        """Put checkpoint rows ``src`` (this rank's slice: a tensor, or a quantized weight,
        which is dequantized here) at rows ``[offset, offset + len)`` of ``layer.weight``."""
        if is_quantized(src):
            src = src.dequantize(torch.float32)
        _copy_into(_rows_at(layer.weight.data, offset, src.shape[0]), src, what)

    def prepare(self, layer: nn.Module) -> None:
        """Derive ``layer.packed_weight`` from ``layer.weight``. Dense: nothing to derive."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ layer.weight.T + bias`` for this rank's slice of the weight.

        A method whose :meth:`folds_norm` or :meth:`adds_residual` can say yes takes keyword
        ``norm`` (then ``x`` is un-normed: the product is of ``norm(x)``) or ``residual`` (the
        result is ``residual + product``, each rounded to ``x``'s dtype); the layers pass them
        only where it said yes, so this signature stays valid for every other method."""
        return F.linear(x, layer.weight, bias)

    def folds_norm(self, layer: nn.Module, x: torch.Tensor, norm: nn.Module) -> bool:
        """Whether ``apply`` / ``apply_silu_and_mul`` / ``apply_rope`` of ``layer`` over the rows
        ``x`` may be given the RMSNorm module ``norm`` to apply to ``x`` themselves (one kernel
        fewer a decode step on CUDA, :class:`platforms.cuda.gemv.CudaDenseLinear`). Dense: no."""
        return False

    def adds_residual(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether ``apply`` of the (unsharded, bias-free) ``layer`` over the rows ``x`` may be
        given ``residual`` to add to its product itself. Dense: no."""
        return False

    def apply_silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, silu_and_mul: Callable,
        norm: nn.Module | None = None,
    ) -> torch.Tensor:
        """``silu_and_mul(apply(layer, x, bias))`` for a ``[gate | up]`` layer (the platform's
        ``silu_and_mul`` op: gate then up, ``[..., d]`` out). A method whose kernel can apply
        the activation in its epilogue, with the same values, overrides this (and takes
        keyword ``norm`` as ``apply`` does, where its :meth:`folds_norm` says yes)."""
        return silu_and_mul(self.apply(layer, x, bias, **_folded(norm)))

    def apply_rope(
        self, layer: QKVParallelLinear, x: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
        rotary: RotaryEmbedding, norm: nn.Module | None = None,
    ) -> torch.Tensor | None:
        """``apply`` of a fused QKV layer with its query and key heads already rotated by
        ``rotary`` (the platform's ``rotary_embedding``, same values), where the method's kernel
        can rotate them in its epilogue; None where it cannot (the caller rotates). Keyword
        ``norm`` as ``apply``'s, where :meth:`folds_norm` says yes. Dense: None."""
        return None

    def prepare_embedding(self, layer: VocabParallelEmbedding) -> None:
        """Derive a compact form of a loaded embedding table (which a tied LM head shares); a
        method may then release the dense table, if its :meth:`embed` and the platform's
        ``lm_head`` read the compact form instead. Dense: nothing to derive."""

    def embed(self, layer: VocabParallelEmbedding, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (in ``[0, rows_per_rank)``) of this rank's embedding table."""
        return F.embedding(ids, layer.weight)


DENSE = LinearMethod()
"""The dense format (stateless, shared)."""


def _folded(norm: nn.Module | None) -> dict[str, nn.Module]:
    """The keyword that hands a linear method a norm it folds (none without one, so methods
    that never fold keep their plain signatures)."""
    return {} if norm is None else {"norm": norm}


def _rows_at(dst: torch.Tensor, offset: int, rows: int) -> torch.Tensor:
    """Rows ``[offset, offset + rows)`` of ``dst``; past its end (a checkpoint wider than the
    model, or a weight a platform released after deriving its own form from it: the CPU's
    exact int4/int8 codes) a shape mismatch for :func:`_copy_into` to report."""
    if offset + rows > dst.shape[0]:
        return dst.new_empty((max(0, dst.shape[0] - offset), *dst.shape[1:]))
    return dst.narrow(0, offset, rows)


def _load_rows(layer: nn.Module, name: str, offset: int, src: Any, what: str) -> None:
    """Rows of a linear layer's ``weight`` go through its method; its bias is plain."""
    if name == "weight":
        layer.linear_method.load_rows(layer, offset, src, what)
    else:
        _copy_into(_rows_at(getattr(layer, name).data, offset, src.shape[0]), src, what)
    layer.packed_weight = None


def prepare_weights(model: nn.Module) -> None:
    """Let every linear layer's (and embedding's) method derive its weight form from the
    loaded weights."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.linear_method.prepare(module)
        elif isinstance(module, VocabParallelEmbedding):
            module.vocab_method.prepare_embedding(module)


# ---- linear layers -----------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's output rows split across ranks; output stays sharded.

    :param gather_output: all-gather the output so every rank holds all features.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        ctx: ModelContext,
        bias: bool = False,
        gather_output: bool = False,
    ):
        super().__init__()
        self.comm = ctx.comm
        self.input_size = input_size
        self.output_size_per_rank = _divide(output_size, ctx.comm.world_size, "output size")
        self.gather_output = gather_output
        self.linear_method: LinearMethod = ctx.linear_method
        self.weight = self.linear_method.create_weight(ctx, self.output_size_per_rank, input_size)
        self.bias = _param(ctx, self.output_size_per_rank) if bias else None
        self.packed_weight: Any = None

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out_per_rank={self.output_size_per_rank}, "
            f"bias={self.bias is not None}, format={self.linear_method.name}"
        )

    def unfolded(self, x: torch.Tensor, norm: nn.Module | None) -> tuple[torch.Tensor, nn.Module | None]:
        """``(x, norm)`` where this layer's method folds ``norm`` into its product over ``x``
        (:meth:`LinearMethod.folds_norm`), else ``(norm(x), None)``."""
        if norm is None or self.linear_method.folds_norm(self, x, norm):
            return x, norm
        return norm(x), None

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """``x W^T + b``; with ``norm`` (an RMSNorm module), of ``norm(x)``, which the format's
        method may apply inside its kernel."""
        x, norm = self.unfolded(x, norm)
        y = self.linear_method.apply(self, x, self.bias, **_folded(norm))
        if self.gather_output and self.comm.world_size > 1:
            y = self.comm.all_gather(y, dim=-1)
        return y

    def load_weight(self, name: str, tensor: torch.Tensor, shard: Any = None) -> None:
        size, rank = self.output_size_per_rank, self.comm.rank
        _load_rows(self, name, 0, _shard(tensor, 0, rank, size, name), name)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input stored as one matrix.

    Used for the MLP's gate and up projections: the checkpoint has them as separate
    tensors, ``shard`` (their index in ``output_sizes``) says where each one goes. On every
    rank the layout is ``[slice of output 0, slice of output 1, ...]``.
    """

    def __init__(
        self, input_size: int, output_sizes: Sequence[int], ctx: ModelContext, bias: bool = False
    ):
        super().__init__(input_size, sum(output_sizes), ctx, bias)
        tp = ctx.comm.world_size
        self.sizes_per_rank = [_divide(s, tp, "merged output size") for s in output_sizes]

    def silu_and_mul(self, x: torch.Tensor, silu_and_mul: Callable, norm: nn.Module | None = None) -> torch.Tensor:
        """``silu_and_mul(self(x, norm))`` of a ``[gate, up]`` pair through the format's
        :meth:`LinearMethod.apply_silu_and_mul` (which may fuse the two, and the norm)."""
        if len(self.sizes_per_rank) != 2 or self.sizes_per_rank[0] != self.sizes_per_rank[1]:
            raise ValueError(f"silu_and_mul needs a merged layer of two equal outputs, not {self.sizes_per_rank}")
        x, norm = self.unfolded(x, norm)
        return self.linear_method.apply_silu_and_mul(self, x, self.bias, silu_and_mul, **_folded(norm))

    def load_weight(self, name: str, tensor: torch.Tensor, shard: Any = None) -> None:
        if shard is None or not 0 <= shard < len(self.sizes_per_rank):
            raise ValueError(
                f"merged linear weight {name!r} needs a shard index in "
                f"[0, {len(self.sizes_per_rank)}), got {shard!r}"
            )
        size = self.sizes_per_rank[shard]
        offset = sum(self.sizes_per_rank[:shard])
        _load_rows(self, name, offset, _shard(tensor, 0, self.comm.rank, size, name), f"{name}[{shard}]")


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections as one column-parallel matrix.

    Query heads are split across ranks. Key/value heads are split too when there are at
    least as many as ranks; otherwise each KV head is replicated on ``tp / num_kv_heads``
    consecutive ranks (the ranks whose query heads use it). Per-rank output layout:
    ``[q heads of this rank | k heads | v heads]``, each head ``head_size`` wide.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        ctx: ModelContext,
        bias: bool = False,
    ):
        tp = ctx.comm.world_size
        self.num_heads = _divide(num_heads, tp, "number of attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "number of KV heads")
            self.kv_head_start = ctx.comm.rank * self.num_kv_heads
        else:
            replicas = _divide(tp, num_kv_heads, "tensor-parallel size over KV heads")
            self.num_kv_heads = 1
            self.kv_head_start = ctx.comm.rank // replicas
        self.head_size = head_size
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        total = (self.num_heads + 2 * self.num_kv_heads) * head_size
        super().__init__(hidden_size, total * tp, ctx, bias)

    def rotated(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, norm: nn.Module | None = None
    ) -> torch.Tensor | None:
        """``self(x, norm)`` with every query and key head of this rank rotated by ``rotary`` at
        ``positions``, in one step where the format's method can (:meth:`LinearMethod.apply_rope`),
        else None (the caller projects, then rotates). A ``norm`` the method does not fold is
        the caller's to apply first (see :meth:`unfolded`)."""
        if norm is not None and not self.linear_method.folds_norm(self, x, norm):
            return None
        return self.linear_method.apply_rope(self, x, self.bias, positions, rotary, **_folded(norm))

    def load_weight(self, name: str, tensor: torch.Tensor, shard: Any = None) -> None:
        if shard == "q":
            offset, size, start = 0, self.q_size, self.comm.rank * self.q_size
        elif shard in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard == "v" else 0)
            size, start = self.kv_size, self.kv_head_start * self.head_size
        else:
            raise ValueError(f"qkv weight {name!r} needs shard 'q', 'k' or 'v', got {shard!r}")
        if tensor.shape[0] < start + size:
            raise ValueError(
                f"checkpoint {shard}_proj {name} has {tensor.shape[0]} rows; rank "
                f"{self.comm.rank} needs rows [{start}, {start + size}); check num_key_value_heads "
                f"and head_dim in config.json"
            )
        _load_rows(self, name, offset, tensor.narrow(0, start, size), f"{shard}_proj.{name}")


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's input columns split across ranks.

    The input arrives sharded (the output of a column-parallel layer); partial products
    are summed with one ``all_reduce`` and the bias is added once, after the sum.
    """

    def __init__(self, input_size: int, output_size: int, ctx: ModelContext, bias: bool = False):
        super().__init__()
        self.comm = ctx.comm
        self.input_size_per_rank = _divide(input_size, ctx.comm.world_size, "input size")
        self.output_size = output_size
        self.linear_method: LinearMethod = ctx.linear_method
        self.weight = self.linear_method.create_weight(ctx, output_size, self.input_size_per_rank)
        self.bias = _param(ctx, output_size) if bias else None
        self.packed_weight: Any = None

    def extra_repr(self) -> str:
        return (
            f"in_per_rank={self.input_size_per_rank}, out={self.output_size}, "
            f"bias={self.bias is not None}, format={self.linear_method.name}"
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T + b``, all-reduced; with ``residual``, ``residual + that`` (each rounded to
        the dtype), which the format's method may add in its kernel (unsharded, no bias)."""
        if self.comm.world_size == 1:
            if (residual is not None and self.bias is None
                    and self.linear_method.adds_residual(self, x, residual)):
                return self.linear_method.apply(self, x, None, residual=residual)
            y = self.linear_method.apply(self, x, self.bias)
        else:
            y = self.comm.all_reduce(self.linear_method.apply(self, x, None))
            y = y + self.bias if self.bias is not None else y
        return y if residual is None else residual + y

    def load_weight(self, name: str, tensor: torch.Tensor, shard: Any = None) -> None:
        if name == "bias":  # the bias is not split: it is added after the reduction
            _copy_into(self.bias.data, tensor, name)
            return
        src = _shard(tensor, 1, self.comm.rank, self.input_size_per_rank, name)
        _load_rows(self, name, 0, src, name)


# ---- vocabulary ----------------------------------------------------------------------------


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows (the vocabulary) are split across ranks.

    The vocabulary is padded up to a multiple of the tensor-parallel size; rank ``r`` owns
    ids ``[r * rows, (r + 1) * rows)`` (padding rows are zero). Each rank looks up the ids it
    owns, writes zeros for the others, and an ``all_reduce`` assembles the full embedding.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: ModelContext):
        super().__init__()
        self.comm = ctx.comm
        self.num_embeddings = num_embeddings
        self.rows_per_rank = math.ceil(num_embeddings / ctx.comm.world_size)
        self.vocab_start = ctx.comm.rank * self.rows_per_rank
        self.weight = _param(ctx, self.rows_per_rank, embedding_dim)
        # The lookup (LinearMethod.embed). Not named linear_method: code that finds linear layers
        # by that attribute (dummy weights in a kept-quantized format) must not take this one.
        self.vocab_method = ctx.linear_method

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return self.vocab_method.embed(self, input_ids)
        local = input_ids - self.vocab_start
        owned = (local >= 0) & (local < self.rows_per_rank)
        out = self.vocab_method.embed(self, local.masked_fill(~owned, 0))
        out = out.masked_fill(~owned.unsqueeze(-1), 0)
        return self.comm.all_reduce(out)

    def load_weight(self, name: str, tensor: torch.Tensor, shard: Any = None) -> None:
        _load_vocab_rows(self, tensor, name)


class ParallelLMHead(nn.Module):
    """Output projection to the vocabulary, split by vocabulary rows like the embedding.

    :param tied: the model's embedding when the checkpoint ties input and output
        embeddings; its parameter is shared (same sharding), nothing is allocated.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        ctx: ModelContext,
        tied: VocabParallelEmbedding | None = None,
    ):
        super().__init__()
        self.comm = ctx.comm
        self.num_embeddings = num_embeddings
        self.rows_per_rank = math.ceil(num_embeddings / ctx.comm.world_size)
        self.vocab_start = ctx.comm.rank * self.rows_per_rank
        self.tied = tied is not None
        self.weight = tied.weight if tied is not None else _param(ctx, self.rows_per_rank, embedding_dim)
        self.ops = ctx.ops

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32 logits, gathered from all ranks."""
        logits = self.ops.lm_head(hidden, self.weight)  # float32, see core.ops.lm_head
        if self.comm.world_size > 1:
            logits = self.comm.all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]

    def load_weight(self, name: str, tensor: torch.Tensor, shard: Any = None) -> None:
        _load_vocab_rows(self, tensor, name)


def _load_vocab_rows(layer: VocabParallelEmbedding | ParallelLMHead, tensor, name: str) -> None:
    """Copy this rank's vocabulary rows; zero the padding rows past the vocabulary."""
    if tensor.shape[0] != layer.num_embeddings:
        raise ValueError(
            f"checkpoint {name} has {tensor.shape[0]} vocabulary rows but vocab_size is "
            f"{layer.num_embeddings}; the checkpoint does not match config.json"
        )
    rows = max(0, min(layer.rows_per_rank, layer.num_embeddings - layer.vocab_start))
    dst = layer.weight.data
    _copy_into(dst[:rows], tensor.narrow(0, min(layer.vocab_start, layer.num_embeddings), rows), name)
    dst[rows:].zero_()


# ---- norms and rotary ------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm through ``ctx.ops``; ``forward(x, residual)`` fuses the residual add."""

    def __init__(self, hidden_size: int, eps: float, ctx: ModelContext):
        super().__init__()
        self.ops = ctx.ops
        self.eps = eps
        self.weight = _param(ctx, hidden_size)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def load_weight(self, name: str, tensor: torch.Tensor, shard: Any = None) -> None:
        _copy_into(self.weight.data, tensor, name)


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a feature dimension that tensor parallelism splits across ranks (OLMo-2's
    q/k norm over all heads at once): each rank holds ``size`` features starting at ``start``
    of the ``full_size`` ones; the mean square is all-reduced, so the result equals the
    unsharded norm's slice.

    :param replicas: how many ranks hold each feature (KV heads replicated because there are
        fewer than ranks); the all-reduced sum is divided by it.

    A subclass so that whatever treats norms as norms (dummy weights: scale 1) sees it; it
    takes no residual.
    """

    def __init__(
        self, full_size: int, eps: float, ctx: ModelContext, start: int = 0,
        size: int | None = None, replicas: int = 1,
    ):
        super().__init__(size if size is not None else full_size, eps, ctx)
        self.comm = ctx.comm
        self.full_size, self.start, self.replicas = full_size, start, replicas

    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor:
        """x [T, size] (this rank's features) -> normed, same shape and dtype."""
        if self.comm.world_size == 1:
            return self.ops.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        sum_sq = self.comm.all_reduce(xf.pow(2).sum(-1, keepdim=True)) / self.replicas
        return (xf * torch.rsqrt(sum_sq / self.full_size + self.eps) * self.weight.float()).to(x.dtype)

    def load_weight(self, name: str, tensor: torch.Tensor, shard: Any = None) -> None:
        n = self.weight.shape[0]
        _copy_into(self.weight.data, tensor.narrow(0, self.start, n), name)


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The RoPE settings of an HF config as one dict with at least rope_type and rope_theta.

    transformers 5 keeps them in ``rope_parameters``; 4.x in ``rope_theta`` + ``rope_scaling``.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    """Neox-style rotary position embedding with a precomputed cos/sin table.

    The table ``cos_sin_cache`` is [max_position, rotary_dim] float32 (cos half, sin half),
    the layout ``ctx.ops.rotary_embedding`` expects, built by :func:`core.models.rope.cos_sin_table`
    for the RoPE variant in ``params``; positions must be < max_position.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        params: dict[str, Any],
        ctx: ModelContext,
    ):
        super().__init__()
        self.ops = ctx.ops
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        cache = cos_sin_table(rotary_dim, params, max_position)  # every scaling variant
        self.register_buffer("cos_sin_cache", cache.to(ctx.device), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, H, D], key [T, KVH, D] -> rotated, same shapes."""
        return self.ops.rotary_embedding(positions, query, key, self.cos_sin_cache, self.rotary_dim)
