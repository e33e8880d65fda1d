#!/usr/bin/env bash
# Build the XPU platform's environment and verify the platform in it.
#
# Usage: tests/envs/xpu.sh [VENV_DIR]      (default: .venv-xpu in the repo root)
#        KEEP_PLATFORM_ENVS=1 keeps VENV_DIR afterwards (default: deleted, see venv_lib.sh)
#
# IPEX 2.8 is built against torch 2.8 exactly, so this platform cannot live in the main
# environment (torch 2.13). The venv gets torch 2.8 + intel-extension-for-pytorch 2.8 +
# this repo (editable, with its test extra); then the conformance suite runs for platform
# 'xpu' and the XPU unit tests run. On a host without an Intel GPU the platform runs on
# IPEX's CPU kernels, which is what CI exercises.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${1:-$repo/.venv-xpu}"
python="${PYTHON:-python3.11}"

source "$repo/tests/envs/venv_lib.sh"
platform_venv_create "$venv" xpu "$python"
# One resolver run for everything, so pip cannot upgrade torch past what IPEX was built for.
# IPEX 2.8 patches and imports transformers at import time and breaks on transformers 5
# (NameError: MoeModelOutputWithPast); 4.51.3 is the version IPEX 2.8 was validated with.
"$venv/bin/pip" install --quiet --no-cache-dir \
    "torch==2.8.*" "intel-extension-for-pytorch==2.8.*" "transformers==4.51.3" \
    -e "${repo}[xpu,test]"
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
print("xpu env:", {p: md.version(p) for p in ("torch", "intel-extension-for-pytorch", "transformers")})
PY

cd "$repo"
export CORE_PLUGINS=cpu,xpu   # load only what this check needs
"$venv/bin/python" -m pytest -q -p no:cacheprovider --core-platform=xpu --pyargs core.conformance
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/unit/test_xpu_platform.py
platform_venv_done "$venv"
