"""The fused sampler's source (csrc/sampling/sample_row.cuh) built for the host, as a
:class:`~core.sampler.kernel.SamplingKernel` over CPU tensors: each block thread is an OS
thread run as a fiber, phases in a shuffled thread order (tests/unit/sampler_kernel_host.cpp).
For tests only; slow by design."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from core.sampler.kernel import KernelInputs

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
HARNESS = Path(__file__).with_name("sampler_kernel_host.cpp")
SOURCES = (HARNESS, CSRC / "sampling" / "sample_row.cuh")


@functools.cache
def host_library() -> ctypes.CDLL:
    """Compiles the harness once per source digest (cached under the temp dir)."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"core_sampler_kernel_host_{digest}.so"
    if not out.exists():
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        assert cxx, "a C++ compiler (g++) is needed to build the host sampler harness"
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(
            [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-pthread", "-I", str(CSRC),
             str(HARNESS), "-o", str(tmp)],
            check=True, capture_output=True, text=True, timeout=600,
        )
        os.replace(tmp, out)
    lib = ctypes.CDLL(str(out))
    lib.sample_rows_host.restype = ctypes.c_int
    return lib


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


class HostKernel:
    """The kernel on ``threads`` emulated threads per block (a power of 2) and ``splits``
    blocks per row (rows the kernel splits: greedy and plain temperature; the blocks run in a
    shuffled order); ``seed`` picks the orders."""

    reads_penalty_state = True

    def __init__(self, threads: int = 8, seed: int = 0, splits: int = 1):
        self.threads = threads
        self.seed = seed
        self.splits = splits
        self.calls = 0

    def accepts(self, logits: torch.Tensor) -> bool:
        return logits.device.type == "cpu"

    def __call__(self, logits: torch.Tensor, inputs: KernelInputs):
        self.calls += 1
        rows, vocab = logits.shape
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        rowf, rowi = inputs.rowf.contiguous(), inputs.rowi.contiguous()
        edits = inputs.edits.contiguous()
        state = inputs.state
        assert state.is_contiguous() and state.dtype == torch.int32 and state.shape[1] % 4 == 0
        tokens = torch.empty(rows, dtype=torch.int64)
        logprobs = torch.empty(rows, dtype=torch.float32)
        lse = torch.empty(rows, dtype=torch.float32)
        rc = host_library().sample_rows_host(
            _ptr(logits), ctypes.c_int64(logits.stride(0)), rows, vocab, _ptr(rowf), _ptr(rowi),
            _ptr(edits) if edits.numel() else None, _ptr(state) if state.numel() else None,
            ctypes.c_int64(state.shape[1]), _ptr(tokens), _ptr(logprobs), _ptr(lse),
            self.threads, ctypes.c_uint64(self.seed), self.splits,
        )
        assert rc != 2, "the kernel's threads disagreed about a barrier (divergent __syncthreads)"
        assert rc != 3, "a split row's arrival count was not left at zero for the next launch"
        assert rc == 0, f"sample_rows_host returned {rc}"
        return tokens, logprobs, lse
