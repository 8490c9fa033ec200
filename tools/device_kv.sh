#!/usr/bin/env bash
# KV formats on the device (issue 17), one call, logs and JSON under $OUT:
#   bash tools/device_kv.sh            # tests, attention / decode / prefill timing, --max-context auto check
#   bash tools/device_kv.sh tests      # stages: tests attention decode prefill window (any subset, in order)
# tests:     tests/gpu/test_kv_fp8.py (fp8 conversion bitwise, store kernel vs numpy spec, split-K
#            attention over fp8, FastModel fp8 vs the reference with kv="fp8", prefix round trip),
#            tests/gpu/test_kv_rotated*.py (k5v3 / k3v3 kernels and FastModel vs the reference with
#            the same format, verify == decode, graphs, prefix round trip, spec == plain, disk cache)
#            plus the existing attention / forward GPU tests (the shared kernels changed)
# attention: decode/verify attention kernels at 2K/32K/128K, every format vs bf16, 27B shapes
# decode:    the random-weight 27B q4s decode step and verify W=16 at 2K/32K/128K, every format
# prefill:   prefill 8K / 32K tokens, every format
# window:    --max-context auto with 8 sequences: window sized, all states allocated, steps at its end
# KV_FORMATS=bf16,k3v3 narrows attention / decode / prefill / window to those formats.
set -o pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/q27-device}
mkdir -p "$OUT"
LOG="$OUT/kv_log"
say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,compute_cap,memory.total,memory.used --format=csv 2>&1 | tee -a "$LOG"
rc=0
FMTS=${KV_FORMATS:-bf16,fp8,k5v3,k3v3}
for stage in ${*:-tests attention decode prefill window}; do
  case "$stage" in
    tests)
      say "kv tests"
      python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_kv_fp8.py tests/gpu/test_kv_fp8_portable.py \
        tests/gpu/test_kv_rotated.py tests/gpu/test_kv_rotated_fast.py tests/gpu/test_kv_rotated_layout.py \
        tests/gpu/test_attention_prefill.py tests/gpu/test_forward.py tests/gpu/test_compile.py 2>&1 \
        | tee "$OUT/kv_tests.txt" | tail -40 | tee -a "$LOG" || rc=1 ;;
    attention|decode|prefill|window)
      say "kv $stage ($FMTS)"
      python3 tools/kv_device.py "$stage" --formats "$FMTS" --kv "$FMTS" > "$OUT/kv_$stage.json" 2> >(tee -a "$LOG" >&2) || rc=1 ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
say "done rc=$rc"
exit $rc
