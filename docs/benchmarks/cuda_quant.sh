#!/usr/bin/env bash
# Issue 22 on one H200: the quantized-linear CUDA tests, the kernel benchmark (GEMV vs
# torch._scaled_mm vs bf16 cuBLAS per Llama-3-8B shape), then end to end on a Llama-3-8B-shaped
# model with random weights: FP8 weights (--quantization fp8: per-channel fp8 weights, decode
# through the fp8 GEMV, prefill through _scaled_mm with per-token activation scales) batch-1
# TPOT, 1,000 x 1,024/128 and 500 x 1,000/1,000 (the last also with --kv-cache-dtype fp8 and
# --max-num-seqs 512: the fp8 cache holds all 500 sequences at once); AWQ int4
# (group 128) batch-1 TPOT (and batch 8, when named; FP8 at batch 2 likewise).
# From the repository root, nothing installed (about 8 minutes in all; carry .whl as for
# cuda_e2e.sh):
#   OUT=/tmp/out bash docs/benchmarks/cuda_quant.sh [step ...]    (default: every step)
# Logs and JSON land in $OUT/res; the summary is printed last. Steps in order of importance;
# DEADLINE (default 560 s) cuts the tail.
set -u
OUT=${OUT:-/tmp/cuda_quant}
RES=$OUT/res
DEADLINE=${DEADLINE:-560}
START=$(date +%s)
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 CORE_LOG_LEVEL=INFO
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  SITE=/tmp/site
fi
EP=/tmp/core-entry-points/core-0.0.0.dist-info
mkdir -p $EP
printf 'Metadata-Version: 2.1\nName: core\nVersion: 0.0.0\n' >$EP/METADATA
printf '[core.platforms]\ncpu = platforms.cpu\ncuda = platforms.cuda\n' >$EP/entry_points.txt
export PYTHONPATH=$PWD:$(dirname $EP)${SITE:+:$SITE}

FP8=/tmp/llama3-8b-fp8      # dense config; --quantization fp8 quantizes the dummy weights
AWQ=/tmp/llama3-8b-awq      # the same shape with an AWQ quantization_config
python3 -m core.benchmarks.shapes llama3-8b $FP8 >/dev/null
python3 -m core.benchmarks.shapes llama3-8b $AWQ >/dev/null
python3 - $AWQ <<'EOF'
import json, sys
p = sys.argv[1] + "/config.json"
c = json.load(open(p))
c["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
json.dump(c, open(p, "w"), indent=1)
EOF
COMMON="--load-format dummy --dtype bfloat16 --platform cuda --max-model-len 2048"
ENGINE_FP8="--model $FP8 --quantization fp8 $COMMON"
ENGINE_AWQ="--model $AWQ $COMMON"

step() {  # step NAME LIMIT_S CMD...
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - ($(date +%s) - START) - 10))
  if [ "$left" -lt 30 ]; then echo "$name skipped (no time left)" | tee -a "$RES/summary.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$(date +%s.%N)
  timeout "$limit" "$@" >"$RES/$name.log" 2>&1
  printf '%-16s rc=%-3s %6.1f s\n' "$name" "$?" "$(awk "BEGIN{print $(date +%s.%N) - $t0}")" \
    | tee -a "$RES/summary.txt"
}
SELECTED="${*:-}"
run() { if [ -z "$SELECTED" ] || [[ " $SELECTED " == *" $1 "* ]]; then step "$@"; fi; }
opt() { if [[ " $SELECTED " == *" $1 "* ]]; then step "$@"; fi; }  # only when named

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv >"$RES/gpu.txt" 2>&1
run build 300 python3 -c "from platforms.cuda.build import load_ops; load_ops()"
run test_quant 200 python3 -m pytest -q -rfE -s -p no:cacheprovider tests/cuda/test_cuda_quant.py
run kernels 90 python3 -m platforms.cuda.quant_bench --rows 1 4 16 64 256 2048 \
  --output-json "$RES/kernels.json"
