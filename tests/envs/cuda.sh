#!/usr/bin/env bash
# Verify the CUDA platform on a host with an NVIDIA GPU: build the kernels, run the
# conformance suite for platform 'cuda', then the GPU tests. CI has no GPU and never runs
# this; it is the run behind the `cuda` row of docs/platforms.md.
#
# Usage (repository root, in an environment with a CUDA build of torch, transformers and
# pytest):
#   tests/envs/cuda.sh               installs this checkout (pip install -e ".[cuda,test]")
#   tests/envs/cuda.sh --no-install  nothing installed: the package's entry points
#                                    (core.platforms, pytest11) come from a dist-info
#                                    written to a temp dir on PYTHONPATH (hosts without
#                                    internet, like the lent H200)
# Set OUT=DIR to keep the logs (DIR/conformance.log, DIR/gpu_tests.log).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
python="${PYTHON:-python3}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}" PYTHONUNBUFFERED=1

if [[ "${1:-}" == "--no-install" ]]; then
    shim="$(mktemp -d)"
    info="$shim/core-0.0.0.dist-info"
    mkdir -p "$info"
    printf 'Metadata-Version: 2.1\nName: core\nVersion: 0.0.0\n' >"$info/METADATA"
    printf '[core.platforms]\ncpu = platforms.cpu\ncuda = platforms.cuda\n\n[pytest11]\n%s\n' \
        'core_conformance = core.conformance.plugin' >"$info/entry_points.txt"
    export PYTHONPATH="$repo:$shim${PYTHONPATH:+:$PYTHONPATH}"
else
    "$python" -m pip install --quiet -e ".[cuda,test]"
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
"$python" - <<'PY' | tee "$out/versions.txt"
import torch, transformers
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}")
PY
# The kernels: the installed extension, or a JIT build of csrc/ (first run ~20 s on 16 cores).
"$python" -c "from platforms.cuda.build import load_ops; load_ops()"

export CORE_PLUGINS=cpu,cuda   # load only what this check needs
status=0
"$python" -m pytest -q -p no:cacheprovider --core-platform=cuda --pyargs core.conformance \
    2>&1 | tee "$out/conformance.log" || status=1
"$python" -m pytest -q -p no:cacheprovider tests/cuda tests/unit/test_cuda_platform.py \
    2>&1 | tee "$out/gpu_tests.log" || status=1
exit $status
