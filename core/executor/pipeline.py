"""Pipeline parallelism: which decoder layers each stage holds, and one stage's step.

The ``tp x pp`` ranks form ``pp`` stages of ``tp`` ranks (global rank ``r`` is stage
``r // tp``). Stage 0 embeds the tokens, every stage runs its layers, the last stage norms,
computes the logits and samples (its tensor-parallel rank 0 answers the driver). Between
stages the hidden state and the residual stream (the model's "intermediate tensors") go
from a rank to the rank of the same tensor-parallel index in the next stage through the
platform's backend (:class:`~core.executor.distributed.StageLink`).

Every stage receives the same schedule and prepares the same step inputs (token count,
positions, attention metadata, its own layers' KV slots), so a receiver knows the shapes
of what arrives without a header.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StageLayers:
    """The decoder layers of one pipeline stage: ``[start, end)`` of ``num_layers``."""

    index: int
    num_stages: int
    start: int
    end: int

    @property
    def is_first(self) -> bool:
        """Holds the embedding (takes token ids rather than activations)."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Holds the final norm and the LM head, and samples."""
        return self.index == self.num_stages - 1

    def holds(self, layer: int) -> bool:
        return self.start <= layer < self.end


def split_layers(num_layers: int, num_stages: int, given: Sequence[int] | None = None) -> list[int]:
    """Layers per stage: ``given`` when set (checked), else as even as possible with the
    larger shares first (30 layers on 4 stages: 8, 8, 7, 7).

    :raises ValueError: a stage would hold no layer, or ``given`` does not fit the model.
    """
    if num_layers < num_stages:
        raise ValueError(
            f"--pipeline-parallel-size {num_stages} would leave {num_stages - num_layers} "
            f"stage(s) without a layer: the model has {num_layers} layers; use at most "
            f"{num_layers} stages"
        )
    if given is not None:
        given = list(given)
        if len(given) != num_stages or sum(given) != num_layers or min(given) < 1:
            even = ",".join(map(str, split_layers(num_layers, num_stages)))
            raise ValueError(
                f"--pp-layer-split {','.join(map(str, given))} does not fit: it needs "
                f"{num_stages} counts >= 1 (one per --pipeline-parallel-size stage) adding up "
                f"to the model's {num_layers} layers; it has {len(given)} adding up to "
                f"{sum(given)}. The even split is {even}"
            )
        return given
    base, extra = divmod(num_layers, num_stages)
    return [base + 1 if i < extra else base for i in range(num_stages)]


def stage_layers(num_layers: int, num_stages: int, index: int,
                 given: Sequence[int] | None = None) -> StageLayers:
    """The layer range of stage ``index`` (see :func:`split_layers`)."""
    counts = split_layers(num_layers, num_stages, given)
    start = sum(counts[:index])
    return StageLayers(index, num_stages, start, start + counts[index])


class PipelineStage:
    """One rank's part of a pipelined step: receive the previous stage's intermediate
    tensors (unless first), run this stage's layers, send them on (unless last).

    The model follows the pipeline contract of :mod:`core.models`: built with
    ``ModelContext.stage``, its ``forward`` takes ``intermediate`` (None on the first stage)
    and returns the final hidden state on the last stage, else a dict of intermediate
    tensors named by ``intermediate_spec``.
    """

    def __init__(self, layers: StageLayers, link):
        self.layers = layers
        self.link = link

    @property
    def is_last(self) -> bool:
        return self.layers.is_last

    def forward(self, model, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata) -> torch.Tensor | None:
        """The last stage's hidden state [T, hidden]; None on the other stages (their
        output went to the next stage)."""
        intermediate = None
        if not self.layers.is_first:
            spec = model.intermediate_spec(input_ids.shape[0])
            received = self.link.recv([(shape, dtype) for _, shape, dtype in spec], input_ids.device)
            intermediate = {name: t for (name, _, _), t in zip(spec, received)}
        out = model(input_ids, positions, kv_caches, metadata, intermediate=intermediate)
        if self.layers.is_last:
            return out
        self.link.send([out[name] for name, _, _ in model.intermediate_spec(input_ids.shape[0])])
        return None

    def profile_forward(self, model, input_ids: torch.Tensor, positions: torch.Tensor,
                        kv_caches: list[torch.Tensor], metadata) -> torch.Tensor | None:
        """Like :meth:`forward` for the memory profile, without the neighbours: a stage
        other than the first runs on zero activations (the peak depends on shapes only)."""
        intermediate = None
        if not self.layers.is_first:
            intermediate = {
                name: torch.zeros(shape, dtype=dtype, device=input_ids.device)
                for name, shape, dtype in model.intermediate_spec(input_ids.shape[0])
            }
        out = model(input_ids, positions, kv_caches, metadata, intermediate=intermediate)
        return out if self.layers.is_last else None


def check_pipeline_support(model_cls: type, architecture: str, pp: int) -> None:
    """Refuse ``pp > 1`` for a model class that does not implement the pipeline contract."""
    if pp > 1 and not getattr(model_cls, "supports_pipeline_parallel", False):
        raise ValueError(
            f"--pipeline-parallel-size {pp}: the {architecture} model ({model_cls.__name__}) "
            f"cannot be split into stages (only the Llama-shaped families can); use "
            f"--pipeline-parallel-size 1 with --tensor-parallel-size to spread it"
        )
