"""The CUDA kernels' JIT build through platforms/jit_build.py: what a ``pip install core[cuda]``
user without a prebuilt extension gets on first use. Built once in a temporary
TORCH_EXTENSIONS_DIR (not the machine's cache), then found cached by a second process, and the
JIT-built library's ops checked against plain torch.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/cuda/test_cuda_jit_build.py``
(about a minute on 16 cores: one full nvcc build of csrc/).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

ROOT = Path(__file__).resolve().parents[2]
# Builds (or finds) the library, loads it, and runs copy_blocks against torch indexing.
PROBE = """
import logging, torch
logging.basicConfig(level=logging.INFO)
from platforms import jit_build
from platforms.cuda import build
spec = build.jit_spec()
print('CACHED-BEFORE', jit_build.cached(spec) is not None)
torch.ops.load_library(str(jit_build.build(spec)))
cache = torch.randn(8, 2, 4, 16, 8, device='cuda')  # [blocks, k/v, kv_heads, block 16, head]
expect = cache.clone()
pairs = torch.tensor([[1, 5], [3, 0]], dtype=torch.int64, device='cuda')
expect[5], expect[0] = expect[1].clone(), expect[3].clone()
torch.ops.core_C.copy_blocks([cache], pairs)
torch.cuda.synchronize()
print('COPY-OK', torch.equal(cache, expect))
"""


def _probe(ext_root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_root), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)


def test_the_cuda_kernels_jit_build_once_and_are_found_cached(tmp_path):
    first = _probe(tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr[-6000:]
    assert "CACHED-BEFORE False" in first.stdout and "built the CUDA kernels" in first.stderr
    assert "COPY-OK True" in first.stdout, first.stdout
    second = _probe(tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr[-6000:]
    assert "CACHED-BEFORE True" in second.stdout and "building" not in second.stderr
    assert "COPY-OK True" in second.stdout
