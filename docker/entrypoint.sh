#!/bin/sh
# Container entry point shared by every image in docker/.
#
# `core serve [ARGS...]` (the images' default command) becomes
#     core serve [$CORE_MODEL] --host $CORE_HOST --port $CORE_PORT [--api-key KEY] [ARGS...]
# so the model comes from CORE_MODEL (typically a path under the /models volume) or, when
# CORE_MODEL is empty, the embedded default model. The API key, if any, is read at start from
# the file named by CORE_API_KEY_FILE (a mounted Docker/Kubernetes secret) or from CORE_API_KEY;
# it is never part of the image. ARGS come last, so a flag given on the `docker run` command
# line wins over the environment. Any other command (`core generate ...`, `core platforms`,
# `bash`) runs unchanged.
set -eu

if [ "$#" -ge 2 ] && [ "$1" = core ] && [ "$2" = serve ]; then
    shift 2
    model="${CORE_MODEL:-}"
    case "$model" in
        /*)
            if [ ! -e "$model" ]; then
                echo "core-entrypoint: CORE_MODEL=$model does not exist inside the container." >&2
                echo "  Mount the model directory, e.g. -v /srv/models:/models:ro, and point" >&2
                echo "  CORE_MODEL at the HF model directory or .gguf file under /models." >&2
                exit 64
            fi ;;
    esac
    key="${CORE_API_KEY:-}"
    if [ -n "${CORE_API_KEY_FILE:-}" ]; then
        if [ ! -r "$CORE_API_KEY_FILE" ]; then
            echo "core-entrypoint: CORE_API_KEY_FILE=$CORE_API_KEY_FILE is not a readable file." >&2
            echo "  Mount the secret, e.g. --mount type=bind,src=/etc/core/api-key,dst=/run/secrets/api-key,ro" >&2
            exit 64
        fi
        key="$(cat "$CORE_API_KEY_FILE")"
    fi
    set -- core serve ${model:+"$model"} \
        --host "${CORE_HOST:-0.0.0.0}" --port "${CORE_PORT:-8000}" \
        ${key:+--api-key "$key"} "$@"
fi
exec "$@"
