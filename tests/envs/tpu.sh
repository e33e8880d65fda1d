#!/usr/bin/env bash
# Build the TPU platform's environment and verify the platform in it.
#
# Usage: tests/envs/tpu.sh [VENV_DIR]      (default: .venv-tpu in the repo root)
#        KEEP_PLATFORM_ENVS=1 keeps VENV_DIR afterwards (default: deleted, see venv_lib.sh)
#
# torch-xla 2.9 is built against torch 2.9, so this platform cannot live in the main
# environment (torch 2.13). The venv gets torch 2.9 + torch-xla 2.9 + this repo (editable,
# with its test extra); then the conformance suite runs for platform 'tpu' and the TPU unit
# tests run, with XLA on the host CPU (PJRT_DEVICE=CPU): no TPU is needed.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${1:-$repo/.venv-tpu}"
python="${PYTHON:-python3.11}"

source "$repo/tests/envs/venv_lib.sh"
platform_venv_create "$venv" tpu "$python"
# One resolver run for everything, so pip cannot move torch off the minor torch-xla needs.
"$venv/bin/pip" install --quiet --no-cache-dir "torch==2.9.*" "torch-xla==2.9.*" -e "${repo}[tpu,test]"
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
print("tpu env:", {p: md.version(p) for p in ("torch", "torch-xla")})
PY

cd "$repo"
export PJRT_DEVICE=CPU        # XLA's CPU client stands in for the TPU
# Every bucketed shape is a fresh XLA compile; optimisation level 0 compiles the CPU
# programs about 4x faster, and these checks are about results and compile counts.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0"
export CORE_PLUGINS=cpu,tpu   # load only what this check needs
"$venv/bin/python" -m pytest -q -p no:cacheprovider --core-platform=tpu --pyargs core.conformance
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/unit/test_tpu_platform.py tests/unit/test_tpu_buckets.py
platform_venv_done "$venv"
