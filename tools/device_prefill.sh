#!/usr/bin/env bash
# One device call for the prefill work: GPU tests that the prefill route touches, then the study.
#   bash tools/device_prefill.sh [tests] [study] [replay]
set -o pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 Q27_SHARED=${Q27_SHARED:-.out/shared}
OUT=${OUT:-/tmp/q27-device}; mkdir -p "$OUT"
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE --timeout=600"
rc=0
for stage in ${*:-tests study}; do
  echo "=== $stage ($(date +%T))"
  case "$stage" in
    tests) $PYTEST tests/gpu/test_prefill_blas.py tests/gpu/test_forward.py tests/gpu/test_attention_prefill.py \
             tests/gpu/test_prefix_gpu.py tests/gpu/test_gates.py "tests/gpu/test_kernels.py::test_prefill_gemm_matches_float64" \
             2>&1 | tee "$OUT/tests.txt" | tail -40 || rc=1 ;;
    study) python3 tools/device_prefill.py ${STUDY_ARGS:-} 2>&1 | tee "$OUT/study.txt" || rc=1 ;;
    replay) python3 -m q27py bench replay --random-weights 27b --tier q4s --json > "$OUT/replay.json" 2> >(tee "$OUT/replay.txt" >&2) || rc=1 ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
echo "=== done rc=$rc"
exit $rc
