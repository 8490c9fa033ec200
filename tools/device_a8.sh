#!/usr/bin/env bash
# One device call for the a8 GEMV (issue 10): kernel tests (v1 / v2 / a8 + quant_act8), the 27B probe
# table v1 vs a8, an ncu pass on gate_up at 1 lane, then the decode bench with Q27_GEMV=a8.
#   PYTHONPATH=. bash tools/device_a8.sh [tests] [probe] [ncu] [bench]      (logs under $OUT)
set -o pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/q27-a8}; mkdir -p "$OUT"
say() { echo "=== $* ($(date +%T))"; }
rc=0
git log -1 --format='commit %h %s' 2>/dev/null
for stage in ${*:-tests probe ncu bench}; do
  case "$stage" in
    tests) say tests
      timeout 420 python3 -m pytest -q -x -p no:cacheprovider -rfE tests/gpu/test_kernels.py -k "gemv or quant_act8" \
        tests/gpu/test_a8_layout.py tests/gpu/test_gemv_plan.py 2>&1 | tail -25 || { rc=1; break; } ;;
    probe) say probe
      timeout 300 python3 -m q27py.bench.gemv_probe --shapes 27b --impl v1 a8 --lanes 1 4 8 9 16 \
        --json "$OUT/probe.json" 2>&1 | tail -30 || rc=1 ;;
    ncu) say ncu
      timeout 200 ncu --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
        -k regex:gemv8_q4 python3 -m q27py.bench.gemv_probe --rows 34816 --cols 5120 --impl a8 --lanes 1 --once \
        > "$OUT/ncu.txt" 2>&1; grep -E "DRAM Throughput|Memory Throughput|Issue Slots|Achieved Occupancy|Warp Cycles Per Issued|Stall|Eligible Warps|No Eligible|Registers" "$OUT/ncu.txt" | head -30 ;;
    bench) say "bench a8 quick"
      Q27_GEMV=a8 timeout 400 python3 -m q27py bench --random-weights 27b --tier q4s --quick --json > "$OUT/bench_a8.json" 2> "$OUT/bench_a8.log"
      tail -25 "$OUT/bench_a8.log" ;;
  esac
done
exit $rc
