"""Collectives behind one small object, so model code never names a backend or device.

With tensor parallelism off, :class:`SingleRank` makes every collective a no-op and the
parallel layers behave as plain layers. With pipeline parallelism the world of
``tp x pp`` processes is cut into one tensor-parallel group per stage
(:func:`init_parallel_groups`); global rank ``r`` is tensor-parallel rank ``r % tp`` of
stage ``r // tp``, and a :class:`StageLink` carries activations from a rank to the rank of
the same tensor-parallel index in the next stage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

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

    def min_ints(self, values: Sequence[int], device: torch.device) -> list[int]:
        """Element-wise minimum of ``values`` over ranks; every rank gets the same list.

        ``device`` is where the backend can reduce (a CPU tensor for gloo, the rank's
        device for nccl and the like).
        """
        t = torch.tensor(list(values), dtype=torch.int64, device=device)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.group)
        return [int(v) for v in t.tolist()]


class StageLink:
    """Point-to-point sends between neighbouring pipeline stages (global ranks ``rank - tp``
    and ``rank + tp``) on the default process group, through the platform's backend.

    Sends are asynchronous so a stage can start its next micro-batch while the previous
    one's activations are on their way; :meth:`send` waits for the sends before the ones
    it starts (each micro-batch sends a few tensors, so this bounds what is buffered).
    """

    def __init__(self, rank: int, tp: int, pp: int):
        import torch.distributed as dist

        self._dist = dist
        self.prev = rank - tp if rank >= tp else None
        self.next = rank + tp if rank + tp < tp * pp else None
        self._sending: list = []

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        """Start sending ``tensors`` (in order) to the next stage."""
        self.flush()
        # Each tensor is kept beside its request until the send completed.
        for t in tensors:
            t = t.contiguous()
            self._sending.append((self._dist.isend(t, self.next), t))

    def recv(self, like: Sequence[tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> list[torch.Tensor]:
        """Receive tensors of the given (shape, dtype)s, in order, from the previous stage."""
        out = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in like]
        for t in out:
            self._dist.recv(t, self.prev)
        return out

    def flush(self) -> None:
        """Wait for the sends in progress (before new ones, and before leaving the group)."""
        for work, _ in self._sending:
            work.wait()
        self._sending = []


def init_parallel_groups(rank: int, tp: int, pp: int) -> tuple[TorchDistributed, TorchDistributed]:
    """(this rank's tensor-parallel communicator, the whole world's) on an initialised
    default group of ``tp * pp`` ranks. Every rank creates every stage's group, in stage
    order: torch.distributed requires all ranks to take part in each ``new_group``."""
    import torch.distributed as dist

    world = TorchDistributed()
    if pp == 1:
        return world, world
    mine = None
    for stage in range(pp):
        group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
        if stage == rank // tp:
            mine = group
    return TorchDistributed(mine), world


def init_torch_distributed(
    backend: str, rank: int, world_size: int, init_method: str
) -> TorchDistributed:
    """Join (create, for rank 0) the default process group and return its communicator.

    :param backend: the platform's ``distributed_backend()`` (gloo, nccl, xccl, hccl, ...).
    :param init_method: ``tcp://HOST:PORT`` where rank 0 listens; every rank blocks here
        until all ``world_size`` ranks have joined.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError(
            f"this torch build ({torch.__version__}) has no torch.distributed; tensor "
            f"parallelism needs it: install a standard torch wheel"
        )
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return TorchDistributed()


def destroy_torch_distributed() -> None:
    """Leave the default process group if this process is in one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
