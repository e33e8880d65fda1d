#!/usr/bin/env bash
# Before/after on one device call (timings compare only on one machine): the tree before the
# decode-path changes, unpacked into .base/ (`git archive <commit> | tar -x -C .base`, carried
# with the call), and this tree; each JIT-builds its kernels, then batch-1 TPOT (`core bench
# latency`, 128 in / 256 out, temperature 1) and the engine loop's device timeline
# (decode_timeline.py); this tree also runs the decode-path kernel tests first. The engine needs
# the wheels of .whl/ (docs/benchmarks/cuda_wheels.sh) on the device: carry .base and .whl.
#   OUT=/tmp/ab bash docs/benchmarks/ab_decode.sh
# NEW_STEPS: this tree's cuda_e2e.sh steps (default "build test_decode latency"; e.g. add
# test_sampler or test_gemv for a change there).
# Everything lands in $OUT/ab.tgz; the summaries are printed last.
set -u
OUT=${OUT:-/tmp/ab}
export TIMELINE_BATCHES=${TIMELINE_BATCHES:-1}
cp docs/benchmarks/cuda_e2e.sh docs/benchmarks/decode_timeline.py .base/docs/benchmarks/
[ -d .whl ] && ln -sfn ../.whl .base/.whl
(cd .base && OUT=$OUT/base DEADLINE=${BASE_S:-140} bash docs/benchmarks/cuda_e2e.sh build latency)
OUT=$OUT/new DEADLINE=${NEW_S:-300} bash docs/benchmarks/cuda_e2e.sh ${NEW_STEPS:-build test_decode latency}
(cd .base && OUT=$OUT/base_t DEADLINE=${TL_S:-100} bash docs/benchmarks/cuda_e2e.sh timeline)
OUT=$OUT/new_t DEADLINE=${TL_S:-100} bash docs/benchmarks/cuda_e2e.sh timeline
tar czf "$OUT/ab.tgz" -C "$OUT" base new base_t new_t
for d in base new base_t new_t; do
  echo "== $d"; cat "$OUT/$d/res/summary.txt"
  for f in "$OUT/$d"/res/test_*.log; do [ -f "$f" ] && tail -n 3 "$f"; done
  [ -f "$OUT/$d/res/latency.json" ] && python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('TPOT', r['tpot_ms_median'], 'min', r['tpot_ms_min'], 'TTFT', r['ttft_ms_median'])" "$OUT/$d/res/latency.json"
  [ -f "$OUT/$d/res/timeline.json" ] && python3 -c "
import json,sys
for r in json.load(open(sys.argv[1])):
    print({k: r[k] for k in ('batch','device','wall_ms_per_step','device_busy_ms_per_step','device_gaps_ms_per_step','events_per_step','host_ms_per_step')})
    for k in r['kernels_us_per_step'][:22]: print('  %8.1f us x%5.1f  %s' % (k['us'], k['count'], k['name'][:90]))
" "$OUT/$d/res/timeline.json"
done
rm -rf "$OUT/base" "$OUT/new" "$OUT/base_t" "$OUT/new_t"
