"""The JIT build specs of the CPU, CUDA and ROCm kernels (platforms/jit_build.py), without
compiling: every file is digested, keys never depend on where the sources lie, and the ROCm
spec hipifies its private copy only."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from platforms import jit_build
from platforms.cpu import kernels
from platforms.cuda import build as cuda_build
from platforms.rocm import build as rocm_build


@pytest.fixture(params=["cpu", "cuda", "rocm"])
def spec(request) -> jit_build.JitSpec:
    return {"cpu": kernels.jit_spec, "cuda": cuda_build.jit_spec, "rocm": rocm_build.jit_spec}[request.param]()


def test_a_spec_lists_real_files_and_builds_a_subset(spec):
    assert spec.units and set(spec.units) <= set(spec.files)
    assert all((spec.src_dir / f).is_file() for f in spec.files)
    headers = [f for f in spec.files if Path(f).suffix in (".h", ".cuh")]
    assert headers, "headers must be digested too: an edit to one changes the build"


def test_the_key_follows_content_and_flags_never_the_path(spec, tmp_path):
    copy = tmp_path / "another" / "checkout"
    for rel in spec.files:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(spec.src_dir / rel, copy / rel)
    moved = replace(spec, src_dir=copy)
    assert jit_build.key(moved) == jit_build.key(spec)
    assert jit_build.key(replace(moved, cflags=(*spec.cflags, "-DX"))) != jit_build.key(spec)
    header = next(f for f in spec.files if Path(f).suffix in (".h", ".cuh"))
    (copy / header).write_text((copy / header).read_text() + "\n// edited\n")
    assert jit_build.key(moved) != jit_build.key(spec)


def test_the_rocm_spec_hipifies_its_copy_and_leaves_csrc_alone(tmp_path):
    spec = rocm_build.jit_spec()
    before = {f: (spec.src_dir / f).read_bytes() for f in spec.files}
    src = tmp_path / "src"
    for rel in spec.files:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(spec.src_dir / rel, src / rel)
    units = spec.prepare(src)
    assert len(units) == len(spec.units) and all((src / u).is_file() for u in units)
    assert any(u.endswith(".hip") for u in units), units
    assert {f: (spec.src_dir / f).read_bytes() for f in spec.files} == before
