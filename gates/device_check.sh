#!/usr/bin/env bash
# One device call: GPU tests, canonical gates and the random-weight 27B bench, logged under $OUT.
#   bash gates/device_check.sh tests gates bench   (stages: tests kernels forward gates bench benchfull shortbench)
# Golden fixtures: Q27_SHARED (default .out/shared, a carried copy of ../shared/fixtures/golden).
set -o pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 Q27_SHARED=${Q27_SHARED:-.out/shared}
OUT=${OUT:-/tmp/q27-device}
mkdir -p "$OUT"
LOG="$OUT/log"
say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv 2>&1 | tee -a "$LOG"
python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)" 2>&1 | tee -a "$LOG"
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE --timeout=600"
rc=0
stages="${*:-tests gates bench}"
for stage in $stages; do
  case "$stage" in
    tests|kernels)
      say "kernel tests"; $PYTEST tests/gpu/test_kernels.py 2>&1 | tee "$OUT/kernels.txt" | tail -60 | tee -a "$LOG" || rc=1
      [ "$stage" = tests ] || continue ;&
    forward)
      say "forward tests"; $PYTEST tests/gpu/test_forward.py tests/gpu/test_gates.py tests/gpu/test_q27file.py 2>&1 | tee "$OUT/forward.txt" | tail -60 | tee -a "$LOG" || rc=1 ;;
    gates)
      say "gates"; python3 gates/run.py --update 2>&1 | tee -a "$LOG" || rc=1
      cp gates/canonical.json "$OUT/canonical.json" ;;
    bench)
      say "bench quick"; python3 -m q27py bench --random-weights 27b --tier q4s --quick --json > "$OUT/bench.json" 2> >(tee -a "$LOG" >&2) || rc=1 ;;
    benchfull)
      for tier in ${TIERS:-q4s}; do
        say "bench full $tier"; python3 -m q27py bench --random-weights 27b --tier "$tier" --json > "$OUT/bench_$tier.json" 2> >(tee -a "$LOG" >&2) || rc=1
      done ;;
    shortbench)
      say "shortbench (bundled model, bf16)"; python3 -m q27py bench shortbench --json > "$OUT/shortbench.json" 2> >(tee -a "$LOG" >&2) || rc=1 ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
say "done rc=$rc"
exit $rc
