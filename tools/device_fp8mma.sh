#!/usr/bin/env bash
# fp8 KV on the tensor-core decode attention (attn_mma_fp8_*, issue 17), one call, logs under $OUT:
#   PYTHONPATH=. bash tools/device_fp8mma.sh            # tests, memcheck, probe (~5-8 min)
#   PYTHONPATH=. bash tools/device_fp8mma.sh forward    # stages: tests memcheck probe forward (any subset, in order)
# tests:    tests/gpu/test_attention_mma.py: the kernel vs the numpy spec and the split kernel (27B heads
#           at 40K positions in a 128K+ cache, W 1/8/16, rows past the last lane poisoned with NaN codes),
#           width invariance, attn_probe's own rows vs the spec, FastModel fp8 with the switch on
# memcheck: attn_probe fp8 split + mma rows at 2K / 32K, W 1 / 16, one layer, under compute-sanitizer
#           memcheck (padding after every allocation, no CuPy pool); CUDA_LAUNCH_BLOCKING=1 when the
#           sanitizer is missing (a fault then names its launch)
# probe:    attn_probe bf16 + fp8, split + mma, 2K / 32K / 128K, W 1 / 8 / 16 in b3's order (the PERF.md
#           table; b3 died on the row after fp8 split 2K W=16: fp8 split 32K W=1), then --check rows
#           (each eager round vs the numpy spec) at 2K, two layers
# forward:  the fp8 FastModel GPU suites with fp8 on the mma kernel (Q27_ATTN_DECODE_FP8=1)
# Flip after a clean run: q27py/config.py EngineConfig.attn_decode_fp8 = True (one line).
set -o pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/q27-device}
mkdir -p "$OUT"
LOG="$OUT/fp8mma_log"
say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,compute_cap,memory.total,memory.used --format=csv 2>&1 | tee -a "$LOG"
rc=0
P="python3 -m q27py.bench.attn_probe"
for stage in ${*:-tests memcheck probe}; do
  case "$stage" in
    tests)
      say "attn_mma tests"
      timeout 280 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_attention_mma.py 2>&1 \
        | tee "$OUT/fp8mma_tests.txt" | tail -30 | tee -a "$LOG" || rc=1 ;;
    memcheck)
      CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer \
           /usr/local/cuda/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1)
      ARGS="--ctx 2048 32768 --lanes 1 16 --kv fp8 --impl split mma --layers 1 --reps 3 --no-read-probe --no-pool"
      if [ -n "$CS" ]; then
        PAD=""; "$CS" --help 2>&1 | grep -q -- "--padding" && PAD="--padding 4096"
        say "memcheck ($CS $PAD)"
        timeout 240 "$CS" --tool memcheck $PAD --error-exitcode 3 --print-limit 20 $P $ARGS \
          > "$OUT/fp8mma_memcheck.txt" 2>&1 || rc=1
      else
        say "memcheck: no compute-sanitizer here; CUDA_LAUNCH_BLOCKING=1 instead"
        CUDA_LAUNCH_BLOCKING=1 timeout 240 $P $ARGS > "$OUT/fp8mma_memcheck.txt" 2>&1 || rc=1
      fi
      tail -30 "$OUT/fp8mma_memcheck.txt" | tee -a "$LOG" ;;
    probe)
      say "attn_probe (b3's invocation: bf16 then fp8)"
      timeout 300 $P --json "$OUT/fp8mma_probe.json" > "$OUT/fp8mma_probe.txt" 2>&1 || rc=1
      tail -40 "$OUT/fp8mma_probe.txt" | tee -a "$LOG"
      say "attn_probe --check (vs the numpy spec) 2K"
      timeout 120 $P --ctx 2048 --lanes 1 16 --layers 2 --reps 3 --no-read-probe --check \
        > "$OUT/fp8mma_check.txt" 2>&1 || rc=1
      tail -12 "$OUT/fp8mma_check.txt" | tee -a "$LOG" ;;
    forward)
      say "fp8 FastModel suites on the mma kernel (Q27_ATTN_DECODE_FP8=1)"
      Q27_ATTN_DECODE_FP8=1 timeout 500 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_kv_fp8.py \
        2>&1 | tee "$OUT/fp8mma_forward.txt" | tail -20 | tee -a "$LOG" || rc=1 ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
say "done rc=$rc"
exit $rc
