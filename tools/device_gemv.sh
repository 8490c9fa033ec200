#!/usr/bin/env bash
# One device call for the GEMV (issue 10, deliverable 1): build + SASS counts of the stream loops,
# the GEMV kernel tests for both implementations, and the 27B probe table for v1 and v2.
#   PYTHONPATH=. bash tools/device_gemv.sh            (logs under $OUT if set, else /tmp/q27-gemv)
# Stages can be picked: bash tools/device_gemv.sh sass tests probe  (the default); `sweep` (optional,
# ~1.5 min) forces v2 partitions on gate_up and attn_o.
# Budget: ~4 minutes on an H200 (sass ~0.5 min, tests ~2 min cold incl. NVRTC compiles, probes ~1.5 min).
# Later stages (2026-12-01 night, docs/PERF.md d1-d15): splits (a8 K-split sweep), occ (ring depth /
# resident CTAs A/B), cluster (DSMEM split-K A/B + trace), lanes (tests, probe, trace, gates, bench),
# actring (activations in the ring A/B), norms (fused a8 norms), final (engine tests, batch probe, spec
# replay), ncu, ncu16, masks.
set -o pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 Q27_SHARED=${Q27_SHARED:-.out/shared}
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE"
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
    splits)  # a8 K-split sweep per 27B launch (the hardware scheduler as the schedule)
      timeout 300 python3 -m q27py.bench.gemv_probe --shapes gate_up down gdn_in gdn_out attn_in lm_head --impl a8 \
        --lanes 1 8 16 --splits ${SPLITS:-1 2 3 4 6 8} --json "$OUT/sweep.json" > "$OUT/sweep.txt" 2>&1 || rc=1
      cat "$OUT/sweep.txt" | tail -45 ;;
    occ)  # ring depth / resident CTAs A/B (constants-table overrides; the probe compiles with them)
      for cfg in "" "RING_Q4=5" "A8_CTAS_NT1=3 RING_Q4=3" "A8_CTAS_NT1=4 RING_Q4=2"; do
        echo "--- ${cfg:-baseline}"; set --; [ -n "$cfg" ] && set -- --set $cfg
        timeout 150 python3 -m q27py.bench.gemv_probe --shapes gate_up gdn_in lm_head --impl a8 --lanes 1 8 16 "$@" \
          > "$OUT/occ_a.txt" 2>&1 || rc=1; grep -E "^(gate_up|gdn_in|lm_head|Trace|cupy)" "$OUT/occ_a.txt"
        timeout 150 python3 -m q27py.bench.gemv_probe --shapes down gdn_out --impl a8 --lanes 1 8 16 --splits 2 3 4 5 6 "$@" \
          > "$OUT/occ_b.txt" 2>&1 || rc=1; grep -E "^(down|gdn_out|Trace|cupy)" "$OUT/occ_b.txt"
      done ;;
    cluster)  # DSMEM split-K (thread-block clusters): bits against the ticket path, trace, probe A/B, split sweep
      timeout 300 $PYTEST tests/gpu/test_kernels.py -k "gemv or cluster" tests/gpu/test_pdl.py \
        > "$OUT/cluster.txt" 2>&1 || rc=1; tail -4 "$OUT/cluster.txt"
      timeout 120 python3 tools/gemv_trace.py --shapes down gdn_out --lanes 1 > "$OUT/cluster_trace.txt" 2>&1 || rc=1
      cat "$OUT/cluster_trace.txt"
      for c in 0 8; do
        timeout 200 python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8 --lanes 1 8 16 --set GEMV_CLUSTER_MAX=$c \
          --json "$OUT/cluster_probe$c.json" > "$OUT/cluster_probe$c.txt" 2>&1 || rc=1
        echo "--- GEMV_CLUSTER_MAX=$c"; grep -vE "^(mtp_)" "$OUT/cluster_probe$c.txt" | tail -9
      done
      timeout 200 python3 -m q27py.bench.gemv_probe --shapes gate_up down gdn_out attn_in --impl a8 --lanes 1 8 16 \
        --splits 2 3 4 6 8 > "$OUT/cluster_sweep.txt" 2>&1 || rc=1; grep -E "^(gate|down|gdn|attn)" "$OUT/cluster_sweep.txt" ;;
    lanes)  # valid-lane epilogues + smallest-launch-first: bits (tests, gates), probe, trace, then the decode bench
      timeout 300 $PYTEST tests/gpu/test_kernels.py -k "gemv or cluster or rmsnorm" tests/gpu/test_gemv_plan.py \
        tests/gpu/test_pdl.py > "$OUT/lanes.txt" 2>&1 || rc=1; tail -4 "$OUT/lanes.txt"
      timeout 200 python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8 --lanes 1 8 16 --json "$OUT/lanes_probe.json" \
        > "$OUT/lanes_probe.txt" 2>&1 || rc=1; grep -vE "^(mtp_)" "$OUT/lanes_probe.txt" | tail -9
      timeout 120 python3 tools/gemv_trace.py --shapes down gdn_out --lanes 1 > "$OUT/lanes_trace.txt" 2>&1 || rc=1
      grep -E "^(down|gdn)|phase" "$OUT/lanes_trace.txt"
      timeout 400 python3 gates/run.py > "$OUT/lanes_gates.txt" 2>&1 || rc=1; tail -6 "$OUT/lanes_gates.txt"
      timeout 420 python3 -m q27py bench --random-weights 27b --tier q4s --quick --json > "$OUT/bench.json" \
        2> "$OUT/bench.txt" || rc=1; grep -v "^  gemm " "$OUT/bench.txt" | tail -22 ;;
    actring)  # activations in the ring vs the register look-ahead, one process each, then the tests
      for a in 0 1; do
        timeout 200 python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8 --lanes 1 2 8 16 --set GEMV_ACT_RING=$a \
          > "$OUT/actring$a.txt" 2>&1 || rc=1; echo "--- GEMV_ACT_RING=$a"; grep -vE "^(mtp_)" "$OUT/actring$a.txt" | tail -9
      done
      timeout 300 $PYTEST tests/gpu/test_kernels.py -k "gemv or cluster" > "$OUT/actring_tests.txt" 2>&1 || rc=1
      tail -3 "$OUT/actring_tests.txt" ;;
    norms)  # fused a8 producers: bits (kernel tests, forward, gates), then the decode bench
      timeout 300 $PYTEST tests/gpu/test_kernels.py -k "a8_fuses or gated or rmsnorm" tests/gpu/test_forward.py \
        > "$OUT/norms.txt" 2>&1 || rc=1; tail -4 "$OUT/norms.txt"
      timeout 300 python3 gates/run.py > "$OUT/norms_gates.txt" 2>&1 || rc=1; tail -5 "$OUT/norms_gates.txt"
      timeout 420 python3 -m q27py bench --random-weights 27b --tier q4s --quick --json > "$OUT/bench.json" \
        2> "$OUT/bench.txt" || rc=1; grep -v "^  gemm " "$OUT/bench.txt" | grep -v "GDN fused" | tail -14 ;;
    final)  # the engine paths the GEMV / norm changes touch, the batch sweep (and its graphs' bytes), spec replay
      timeout 260 $PYTEST -x tests/gpu/test_forward.py tests/gpu/test_decode_batch.py tests/gpu/test_slots_gpu.py \
        tests/gpu/test_device_chain.py tests/gpu/test_batched_rounds_gpu.py > "$OUT/final_tests.txt" 2>&1 || rc=1
      tail -4 "$OUT/final_tests.txt"
      timeout 150 python3 -m q27py.bench.batch_probe --reps 10 --json "$OUT/batch.json" > "$OUT/batch.txt" 2>&1 || rc=1
      tail -7 "$OUT/batch.txt"; python3 -c "import json; print('batch graph bytes', json.load(open('$OUT/batch.json'))['batch_graph_bytes'])" || true
      timeout 120 python3 -m q27py bench spec-replay --traces q27py/bench/data/spec_traces.json \
        q27py/bench/data/spec_traces_code.json --json > "$OUT/spec.json" 2> "$OUT/spec.txt" || rc=1; tail -2 "$OUT/spec.txt" ;;
    ncu)  # the a8 q4 kernel on down and on the 17 MB output projections, 1 lane (ratios only: ncu locks clocks)
      for shp in "5120 17408" "5120 6144" "34816 5120"; do
        set -- $shp
        timeout 120 ncu --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
          --section LaunchStats --section MemoryWorkloadAnalysis -k regex:gemv8_q4 \
          python3 -m q27py.bench.gemv_probe --rows $1 --cols $2 --impl a8 --lanes 1 --once > "$OUT/ncu_$1x$2.txt" 2>&1 || rc=1
        echo "--- $1 x $2"
        grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Warp Cycles Per Issued|Eligible Warps|SM Active|Stall|Registers Per|Waves Per SM|Block Limit" "$OUT/ncu_$1x$2.txt" | head -24
      done ;;
    ncu16)  # gate_up a8 at 16 vs 1 lanes: stall reasons and the hottest SASS (ratios only: ncu locks clocks)
      for n in 16 1; do
        timeout 150 ncu --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats \
          --section SourceCounters --section ComputeWorkloadAnalysis -k regex:gemv8_q4 \
          python3 -m q27py.bench.gemv_probe --rows 34816 --cols 5120 --impl a8 --lanes $n --once > "$OUT/ncu16_$n.txt" 2>&1 || rc=1
        echo "--- lanes $n"; grep -E "Duration|DRAM Throughput|Issue Slots Busy|Issued Warp|Warp Cycles Per Issued|Eligible Warps|Executed Ipc|Pipe|stall|Stall" "$OUT/ncu16_$n.txt" | head -30
      done ;;
    masks) Q27_DEVICE_MASKS=1 timeout 300 $PYTEST tests/gpu -k mask > "$OUT/masks.txt" 2>&1 || rc=1; tail -5 "$OUT/masks.txt" ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
say "done rc=$rc"
exit $rc
