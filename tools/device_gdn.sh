#!/usr/bin/env bash
# One device call for the chunked GDN prefill: its GPU tests, the sequential-kernel tests beside
# it, the engine-level GPU tests with the chunked route switched on, then the timing study.
#   bash tools/device_gdn.sh [tests] [engine] [engine2] [study]
# (engine: the model / prefix GPU tests on route "chunked"; engine2: the same on "chunked2")
set -o pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 Q27_SHARED=${Q27_SHARED:-.out/shared}
OUT=${OUT:-/tmp/q27-device}; mkdir -p "$OUT"
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE"
rc=0
for stage in ${*:-tests study}; do
  echo "=== $stage ($(date +%T))"
  case "$stage" in
    tests) $PYTEST tests/gpu/test_gdn_chunk.py "tests/gpu/test_kernels.py::test_gdn_step_verify_and_commit" \
             tests/gpu/test_compile.py 2>&1 | tee "$OUT/gdn_tests.txt" | tail -40 || rc=1 ;;
    # the model / prefix tests with GDN_PREFILL forced to "chunked" (the default is "chunked2")
    engine) GDN_ROUTE=chunked $PYTEST -p tools.gdn_chunked_route tests/gpu/test_forward.py tests/gpu/test_prefix_gpu.py \
              2>&1 | tee "$OUT/gdn_engine.txt" | tail -40 || rc=1 ;;
    engine2) GDN_ROUTE=chunked2 $PYTEST -p tools.gdn_chunked_route tests/gpu/test_forward.py tests/gpu/test_prefix_gpu.py \
              2>&1 | tee "$OUT/gdn_engine2.txt" | tail -40 || rc=1 ;;
    study) python3 tools/device_gdn.py ${STUDY_ARGS:-} 2>&1 | tee "$OUT/gdn_study.txt" || rc=1 ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
echo "=== done rc=$rc"
exit $rc