# The decode-row GEMVs alone, every row count they serve (run only when named).
opt gemv 90 python3 -m platforms.cuda.quant_bench --rows 1 2 4 8 16 \
  --variants bf16 fp8-gemv fp8-gemv-cuda-cores int4-gemv int4-gemv-cuda-cores --output-json "$RES/gemv.json"
run fp8_latency 90 python3 -m core.entrypoints.cli bench latency $ENGINE_FP8 --input-len 128 \
  --output-len 256 --num-iters 3 --output-json "$RES/fp8_latency.json"
run awq_latency 90 python3 -m core.entrypoints.cli bench latency $ENGINE_AWQ --input-len 128 \
  --output-len 256 --num-iters 3 --output-json "$RES/awq_latency.json"
# Two requests at once: fp8's decode GEMVs at 2 rows (run only when named).
opt fp8_latency_b2 90 python3 -m core.entrypoints.cli bench latency $ENGINE_FP8 --batch-size 2 --input-len 128 \
  --output-len 256 --num-iters 3 --output-json "$RES/fp8_latency_b2.json"
# Eight requests at once: the decode GEMVs at 8 rows (run only when named).
opt awq_latency_b8 90 python3 -m core.entrypoints.cli bench latency $ENGINE_AWQ --batch-size 8 --input-len 128 \
  --output-len 256 --num-iters 3 --output-json "$RES/awq_latency_b8.json"
# Where a batch-1 decode step's device time goes, kernel by kernel (run only when named).
opt fp8_timeline 120 env TIMELINE_ENGINE='{"quantization": "fp8"}' python3 docs/benchmarks/decode_timeline.py \
  $FP8 1 "$RES/fp8_timeline.json"
opt awq_timeline 120 python3 docs/benchmarks/decode_timeline.py $AWQ 1 "$RES/awq_timeline.json"
# Where a throughput step's device time goes (run only when named): FP8 weights on 1,000 x
# 1,024/128 (steps 140-300: prompt chunks mixed with decodes), and FP8 weights + FP8 KV on
# 500 x 1,000/1,000 at 512 sequences (steps 400-460: ~500 decode rows, ~1,400 tokens of context).
opt fp8_thr_timeline 200 env TIMELINE_STEPS=140,300 TIMELINE_ENGINE='{"quantization": "fp8"}' \
  python3 docs/benchmarks/decode_timeline.py $FP8 thr:1000:1024:128 "$RES/fp8_thr_timeline.json"
FP8KV_TIMELINE=(env TIMELINE_STEPS=400,460 TIMELINE_ENGINE='{"quantization": "fp8", "kv_cache_dtype": "fp8"}'
  python3 docs/benchmarks/decode_timeline.py $FP8 thr:500:1000:1000:512)
opt fp8kv_thr_timeline 240 "${FP8KV_TIMELINE[@]}" "$RES/fp8kv_thr_timeline.json"
# The same steps' host time by function (cProfile; run only when named).
opt fp8kv_thr_host 240 env TIMELINE_HOST_PROFILE=1 "${FP8KV_TIMELINE[@]}" "$RES/fp8kv_thr_host.json"
# A host-bound throughput run (run only when named): FP8 weights + FP8 KV, 500 x 128/1,000 at
# 512 sequences. Short contexts keep the ~500-row decode step short on the device, so the host's
# work per row sets the pace; its timeline (steps 400-460) shows the split.
opt fp8kv_128_1000 150 python3 -m core.entrypoints.cli bench throughput $ENGINE_FP8 --kv-cache-dtype fp8 \
  --max-num-seqs 512 --num-prompts 500 --input-len 128 --output-len 1000 --max-num-batched-tokens 8192 \
  --output-json "$RES/fp8kv_128_1000.json"
