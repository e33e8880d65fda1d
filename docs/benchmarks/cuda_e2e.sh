#!/usr/bin/env bash
# The H200 run behind docs/benchmarks/cuda_e2e.md: JIT-build the kernels, run the CUDA tests,
# then the end-to-end benchmarks on a Llama-3-8B-shaped model (random weights, bf16) and the
# step profiles. From the repository root, nothing installed:
#   OUT=/tmp/out bash docs/benchmarks/cuda_e2e.sh [step ...]     (default: every step)
# Each step's log and JSON land in $OUT/res; $OUT/results.tgz bundles them; the summary table
# is printed last. A step gets at most its own limit and what is left of DEADLINE seconds.
set -u
OUT=${OUT:-/tmp/cuda_e2e}
RES=$OUT/res
DEADLINE=${DEADLINE:-520}
START=$(date +%s)
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 CORE_LOG_LEVEL=INFO

# The server's Python dependencies (FastAPI, uvicorn, pydantic, pyzmq, msgspec, openai...) are not
# on the H200's image and it has no internet: they travel as wheels in .whl/ (carry it), made
# here with docs/benchmarks/cuda_wheels.sh.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  SITE=/tmp/site
fi

# The platforms' entry points without installing the package: a dist-info on the path.
EP=/tmp/core-entry-points/core-0.0.0.dist-info
mkdir -p $EP
printf 'Metadata-Version: 2.1\nName: core\nVersion: 0.0.0\n' >$EP/METADATA
printf '[core.platforms]\ncpu = platforms.cpu\ncuda = platforms.cuda\n' >$EP/entry_points.txt
export PYTHONPATH=$PWD:$(dirname $EP)${SITE:+:$SITE}

MODEL=/tmp/llama3-8b
ENGINE="--model $MODEL --load-format dummy --dtype bfloat16 --platform cuda --max-model-len 2048"

step() {  # step NAME LIMIT_S CMD...
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - ($(date +%s) - START) - 10))
  if [ "$left" -lt 30 ]; then echo "$name skipped (no time left)" | tee -a "$RES/summary.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$(date +%s.%N)
  echo "$t0" >"$RES/$name.launched"
  timeout "$limit" "$@" >"$RES/$name.log" 2>&1
  local rc=$?
  printf '%-16s rc=%-3s %6.1f s\n' "$name" "$rc" "$(awk "BEGIN{print $(date +%s.%N) - $t0}")" \
    | tee -a "$RES/summary.txt"
}

SELECTED="${*:-}"
run() { if [ -z "$SELECTED" ] || [[ " $SELECTED " == *" $1 "* ]]; then step "$@"; fi; }
opt() { if [[ " $SELECTED " == *" $1 "* ]]; then step "$@"; fi; }  # only when named

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total --format=csv >"$RES/gpu.txt" 2>&1
python3 -m core.benchmarks.shapes llama3-8b $MODEL >/dev/null

run build 300 python3 -c "from platforms.cuda.build import load_ops; load_ops()"
run test_ops 150 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_fused_ops.py \
  tests/cuda/test_cuda_sampler.py \
  tests/cuda/test_cuda_graphs_compile.py tests/unit/test_decode_graph_padding.py
run latency 150 python3 -m core.entrypoints.cli bench latency $ENGINE --input-len 128 \
  --output-len 256 --num-iters 3 --output-json "$RES/latency.json"
run thr_1024_128 200 python3 -m core.entrypoints.cli bench throughput $ENGINE --num-prompts 1000 \
  --input-len 1024 --output-len 128 --max-num-batched-tokens 8192 --output-json "$RES/thr_1024_128.json"
run thr_1000_1000 220 python3 -m core.entrypoints.cli bench throughput $ENGINE --num-prompts 500 \
  --input-len 1000 --output-len 1000 --max-num-batched-tokens 8192 --output-json "$RES/thr_1000_1000.json"
run model_step 220 python3 -m core.benchmarks.model_step $ENGINE --kv-cache-memory 40GiB \
  --decode-batches 1 8 64 256 --context 1024 --prefill-seqs 2 --prefill-len 1024 --iters 20 \
  --profile-dir "$RES/profiles" --output-json "$RES/model_step.json"
run test_engine 200 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_engine_graphs.py
run latency_eager 120 python3 -m core.entrypoints.cli bench latency $ENGINE --input-len 128 \
  --output-len 256 --num-iters 2 --enforce-eager --output-json "$RES/latency_eager.json"
run serve 330 env ENGINE="$ENGINE" RES="$RES" bash docs/benchmarks/cuda_serve.sh
# The device timeline of the engine's own decode loop (batches: TIMELINE_BATCHES, default 1,64)
# and the kernel tests of the decode path (both run only when named).
opt timeline 240 python3 docs/benchmarks/decode_timeline.py $MODEL "${TIMELINE_BATCHES:-1,64}" "$RES/timeline.json"
# The batch-1 TPOT with the shortest v2 decode partition set to P tokens (platforms/cuda/
# attention.py MIN_PARTITION_TOKENS, 256 in the tree), for P in MIN_PARTITIONS.
for P in ${MIN_PARTITIONS:-}; do
  opt latency_p$P 150 python3 -c "import sys, platforms.cuda.attention as a; a.MIN_PARTITION_TOKENS = int(sys.argv[1]); \
from core.entrypoints.cli import main; sys.exit(main(sys.argv[2:]))" "$P" bench latency $ENGINE --input-len 128 \
    --output-len 256 --num-iters 3 --output-json "$RES/latency_p$P.json"
