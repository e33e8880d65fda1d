"""The CUDA platform's fused sampler: ``core_C.sample_rows`` (csrc/sampling), one block per
row (several for the rows of small batches), in place of the torch pipeline's dozens of
launches per step.

It implements :class:`core.sampler.kernel.SamplingKernel`: the rows' parameters arrive
packed by :func:`core.sampler.kernel.pack` (staged through pinned memory by the sampler),
the outputs are allocated here, and nothing waits for the device.
"""

from __future__ import annotations

import torch

from core.sampler.kernel import KernelInputs
from platforms.cuda.build import load_ops

MAX_VOCAB = 1 << 30
"""The kernel indexes tokens with 32-bit integers."""

MAX_SPLITS = 32
"""Most blocks one row is split across (greedy and plain-temperature rows: csrc/sampling/
sample_row.cuh); 32 x 512 threads walk 8 logits each of Llama-3's 128,256."""
MIN_SPLIT_TOKENS = 2048
"""Fewest vocabulary entries a split block takes (four per thread)."""
STATS_BYTES = 48
"""Bytes of one block's first-pass statistics (sizeof(core_sampling::Stats), asserted there)."""


def splits_for(rows: int, vocab: int, sms: int) -> int:
    """Blocks per row: at most one block per SM over the launch (the split kernel's
    occupancy), :data:`MAX_SPLITS`, and :data:`MIN_SPLIT_TOKENS` a block; 1 (one block per row,
    the whole-row kernel) from ``sms / 2`` rows on."""
    if rows <= 0:
        return 1
    splits = min(MAX_SPLITS, sms // rows, vocab // MIN_SPLIT_TOKENS)
    return splits if splits >= 2 else 1


class CudaSamplingKernel:
    """``core_C.sample_rows`` for float32 CUDA logits with contiguous rows; small batches split
    each row across several blocks (:func:`splits_for`). The split launches' workspace (the
    blocks' statistics, the zeroed arrival counts every launch leaves at zero) is kept per
    device and grown on demand: launches on one device must run in order on one stream and
    outside CUDA graphs (as the engine's sampler does: the decode graphs end at the logits)."""

    reads_penalty_state = True
    """Penalised rows read the device penalty state (core/sampler/penalties.py)."""

    def __init__(self):
        self._sms: dict[int, int] = {}
        self._work: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _split_workspace(self, dev: torch.device, rows: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        part, arrivals = self._work.get(dev.index, (None, None))
        if part is None or part.numel() < rows * splits * STATS_BYTES // 8 or arrivals.numel() < rows:
            part = torch.empty(rows * splits * STATS_BYTES // 8, dtype=torch.float64, device=dev)
            arrivals = torch.zeros(max(rows, 64), dtype=torch.int32, device=dev)
            self._work[dev.index] = (part, arrivals)
        return part, arrivals

    def accepts(self, logits: torch.Tensor) -> bool:
        return (
            logits.is_cuda
            and logits.dtype == torch.float32
            and logits.dim() == 2
            and logits.stride(1) == 1
            and 0 < logits.shape[1] < MAX_VOCAB
        )

    def __call__(
        self, logits: torch.Tensor, inputs: KernelInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, dev = logits.shape[0], logits.device
        tokens = torch.empty(rows, dtype=torch.int64, device=dev)
        logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
        lse = torch.empty(rows, dtype=torch.float32, device=dev)
        sms = self._sms.get(dev.index)
        if sms is None:
            sms = self._sms[dev.index] = torch.cuda.get_device_properties(dev).multi_processor_count
        splits = splits_for(rows, logits.shape[1], sms)
        part, arrivals = self._split_workspace(dev, rows, splits) if splits > 1 else (None, None)
        load_ops().sample_rows(
            tokens, logprobs, lse, logits, inputs.rowf, inputs.rowi, inputs.edits, inputs.state,
            logits.shape[1], splits, part, arrivals,
        )
        return tokens, logprobs, lse

    def __repr__(self) -> str:
        return "CudaSamplingKernel()"
