#!/usr/bin/env bash
# Download, on a machine with PyPI access, the wheels that `core serve` and `core bench serve`
# need on the H200 (Python 3.12, x86-64, no internet there) into .whl/ (git-ignored); then carry
# .whl with the device run of docs/benchmarks/cuda_e2e.sh, which installs them into /tmp/site.
set -eu
cd "$(dirname "$0")/../.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64 -d .whl \
  fastapi starlette pydantic pydantic_core annotated-types annotated-doc typing-inspection uvicorn \
  openai jiter distro sniffio gguf pyzmq msgspec opentelemetry-api typing_extensions httpx2 httpcore2 \
  anyio truststore llguidance jsonschema jsonschema-specifications referencing rpds-py
ls .whl