done
opt test_decode 300 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_paged_decode.py \
  tests/cuda/test_cuda_fused_ops.py tests/cuda/test_cuda_backend.py tests/cuda/test_cuda_gemma.py \
  tests/cuda/test_cuda_kv_fp8.py tests/cuda/test_cuda_cache_ops.py tests/cuda/test_cuda_graphs_compile.py \
  tests/cuda/test_cuda_mixed_graphs.py tests/cuda/test_cuda_engine_graphs.py tests/cuda/test_cuda_async_scheduling.py
opt test_sampler 200 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_sampler.py
opt test_gemv 120 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_gemv.py tests/cuda/test_cuda_quant.py
# Variants (run only when named): greedy sampling; more concurrent sequences; step split.
opt latency_greedy 150 python3 -m core.entrypoints.cli bench latency $ENGINE --input-len 128 \
  --output-len 256 --num-iters 3 --greedy --output-json "$RES/latency_greedy.json"
opt thr_1024_128_s512 200 python3 -m core.entrypoints.cli bench throughput $ENGINE \
  --num-prompts 1000 --input-len 1024 --output-len 128 --max-num-batched-tokens 8192 \
  --max-num-seqs 512 --step-timing --output-json "$RES/thr_1024_128_s512.json"
opt thr_1000_1000_s440 220 python3 -m core.entrypoints.cli bench throughput $ENGINE \
  --num-prompts 500 --input-len 1000 --output-len 1000 --max-num-batched-tokens 8192 \
  --max-num-seqs 440 --step-timing --output-json "$RES/thr_1000_1000_s440.json"
# More sequences per step without --step-timing (run 4), and the step split at the default.
opt thr_1000_1000_n512 220 python3 -m core.entrypoints.cli bench throughput $ENGINE \
  --num-prompts 500 --input-len 1000 --output-len 1000 --max-num-batched-tokens 8192 \
  --max-num-seqs 512 --output-json "$RES/thr_1000_1000_n512.json"
opt thr_1024_128_n512 200 python3 -m core.entrypoints.cli bench throughput $ENGINE \
  --num-prompts 1000 --input-len 1024 --output-len 128 --max-num-batched-tokens 8192 \
  --max-num-seqs 512 --output-json "$RES/thr_1024_128_n512.json"
opt thr_1000_1000_split 220 python3 -m core.entrypoints.cli bench throughput $ENGINE \
  --num-prompts 500 --input-len 1000 --output-len 1000 --max-num-batched-tokens 8192 \
  --step-timing --output-json "$RES/thr_1000_1000_split.json"

tar czf "$OUT/results.tgz" -C "$OUT" res
python3 - "$RES" <<'EOF'
import json, os, sys
res = sys.argv[1]
def load(name):
    p = os.path.join(res, name + ".json")
    return json.load(open(p)) if os.path.exists(p) else None
for name in ("latency", "latency_eager", "latency_greedy", *sorted(
        f[:-5] for f in os.listdir(res) if f.startswith("latency_p") and f.endswith(".json"))):
    r = load(name)
    if r:
        launched = float(open(os.path.join(res, name + ".launched")).read())
        print(f"{name}: TPOT {r['tpot_ms_median']} ms (min {r['tpot_ms_min']}), TTFT {r['ttft_ms_median']} ms, "
              f"engine start {r['startup_s']} s, launch->first request served {r['served_at_unix'] - launched:.1f} s")
for name in ("thr_1024_128", "thr_1000_1000", "thr_1024_128_s512", "thr_1000_1000_s440",
             "thr_1000_1000_n512", "thr_1024_128_n512", "thr_1000_1000_split"):
    r = load(name)
    if r:
        print(f"{name}: {r['requests_per_s']} req/s, {r['output_tokens_per_s']} out tok/s, "
              f"{r['total_tokens_per_s']} tok/s, {r['elapsed_s']} s, startup {r['startup_s']} s, "
              f"split {r.get('step_split_s')}")
for name in ("serve_r4", "serve_r16", "serve_r32", "serve_inf"):
    r = load(name)
    if r:
        print(f"{name}: {r['requests_per_s']} req/s, {r['output_tokens_per_s']} out tok/s, "
              f"TPOT p50 {r.get('tpot_ms', {}).get('p50')} ms p99 {r.get('tpot_ms', {}).get('p99')}, "
              f"TTFT p50 {r.get('ttft_ms', {}).get('p50')} ms p99 {r.get('ttft_ms', {}).get('p99')}, "
              f"failed {r['failed']}; server (mean ms) {r.get('server_ms')}")
for r in load("model_step") or []:
    print(r["variant"], "capture_all", r.get("capture_all_s"), "s;", "prefill", r["prefill"])
    for row in r["decode"]:
        print("  ", json.dumps(row))
EOF
cat "$RES/summary.txt"
for f in "$RES"/test_*.log; do tail -n 2 "$f"; done
