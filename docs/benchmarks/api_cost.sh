#!/bin/bash
# The API process's own cost, on a CPU (no GPU needed): what `core serve` spends per streamed
# token outside the engine core, and how long it takes from launch to a healthy /health.
#
#   bash docs/benchmarks/api_cost.sh tokens [N]   # CPU time per streamed token, per thread
#   bash docs/benchmarks/api_cost.sh startup [N]  # launch -> /health answers 200, N launches
#
# Model: the llama3-tiny shape (Llama-3's 128,256-token vocabulary, 2 small layers, dummy
# weights), so the engine core is cheap and the per-token work of the API process (output
# thread: IPC decode, detokenizer, metrics; event loop: SSE chunks, HTTP writes) is what the
# H200 runs see per token. The figure is the API process's CPU time (utime + stime of each
# thread, /proc) over one timed `core bench serve` run (N prompts x 64 in / 128 out, 64 in
# flight) divided by the tokens streamed: CPU time, not wall time, so a shared machine moves it
# little. ROOT=DIR measures another checkout (e.g. a git worktree of an older commit) with this
# checkout's .venv.
set -euo pipefail
MODE=${1:-tokens}; N=${2:-150}
HERE=$(cd "$(dirname "$0")/../.." && pwd)
ROOT=${ROOT:-$HERE}
PY="$HERE/.venv/bin/python"
PORT=${PORT:-8011}
MODEL=${MODEL:-/tmp/core-llama3-tiny}
cd "$ROOT"
[ -f "$MODEL/config.json" ] || "$PY" -m core.benchmarks.shapes llama3-tiny "$MODEL" >/dev/null
SERVE=("$PY" -m core.entrypoints.cli serve "$MODEL" --load-format dummy --platform cpu --dtype float32
       --max-model-len 1024 --port "$PORT")
BENCH=("$PY" -m core.entrypoints.cli bench serve --base-url "http://127.0.0.1:$PORT" --input-len 64
       --max-concurrency 64 --token-range 100 120000)

if curl -s "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then
    echo "something already answers on port $PORT; stop it or set PORT" >&2; exit 2
fi

wait_healthy() {  # bounded: 300 s
    for _ in $(seq 1 1500); do
        kill -0 "$1" 2>/dev/null || { echo "server exited (is port $PORT free?)" >&2; return 1; }
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
        sleep 0.2
    done
    echo "server not healthy after 300 s" >&2; return 1
}

snap() {  # "thread ticks" for every thread of $1 (the main thread is the event loop)
    for t in /proc/"$1"/task/*; do
        tid=${t##*/}
        name=$([ "$tid" = "$1" ] && echo event-loop || echo "thread-$tid")
        echo "$name $(awk '{print $14 + $15}' "$t/stat")"
    done
}

if [ "$MODE" = startup ]; then
    for i in $(seq 1 "$N"); do
        t0=$(date +%s.%N)
        CORE_LOG_LEVEL=WARNING "${SERVE[@]}" >/dev/null 2>&1 &
        sp=$!
        wait_healthy $sp
        echo "launch -> healthy: $(echo "$(date +%s.%N) - $t0" | bc | xargs printf '%.2f') s ($(git -C "$ROOT" rev-parse --short HEAD))"
        kill -INT $sp; wait $sp || true
    done
    exit 0
fi

CORE_LOG_LEVEL=WARNING "${SERVE[@]}" >/dev/null 2>&1 &
sp=$!
trap 'kill -INT $sp 2>/dev/null; wait $sp 2>/dev/null || true' EXIT  # the port is free again after
wait_healthy $sp
"${BENCH[@]}" --num-prompts 20 --output-len 32 >/dev/null 2>&1  # warm-up
snap $sp > /tmp/api_cost.t0
"${BENCH[@]}" --num-prompts "$N" --output-len 128 2>&1 | grep "online at"
snap $sp > /tmp/api_cost.t1
"$PY" - "$N" "$(getconf CLK_TCK)" "$(git -C "$ROOT" rev-parse --short HEAD)" <<'PY'
import sys
n, hz, rev = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
read = lambda p: {k: int(v) for k, v in (line.split() for line in open(p))}
a, b = read("/tmp/api_cost.t0"), read("/tmp/api_cost.t1")
tokens = n * 128
us = {k: (b[k] - a.get(k, 0)) / hz / tokens * 1e6 for k in b}
other = sum(v for k, v in us.items() if k != "event-loop")
print(f"{rev}: API process {sum(us.values()):.1f} us CPU per streamed token "
      f"(event loop {us.get('event-loop', 0):.1f}, other threads {other:.1f}; {tokens} tokens)")
PY
