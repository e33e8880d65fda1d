"""ROCm attention: the CUDA backend's logic over the hipified csrc/ kernels.

The kernels are the CUDA sources hipified (see :mod:`platforms.rocm.build`), with the same
op schemas and KV layout, so the backend logic is the CUDA backend's as well: a
:class:`RocmPagedAttention` builds a :class:`~platforms.cuda.attention.CudaPagedAttention`
that calls the HIP build's ops and forwards every call to it. Its decode plan reads the
device's multiprocessor count, which on ROCm is the number of CUs; the two decode CTAs per
CU it assumes (``CTAS_PER_SM``) is what hipcc reaches for gfx90a (register occupancy and
LDS are checked in tests/compile/test_hip_compiles.py).
"""

from __future__ import annotations

from typing import Any

import torch

from core.attention import AttentionBackend, AttentionMetadata, AttentionSpec
from platforms.cuda.attention import CudaPagedAttention, check_spec
from platforms.rocm.build import load_ops


class RocmPagedAttention(AttentionBackend):
    """Paged attention on AMD GPUs (CDNA): decode by the hipified csrc/ kernels, prompts by
    torch SDPA, KV layout ``[num_blocks, 2, num_kv_heads, block_size, head_size]``.

    :param decode_partition: as for the CUDA backend (None: automatic v1/v2 choice).
    :param ops: the ``torch.ops.core_C`` namespace to call; None loads the HIP build.
    """

    name = "rocm_paged"

    def __init__(self, spec: AttentionSpec, decode_partition: int | None = None, ops: Any = None):
        super().__init__(spec)
        check_spec(spec)  # before building the kernels: a refused layer costs no compile
        self._impl = CudaPagedAttention(
            spec, decode_partition, ops=ops if ops is not None else load_ops()
        )

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return CudaPagedAttention.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        self._impl.write_kv(key, value, kv_cache, slot_mapping)

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        return self._impl.forward(query, key, value, kv_cache, metadata)

    def decode_plan(self, md: AttentionMetadata) -> str:
        """Which decode kernel a batch gets: 'v1' or 'v2/<tokens>' (logs, benchmarks)."""
        return self._impl.decode_plan(md)

    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        load_ops().copy_blocks(kv_caches, pairs)

    @staticmethod
    def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        load_ops().swap_blocks(src, dst, pairs)