opt fp8kv_128_timeline 200 env TIMELINE_STEPS=400,460 TIMELINE_ENGINE='{"quantization": "fp8", "kv_cache_dtype": "fp8"}' \
  python3 docs/benchmarks/decode_timeline.py $FP8 thr:500:128:1000:512 "$RES/fp8kv_128_timeline.json"
run fp8_1024_128 150 python3 -m core.entrypoints.cli bench throughput $ENGINE_FP8 --num-prompts 1000 \
  --input-len 1024 --output-len 128 --max-num-batched-tokens 8192 --output-json "$RES/fp8_1024_128.json"
run fp8_1000_1000 200 python3 -m core.entrypoints.cli bench throughput $ENGINE_FP8 --num-prompts 500 \
  --input-len 1000 --output-len 1000 --max-num-batched-tokens 8192 --output-json "$RES/fp8_1000_1000.json"
run fp8kv_1000_1000 200 python3 -m core.entrypoints.cli bench throughput $ENGINE_FP8 --kv-cache-dtype fp8 \
  --max-num-seqs 512 --num-prompts 500 --input-len 1000 --output-len 1000 --max-num-batched-tokens 8192 \
  --output-json "$RES/fp8kv_1000_1000.json"

tar czf "$OUT/results.tgz" -C "$OUT" res
python3 - "$RES" <<'EOF'
import json, os, sys
res = sys.argv[1]
def load(name):
    p = os.path.join(res, name + ".json")
    return json.load(open(p)) if os.path.exists(p) else None
for name in ("fp8_latency", "fp8_latency_b2", "awq_latency", "awq_latency_b8"):
    r = load(name)
    if r:
        print(f"{name}: TPOT {r['tpot_ms_median']} ms (min {r['tpot_ms_min']}), TTFT {r['ttft_ms_median']} ms, "
              f"engine start {r['startup_s']} s")
for name in ("fp8_1024_128", "fp8_1000_1000", "fp8kv_1000_1000", "fp8kv_128_1000"):
    r = load(name)
    if r:
        print(f"{name}: {r['requests_per_s']} req/s, {r['output_tokens_per_s']} out tok/s, {r['elapsed_s']} s")
for name in ("fp8_timeline", "awq_timeline", "fp8_thr_timeline", "fp8kv_thr_timeline", "fp8kv_128_timeline"):
    r = load(name)
    if r:
        r = r[0]
        print(f"{name}: wall {r['wall_ms_per_step']} ms/step, busy {r['device_busy_ms_per_step']}, "
              f"host {r['host_ms_per_step']}, rows {r.get('decode_rows_per_step')}, "
              f"prompt tokens {r.get('prompt_tokens_per_step')}")
        for k in r["kernels_us_per_step"][:12]:
            print(f"  {k['us']:8.1f} us x{k['count']:<5} {k['name'][:90]}")
r = load("fp8kv_thr_host")
if r:
    r = r[0]
    print(f"fp8kv_thr_host: {r['profiled_wall_ms_per_step']} ms/step under cProfile")
    for k in r["by_cumtime"][:25]:
        print(f"  {k['cumtime_ms']:8.3f} ms cum {k['tottime_ms']:8.3f} own x{k['calls']:<8} {k['name'][:90]}")
g = load("gemv")
if g:
    for row in g["results"]:
        print(f"  gemv {row['shape']:8s} M={row['rows']:<3d} {row['variant']:20s} {row['us']:8.1f} us "
              f"{row['weight_tb_s']:5.2f} TB/s err {row['rel_error']}")
k = load("kernels")
if k:
    for row in k["results"]:
        if row["rows"] in (1, 16, 256):
            print(f"  {row['shape']:8s} M={row['rows']:<4d} {row['variant']:18s} {row['us']:8.1f} us "
                  f"{row['weight_tb_s']:5.2f} TB/s err {row['rel_error']}")
EOF
cat "$RES/summary.txt"
tail -n 3 "$RES/test_quant.log"
