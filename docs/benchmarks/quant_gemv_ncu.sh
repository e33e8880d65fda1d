#!/usr/bin/env bash
# ncu on the int4 decode GEMV, Llama-3-8B's gate/up (28,672 x 4,096, group 128, zero points;
# SHAPE=down: the down projection, 4,096 x 14,336), ROWS activation rows (default 2): the op as
# the model calls it, the same op held to its CUDA-core kernel, and the fp8 CUDA-core kernel
# for comparison; speed of light, occupancy, scheduler and every warp-stall reason. One row of
# either shape takes the tensor cores (int4_mma_applies: more than 2^24 codes at one row);
# ROWS=1 with tensor cores off shows the CUDA-core kernel. The kernel names in the
# report say which ran. From the repository root on the GPU machine (carry .whl):
#   OUT=/tmp/ncu [ROWS=2] [SHAPE=gate_up|down] bash docs/benchmarks/quant_gemv_ncu.sh
# The report lands in $OUT/ncu.txt; the lines that matter are printed.
set -u
OUT=${OUT:-/tmp/ncu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
export PYTHONPATH=$PWD:/tmp/site
python3 -c "from platforms.cuda.build import load_ops; load_ops()" >"$OUT/build.log" 2>&1 || { tail "$OUT/build.log"; exit 1; }
cat >"$OUT/drive.py" <<'PY'
import os

import torch

from core.quantization.tensors import quantize_fp8_rows
from platforms.cuda.build import load_ops
from platforms.cuda.quant import _pack
from platforms.cuda.quant_bench import _int4

ops, dev = load_ops(), torch.device("cuda")
gen = torch.Generator().manual_seed(0)
n, k = {"gate_up": (28672, 4096), "down": (4096, 14336)}[os.environ.get("SHAPE", "gate_up")]
w4 = _pack(_int4(n, k, gen), dev)
w8 = _pack(quantize_fp8_rows(torch.randn(n, k, generator=gen) / k**0.5), dev)
rows = int(os.environ.get("ROWS", "2"))
x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).to(dev)
y = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
for _ in range(3):  # ncu skips the first three matching launches
    ops.quant_gemv(y, x, w4.codes, w4.scales, w4.mins, w4.code, w4.group, True, w4.zeros)
    ops.quant_gemv(y, x, w4.codes, w4.scales, w4.mins, w4.code, w4.group, False, w4.zeros)
    ops.quant_gemv(y, x, w8.codes, w8.scales, None, w8.code, w8.group, False)
torch.cuda.synchronize()
PY
timeout 300 ncu --kernel-name regex:"int4_gemv_mma|quant_gemv_(1row_)?kernel" --launch-skip 3 --launch-count 3 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
  python3 "$OUT/drive.py" >"$OUT/ncu.txt" 2>&1
grep -E "quant_gemv_(1row_)?kernel|int4_gemv_mma|DRAM Throughput|Duration|Achieved Active Warps|No Eligible|Eligible Warps|Grid Size|Registers Per|stalled_(long_scoreboard|wait|math_pipe_throttle|not_selected|short_scoreboard|dispatch_stall)" \
  "$OUT/ncu.txt" | sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//'
