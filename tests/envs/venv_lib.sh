# shellcheck shell=bash
# Shared by tests/envs/xpu.sh and tests/envs/tpu.sh (sourced, not run).
#
# PyPI has no CPU build of torch 2.8 / 2.9 for Linux x86_64, so each of these environments
# holds a CUDA build: about 7.5 GB installed (4.3 GB of it NVIDIA libraries), plus the wheels
# while pip installs them. CI's disk is not large enough for both at once beside the main
# environment (CI ran out of space with both kept: "[Errno 28] No space left on device"), so
# `platform_venv_done` deletes an environment after its checks unless KEEP_PLATFORM_ENVS=1.

# Free GiB on the filesystem that holds $1 (or its nearest existing parent).
free_gib() {
    local d="$1"
    while [[ ! -e "$d" ]]; do d="$(dirname "$d")"; done
    df -Pk "$d" | awk 'NR==2 {printf "%d", $4 / 1048576}'
}

# platform_venv_create VENV NAME PYTHON: make VENV with PYTHON unless it exists; refuse up
# front, naming the numbers and the fixes, when its filesystem has less room than needed.
platform_venv_create() {
    local venv="$1" name="$2" python="$3" need_gib=11 free
    if [[ -x "$venv/bin/python" ]]; then
        return 0
    fi
    free="$(free_gib "$venv")"
    echo "tests/envs/$name.sh: $free GiB free for $venv (needs about $need_gib GiB)"
    if (( free < need_gib )); then
        echo "tests/envs/$name.sh: $venv needs about $need_gib GiB free (torch's CUDA build from" \
             "PyPI plus the wheels during install); its filesystem has $free GiB." \
             "Free space, or pass a directory on a larger disk: tests/envs/$name.sh /big/disk/venv-$name" >&2
        exit 1
    fi
    "$python" -m venv "$venv"
}

# platform_venv_done VENV: delete VENV after its checks ran, unless KEEP_PLATFORM_ENVS=1.
platform_venv_done() {
    local venv="$1"
    if [[ "${KEEP_PLATFORM_ENVS:-0}" == "1" ]]; then
        echo "kept $venv (KEEP_PLATFORM_ENVS=1)"
    else
        rm -rf "$venv"
        echo "removed $venv to free its disk space (KEEP_PLATFORM_ENVS=1 keeps it)"
    fi
}
