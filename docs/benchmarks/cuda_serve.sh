#!/usr/bin/env bash
# The online rows of docs/benchmarks/cuda_e2e.md: `core serve` on the H200 and `core bench serve`
# against it (512 in / 128 out, streaming /v1/completions, ignore_eos), at Poisson 16 and 32
# requests/s and at saturation (400 prompts at once). Called by cuda_e2e.sh (step `serve`) with
# ENGINE (the engine flags) and RES (where the JSON and logs go) set; the server's own Python
# dependencies must already be importable (cuda_e2e.sh installs them from .whl/).
set -u
PORT=${PORT:-8011}
URL=http://127.0.0.1:$PORT
# shellcheck disable=SC2086  # ENGINE is a list of flags
python3 -m core.entrypoints.cli serve $ENGINE --port "$PORT" --max-num-batched-tokens 8192 \
  >"$RES/serve_server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
t0=$(date +%s)
healthy() { python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$URL/health" 2>/dev/null; }
until healthy; do
  if ! kill -0 $SERVER 2>/dev/null; then echo "server exited"; tail -n 30 "$RES/serve_server.log"; exit 1; fi
  if [ $(($(date +%s) - t0)) -gt 180 ]; then echo "server not ready after 180 s"; exit 1; fi
  sleep 0.5
done
echo "server ready after $(($(date +%s) - t0)) s"
bench() {  # bench NAME RATE N SEED; every request's record in the JSON, the server's metrics after
  python3 -m core.entrypoints.cli bench serve --base-url "$URL" --num-prompts "$3" \
    --input-len 512 --output-len 128 --request-rate "$2" --seed "$4" --save-detailed \
    --output-json "$RES/$1.json" >"$RES/$1.log" 2>&1
  echo "$1 rc=$?"
  python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())" \
    "$URL/metrics" >"$RES/$1.metrics" 2>&1
}
bench serve_warm inf 32 1      # warm-up: graphs, allocator; not reported
bench serve_r4 4 120 2
bench serve_r16 16 400 3
bench serve_r32 32 400 4
bench serve_inf inf 400 5
