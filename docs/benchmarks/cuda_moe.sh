#!/usr/bin/env bash
# Issue 21 on one H200: the MoE/Gemma/Phi CUDA tests, the fused-MoE op benchmark, and batch-1
# latency + 1,000 x 1,024/128 throughput on Mixtral-8x7B- and Qwen3-30B-A3B-shaped models
# (random weights, bf16, all layers). From the repository root, nothing installed:
#   OUT=/tmp/out bash docs/benchmarks/cuda_moe.sh [step ...]     (default: every step)
# Logs and JSON land in $OUT/res; the per-step summary is printed last. Steps: build,
# test_moe, test_gemma, test_attention, bench_op (every shape) or bench_op_<shape>, latency_<shape>,
# thr_<shape> with <shape> qwen3-30b-a3b or mixtral-8x7b. The Mixtral-8x7B shape alone, in
# one 10-minute device command (weights 87 GiB of the H200's 139 GiB; ~35 GiB KV at 0.9):
#   OUT=$OUT/x DEADLINE=580 bash docs/benchmarks/cuda_moe.sh build bench_op_mixtral-8x7b \
#     latency_mixtral-8x7b thr_mixtral-8x7b       (carry .whl)
set -u
OUT=${OUT:-/tmp/cuda_moe}
RES=$OUT/res
DEADLINE=${DEADLINE:-580}
START=$(date +%s)
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 CORE_LOG_LEVEL=INFO
EP=/tmp/core-entry-points/core-0.0.0.dist-info
mkdir -p $EP
printf 'Metadata-Version: 2.1\nName: core\nVersion: 0.0.0\n' >$EP/METADATA
printf '[core.platforms]\ncpu = platforms.cpu\ncuda = platforms.cuda\n' >$EP/entry_points.txt
# The engine's own dependencies missing on the H200's image (msgspec, pyzmq...) travel as
# wheels in .whl/ (docs/benchmarks/cuda_wheels.sh; carry .whl), installed into /tmp/site.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD:$(dirname $EP):/tmp/site

step() {  # step NAME LIMIT_S CMD...
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - ($(date +%s) - START) - 10))
  if [ "$left" -lt 30 ]; then echo "$name skipped (no time left)" | tee -a "$RES/summary.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$(date +%s.%N)
  timeout "$limit" "$@" >"$RES/$name.log" 2>&1
  printf '%-22s rc=%-3s %6.1f s\n' "$name" "$?" "$(awk "BEGIN{print $(date +%s.%N) - $t0}")" \
    | tee -a "$RES/summary.txt"
}
SELECTED="${*:-}"
run() { if [ -z "$SELECTED" ] || [[ " $SELECTED " == *" $1 "* ]]; then step "$@"; fi; }

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv >"$RES/gpu.txt" 2>&1
run build 300 python3 -c "from platforms.cuda.build import load_ops; load_ops()"
run test_moe 200 python3 -m pytest -q -s -p no:cacheprovider tests/cuda/test_cuda_moe.py
run test_gemma 240 python3 -m pytest -q -s -p no:cacheprovider tests/cuda/test_cuda_gemma.py \
  tests/cuda/test_cuda_fallback.py
# the attention op's other callers after its soft-cap argument and head size 256
run test_attention 200 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_paged_decode.py \
  tests/cuda/test_cuda_backend.py tests/cuda/test_cuda_graphs_compile.py tests/cuda/test_cuda_engine_graphs.py
run bench_op 120 python3 -m core.benchmarks.fused_moe --platform cuda --json "$RES/fused_moe.json"
for shape in qwen3-30b-a3b mixtral-8x7b; do
  M=/tmp/$shape
  python3 -m core.benchmarks.shapes $shape $M >/dev/null
  # only when named: "bench_op" (the default run) covers every shape already
  [[ " $SELECTED " == *" bench_op_$shape "* ]] && step bench_op_$shape 90 python3 -m core.benchmarks.fused_moe --platform cuda --shape $shape \
    --json "$RES/fused_moe_$shape.json"
  ENGINE="--model $M --load-format dummy --dtype bfloat16 --platform cuda --max-model-len 2048"
  run latency_$shape 180 python3 -m core.entrypoints.cli bench latency $ENGINE --input-len 128 \
    --output-len 256 --num-iters 3 --output-json "$RES/latency_$shape.json"
  run thr_$shape 300 python3 -m core.entrypoints.cli bench throughput $ENGINE --num-prompts 1000 \
    --input-len 1024 --output-len 128 --max-num-batched-tokens 8192 --output-json "$RES/thr_$shape.json"
done
cat "$RES/summary.txt"
