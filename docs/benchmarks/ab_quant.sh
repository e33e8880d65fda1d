#!/usr/bin/env bash
# Before/after of the quantized decode GEMVs on one device call (timings compare only on one
# machine): the tree before the change, unpacked into .base/ (`git archive <commit> | tar -x -C
# .base`, carried with the call), and this tree; each JIT-builds its kernels, then runs
# cuda_quant.sh's `gemv` (quant_bench at 1-16 rows: bf16 cuBLAS, fp8 on tensor and CUDA cores,
# int4), `fp8_latency` and `awq_latency` (batch-1 TPOT) steps, or those named in STEPS; this
# tree runs tests/cuda/test_cuda_quant.py first; BASE_STEPS (default STEPS) picks the base's
# steps where the new tree's benchmark has variants the base lacks. Carry .base and .whl:
#   OUT=/tmp/abq bash docs/benchmarks/ab_quant.sh
# Everything lands in $OUT/abq.tgz; the summaries are printed last.
set -u
OUT=${OUT:-/tmp/abq}
STEPS=${STEPS:-gemv fp8_latency awq_latency}
mkdir -p "$OUT"
cp docs/benchmarks/cuda_quant.sh .base/docs/benchmarks/
[ -d .whl ] && ln -sfn ../.whl .base/.whl
(cd .base && OUT=$OUT/base DEADLINE=${BASE_S:-220} bash docs/benchmarks/cuda_quant.sh build ${BASE_STEPS:-$STEPS} \
  >"$OUT/base.txt" 2>&1)
OUT=$OUT/new DEADLINE=${NEW_S:-330} bash docs/benchmarks/cuda_quant.sh build test_quant $STEPS >"$OUT/new.txt" 2>&1
tar czf "$OUT/abq.tgz" -C "$OUT" base new base.txt new.txt
rm -rf "$OUT/base" "$OUT/new"
echo "== base"; cat "$OUT/base.txt"
echo "== new"; cat "$OUT/new.txt"
