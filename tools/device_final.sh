#!/usr/bin/env bash
# One closing device call: every GPU test, the canonical gates, and the benchmarks of record
# (27B random weights: kernel bench, trace-driven speculation, agent replay; --max-context auto).
#   bash tools/device_final.sh [tests] [gates] [bench] [spec] [replay] [window]
# At most 8 files under $OUT (the device tool's limit): one per stage plus the log.
set -o pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 Q27_SHARED=${Q27_SHARED:-.out/shared}
OUT=${OUT:-/tmp/q27-final}; mkdir -p "$OUT"
LOG="$OUT/log"
say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
rc=0
for stage in ${*:-tests gates bench spec replay}; do
  say "$stage"
  case "$stage" in
    tests) python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu 2>&1 | tee "$OUT/tests.txt" | tail -15 | tee -a "$LOG" || rc=1 ;;
    gates) python3 gates/run.py 2>&1 | tee -a "$LOG" || rc=1 ;;
    bench) python3 -m q27py bench --random-weights 27b --tier q4s --json > "$OUT/bench.json" 2> >(grep -v "^  gemm" | tee -a "$LOG" >&2) || rc=1 ;;
    spec) python3 -m q27py bench spec-replay --traces q27py/bench/data/spec_traces.json q27py/bench/data/spec_traces_code.json \
            --json > "$OUT/spec.json" 2> >(tee -a "$LOG" >&2) || rc=1 ;;
    replay) python3 -m q27py bench replay --random-weights 27b --tier q4s --json > "$OUT/replay.json" 2> >(grep -v "^turn" | tee -a "$LOG" >&2) || rc=1 ;;
    window) python3 tools/kv_device.py window > "$OUT/window.json" 2> >(tee -a "$LOG" >&2) || rc=1 ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
say "done rc=$rc"
exit $rc
