"""The CPU platform: runs everywhere, so it is the reference and the fallback."""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from core.attention import AttentionBackend, AttentionSpec
from core.models.layers import LinearMethod
from core.platform import (
    Capability,
    DecodeGraphRunner,
    DecodeGraphSpec,
    ModelForward,
    Platform,
    ProbeResult,
    builtin_backend,
    host_memory,
)
from platforms.cpu import linear
from platforms.cpu.attention import CpuAttentionBackend, CpuPagedAttentionBackend
from platforms.cpu.isa import has_native_bf16, isa_in_force
from platforms.cpu.kernels import kernels_or_none, kernels_status
from platforms.cpu.ops import CpuOps, HeadPolicy
from platforms.cpu.threads import ThreadGovernor


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    # Host RAM is its memory (the default KV budget), nothing to pin, no graphs; decode steps
    # of models it recognises run through one fused kernel call (platforms/cpu/decode_stack.py).
    capabilities = frozenset({Capability.FUSED_DECODE})
    verification = "real hardware"

    def __init__(self) -> None:
        self._governor: ThreadGovernor | None = None
        self._head = HeadPolicy()

    @classmethod
    def probe(cls) -> ProbeResult:
        # Always usable, but any accelerator should win over it. The kernel path is read from
        # /proc/cpuinfo (or the loaded kernels): probing builds nothing.
        bf16 = "native bf16" if has_native_bf16() else "no native bf16"
        return ProbeResult(1, f"{os.cpu_count()} CPU cores, torch {torch.__version__}, "
                              f"kernels: {isa_in_force()} path ({bf16})")

    def device_count(self) -> int:
        return 1

    def memory_info(self, device_index: int = 0) -> tuple[int, int]:
        return host_memory()

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16, torch.float16)

    def default_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        # float32 is exact against the HF reference (and the fastest dense path without
        # native bf16 instructions).
        return torch.float32

    def default_formats(
        self, checkpoint_dtype: torch.dtype, quantization: str | None
    ) -> tuple[torch.dtype, str]:
        # A 4-bit checkpoint (the embedded SmolLM2 Q4_1 GGUF) is best served by bf16 compute
        # over int4 weights when the CPU has native bf16 dot products: ~5x faster decode
        # than float32 and closer to the float32 reference than plain bf16, because the
        # checkpoint's own 4-bit codes come back exactly (docs/benchmarks/cpu.md). Without
        # them (AVX2, Arm) bf16 is emulated: float32 compute over the checkpoint's int4 codes
        # through csrc/cpu's quant_linear, when the kernels can be built here. Anything else
        # stays float32 dense: exact against HF transformers.
        if quantization == "q4" and has_native_bf16():
            return torch.bfloat16, "int4"
        if quantization == "q4" and kernels_status()[0]:
            return torch.float32, "int4"
        return torch.float32, "dense"

    def supported_block_sizes(self) -> tuple[int, ...]:
        return (16, 32, 64, 128)

    def attention_backend_class(
        self, spec: AttentionSpec, requested: str | None = None
    ) -> type[AttentionBackend]:
        if requested is None:
            # The kernel backend when csrc/cpu builds here; plain torch otherwise.
            return CpuPagedAttentionBackend if kernels_or_none() else CpuAttentionBackend
        return builtin_backend(self.name, requested, CpuPagedAttentionBackend, CpuAttentionBackend)

    def ops(self) -> dict[str, Any]:
        kernels = kernels_or_none()
        return CpuOps(kernels, self._head).table() if kernels is not None else {}

    def supported_weight_formats(self) -> tuple[str, ...]:
        return linear.WEIGHT_FORMATS

    def linear_method(self, weight_format: str) -> LinearMethod:
        method = linear.linear_method(weight_format)
        # A quantized format lets a float32 LM head use its exact int8 codes (see CpuOps.lm_head).
        self._head.quantized = weight_format != "dense"
        return method

    @classmethod
    def quantization_methods(cls) -> dict[str, Any]:
        # Every built-in quantized checkpoint loads dequantized into the dense weights (exact:
        # see core/quantization/tensors.py); --weight-format int4/int8 can re-pack them.
        return dict.fromkeys(("fp8", "compressed-tensors", "awq", "gptq", "gguf"))

    @classmethod
    def kv_cache_dtypes(cls) -> tuple[str, ...]:
        return ("fp8_e4m3",)  # both CPU backends (platforms/cpu/attention.py)

    def decode_graph_runner(
        self, model: ModelForward, kv_caches: list[torch.Tensor], spec: DecodeGraphSpec
    ) -> DecodeGraphRunner | None:
        """The fused decode step (csrc/cpu/decode_stack.cpp) for a model it reproduces
        exactly; None (the modules run every step) for any other model or without the kernels."""
        kernels = kernels_or_none()
        if kernels is None or not isinstance(model, torch.nn.Module):
            return None
        from platforms.cpu.decode_stack import fused_decode

        return fused_decode(kernels, model, kv_caches)

    def seed_everything(self, seed: int) -> None:
        torch.manual_seed(seed)

    def step_boundary(self) -> None:
        """Once per step: let the thread governor follow the machine's load (see
        platforms/cpu/threads.py). It starts at the first step, when the engine has set the
        thread count (CORE_NUM_THREADS or torch's default), which becomes the ceiling."""
        if self._governor is None:
            ceiling = torch.get_num_threads()
            self._governor = ThreadGovernor(ceiling, frozenset(os.sched_getaffinity(0)))
            # torch's thread count is process-wide: hand the ceiling back when this engine's
            # platform goes, so a later engine does not start from a lowered count.
            weakref.finalize(self, torch.set_num_threads, ceiling)
        self._governor.tick()
