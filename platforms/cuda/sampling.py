"""The CUDA platform's fused sampler: ``core_C.sample_rows`` (csrc/sampling), one block per
row, in place of the torch pipeline's dozens of launches per step.

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


class CudaSamplingKernel:
    """``core_C.sample_rows`` for float32 CUDA logits with contiguous rows."""

    reads_penalty_state = True
    """Penalised rows read the device penalty state (core/sampler/penalties.py)."""

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
        load_ops().sample_rows(
            tokens, logprobs, lse, logits, inputs.rowf, inputs.rowi, inputs.edits, inputs.state,
            logits.shape[1],
        )
        return tokens, logprobs, lse

    def __repr__(self) -> str:
        return "CudaSamplingKernel()"
