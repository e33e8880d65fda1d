"""Collectives behind one small object, so model code never names a backend or device.

With tensor parallelism off, :class:`SingleRank` makes every collective a no-op and the
parallel layers behave as plain layers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Communicator(ABC):
    """Collectives over the tensor-parallel group of this process."""

    rank: int = 0
    world_size: int = 1

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks (in place allowed); returns the result."""

    @abstractmethod
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate ``x`` from all ranks along ``dim`` (rank order)."""


class SingleRank(Communicator):
    """The communicator when tensor parallelism is 1."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x


class TorchDistributed(Communicator):
    """Collectives through torch.distributed on an initialised process group."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)
