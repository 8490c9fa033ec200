#!/usr/bin/env bash
# One device call for the GEMV (issue 10, deliverable 1): build + SASS counts of the stream loops,
# the GEMV kernel tests for both implementations, and the 27B probe table for v1 and v2.
#   PYTHONPATH=. bash tools/device_gemv.sh            (logs under $OUT if set, else /tmp/q27-gemv)
# Stages can be picked: bash tools/device_gemv.sh sass tests probe  (the default); `sweep` (optional,
# ~1.5 min) forces v2 partitions on gate_up and attn_o.
# Budget: ~4 minutes on an H200 (sass ~0.5 min, tests ~2 min cold incl. NVRTC compiles, probes ~1.5 min).
set -o pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/q27-gemv}
mkdir -p "$OUT"
LOG="$OUT/gemv.log"
say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
rc=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv 2>&1 | tee -a "$LOG"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$LOG"
for stage in ${*:-sass tests probe}; do
  case "$stage" in
    sass)
      # The sources exactly as NVRTC sees them (common.cuh spliced, the constants table as -D).
      say "nvcc -arch=sm_90 + cuobjdump -sass (hot-loop instruction counts)"
      python3 - "$OUT" <<'PY' 2>&1 | tee -a "$LOG"
import subprocess, sys
from pathlib import Path
from q27py.gpu.runtime import compile_options, source_text
out = Path(sys.argv[1])
for name in ("gemv", "gemv2"):
    src = out / f"{name}.cu"
    src.write_text(source_text(name), encoding="utf-8")
    cubin = out / f"{name}.cubin"
    try:
        r = subprocess.run(["nvcc", *compile_options(), "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(cubin),
                            str(src)], capture_output=True, text=True)
    except FileNotFoundError:
        print("nvcc not found: no SASS counts"); break
    (out / f"{name}.ptxas.txt").write_text(r.stderr)
    if r.returncode:
        print(name, "nvcc failed:", r.stderr[-1500:]); continue
    for line in r.stderr.splitlines():
        if "registers" in line or "spill" in line or "Compiling entry" in line:
            print("  ", line.strip())
    try:
        s = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True)
    except FileNotFoundError:
        print("cuobjdump not found: no SASS counts (the cubin is in $OUT)"); break
    (out / f"{name}.sass").write_text(s.stdout)
    print(subprocess.run([sys.executable, "tools/sass_loops.py", str(out / f"{name}.sass")], capture_output=True,
                         text=True).stdout)
PY
      ;;
    tests)
      say "GEMV kernel tests (v1 + v2) and compile checks"
      # (the nvcc builds for sm_80..90 and the spill check run on CPU CI: tests/gpu/test_compile.py)
      timeout 420 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_kernels.py -k "gemv" \
        tests/gpu/test_gemv_plan.py 2>&1 | tee "$OUT/gemv_tests.txt" | tail -40 | tee -a "$LOG" || rc=1 ;;
    probe)
      say "probe: 27B launches, v1 vs v2, L2 defeated"
      timeout 300 python3 -m q27py.bench.gemv_probe --shapes 27b --impl v1 v2 --lanes 1 2 4 8 9 12 16 \
        --json "$OUT/gemv_probe.json" 2>&1 | tee "$OUT/gemv_probe.txt" | tee -a "$LOG" || rc=1
      # A/B of the 16-lane kernels: 2 CTAs/SM at 255 registers with 4 slices in flight, against the
      # default 3 CTAs/SM at 168 registers with 2 (v2 only; same partitions, so the same bits)
      say "probe: v2 16-lane kernels at 2 CTAs/SM, deeper pipeline"
      timeout 200 python3 -m q27py.bench.gemv_probe --shapes gate_up down gdn_in gdn_out attn_in attn_o lm_head --impl v2 \
        --lanes 1 9 16 --set G2_CTAS_NT2=2 PIPE2_Q4=4 PIPE2_Q8=4 PIPE2_BF16=4 \
        --json "$OUT/gemv_probe_nt2deep.json" 2>&1 | tee "$OUT/gemv_probe_nt2deep.txt" | tee -a "$LOG" || rc=1 ;;
    sweep)
      # optional (not in the default set): v2 partitions forced on a big and a mid-size launch, to
      # check kernels.choose_partition's cost model against the device
      for part in "4 1" "4 4" "4 7" "2 7" "2 13" "1 13" "1 20"; do
        say "sweep: v2 partition $part"
        timeout 120 python3 -m q27py.bench.gemv_probe --shapes gate_up attn_o --impl v2 --lanes 1 8 16 \
          --partition $part 2>&1 | tee -a "$OUT/gemv_sweep.txt" | tee -a "$LOG" || rc=1
      done ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
say "done rc=$rc"
exit $rc
