#!/usr/bin/env bash
# The 2026-12-03 diagnosis run of docs/benchmarks/cuda_e2e.md: the serve rows on this tree, then
# the same rows from a copy whose server-side files are those of OLD (a directory holding
# model_runner.py, process.py and server.py, e.g. exported with
#   git show 564a2f1:core/model_runner.py > old/model_runner.py  ... before the device run),
# with docs/benchmarks/gc_log_site/sitecustomize.py logging every collection > 3 ms of every
# process to $OUT/r/diag_{new,old}.log and putting timestamps on the log lines.
#   OUT=/tmp/out OLD=old bash docs/benchmarks/serve_gc_ab.sh      (carry .whl and OLD)
set -u
R=$OUT/r; mkdir -p "$R"
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
cp docs/benchmarks/gc_log_site/sitecustomize.py /tmp/site/  # /tmp/site is on cuda_e2e.sh's PYTHONPATH
export DIAG_LOG=$R/diag_new.log
OUT=$OUT/n DEADLINE=330 bash docs/benchmarks/cuda_e2e.sh build serve >"$R/new.txt" 2>&1
for f in "$OUT"/n/res/serve_*.json; do cp "$f" "$R/$(basename "${f%.json}").new.json"; done
cp "$OUT/n/res/serve_server.log" "$R/server.new.log"
rm -rf /tmp/old && mkdir /tmp/old && cp -r . /tmp/old/
cp "$OLD/model_runner.py" /tmp/old/core/; cp "$OLD/process.py" /tmp/old/core/engine_core/
cp "$OLD/server.py" /tmp/old/core/entrypoints/openai/
export DIAG_LOG=$R/diag_old.log
(cd /tmp/old && OUT=$OUT/o DEADLINE=$((560 - ($(date +%s) - T0))) bash docs/benchmarks/cuda_e2e.sh serve >"$R/old.txt" 2>&1)
for f in "$OUT"/o/res/serve_*.json; do cp "$f" "$R/$(basename "${f%.json}").old.json"; done
cp "$OUT/o/res/serve_server.log" "$R/server.old.log"
(cd "$R" && tar czf "$OUT/r.tgz" .)
tail -n 8 "$R/new.txt"; echo ---; tail -n 6 "$R/old.txt"
