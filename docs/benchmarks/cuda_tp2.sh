#!/usr/bin/env bash
# Tensor parallelism over NCCL on two GPUs (the run behind docs/benchmarks/cuda_tp2.md):
# the TP=2 equality test, then TP=1 against TP=2 on the Llama-3-8B shape (random bf16
# weights). From the repository root on a host with two NVIDIA GPUs, nothing installed:
#   OUT=/tmp/out bash docs/benchmarks/cuda_tp2.sh
# NOT YET RUN: written 2026-11-29 for the lent two-GPU machine (nvidia-h200-x2), which was not
# lent when it was called; no figure in docs/ comes from it.
set -u
OUT=${OUT:-/tmp/cuda_tp2}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} CORE_LOG_LEVEL=INFO
# NVLink multicast stays off (the lent machines' rule; harmless elsewhere).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# The platforms' entry points without installing the package: a dist-info on the path.
shim=$(mktemp -d)
mkdir -p "$shim/core-0.0.0.dist-info"
printf 'Metadata-Version: 2.1\nName: core\nVersion: 0.0.0\n' >"$shim/core-0.0.0.dist-info/METADATA"
printf '[core.platforms]\ncpu = platforms.cpu\ncuda = platforms.cuda\n' >"$shim/core-0.0.0.dist-info/entry_points.txt"
export PYTHONPATH="$PWD:$shim"

nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv | tee "$OUT/gpus.txt"
nvidia-smi topo -m >"$OUT/topo.txt" 2>&1
python3 -c "from platforms.cuda.build import load_ops; load_ops()" >"$OUT/build.log" 2>&1
python3 -m core.benchmarks.shapes llama3-8b /tmp/llama3-8b >/dev/null

timeout 240 python3 -m pytest -q -p no:cacheprovider tests/integration/test_tensor_parallel.py \
  -k cuda_nccl 2>&1 | tee "$OUT/test_tp2.log" | tail -n 3

ENGINE="--model /tmp/llama3-8b --load-format dummy --dtype bfloat16 --platform cuda --max-model-len 2048"
for tp in 1 2; do
  # shellcheck disable=SC2086  # ENGINE is a list of flags
  timeout 200 python3 -m core.entrypoints.cli bench throughput $ENGINE --tensor-parallel-size $tp \
    --num-prompts 500 --input-len 1024 --output-len 128 --max-num-batched-tokens 8192 \
    --output-json "$OUT/thr_tp$tp.json" >"$OUT/thr_tp$tp.log" 2>&1
  echo "throughput tp=$tp rc=$?: $(tail -n 1 "$OUT/thr_tp$tp.log")"
done
# shellcheck disable=SC2086
timeout 150 python3 -m core.entrypoints.cli bench latency $ENGINE --tensor-parallel-size 2 \
  --input-len 128 --output-len 128 --num-iters 2 --output-json "$OUT/latency_tp2.json" \
  >"$OUT/latency_tp2.log" 2>&1
echo "latency tp=2 rc=$?: $(tail -n 1 "$OUT/latency_tp2.log")"
