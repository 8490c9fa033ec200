#!/usr/bin/env bash
# One device call over this session's new GPU paths (each stage logs to $OUT/<stage>.txt and prints a
# short tail). Stages: rows rowsq gdnab warm gatesall replay a8 probe ncu fused kvrot gdn2 attn fa masks slots bench gates gates_old gates_new suite pdl ahead gdnst gdnbench budget cache pending defaults prefill profile reuse load groups groupsbench hostprof early mixed roomy splits splitsprobe flip n8q prefill14 wg3 wg3s gateup gateupturn first cold n16t n32s next gwgncu s10 s10b s11 s12 fold next12 merge s13 s13b s13c s14 s14b s15 bnd s16 s16h s17h walk tail tail2 tf32st tf32stq tf32stp splitk dp dpa tf32suite tf32stsuite trace all
#   PYTHONPATH=. bash tools/device_wave.sh a8 fused kvrot gdn2 bench
set -o pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 Q27_SHARED=${Q27_SHARED:-.out/shared}
OUT=${OUT:-/tmp/q27-wave}; mkdir -p "$OUT"
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE"
say() { echo "=== $1 ($(date +%T))"; }
# wg3 / wg3s: steps and probe (lane widths $1), 0 (never) vs 2 (by launch); the gates; bench load at C in $2 (timeout $3 s)
wg3_ab() {
  for t in 0 2; do
    timeout 100 python3 tools/gemv_prefetch_ab.py --mb 0 0 --set GWG_N16_TWO=$t GWG_N32_SUB=$t \
      > "$OUT/wg3_steps$t.txt" 2>&1 || rc=1
    echo "--- steps, 3-CTA entries $t"; grep -E "^prefetch|read probe" "$OUT/wg3_steps$t.txt"
  done
  for t in 0 2; do
    timeout 60 python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8w --lanes $1 \
      --set GWG_N16_TWO=$t GWG_N32_SUB=$t > "$OUT/wg3_probe$t.txt" 2>&1 || rc=1
    echo "--- probe, 3-CTA entries $t"; grep -vE "^(NVIDIA|launch)" "$OUT/wg3_probe$t.txt" | tail -10
  done
  timeout 150 python3 gates/run.py > "$OUT/wg3_gates.txt" 2>&1 || rc=1; tail -5 "$OUT/wg3_gates.txt"
  timeout ${LOAD_S:-$3} python3 -m q27py bench load --random-weights 27b --tier q4s --streams $2 \
    --no-mixed --traces q27py/bench/data/spec_traces.json q27py/bench/data/spec_traces_code.json \
    > "$OUT/wg3_load.txt" 2>&1 || rc=1
  tail -12 "$OUT/wg3_load.txt"
}
# the 27B gemv_wg probe at 1 / 8 / 16 lanes (log number $1, then --set NAME=V ...), and the steps (log tag $1, then --set ...)
gwg_probe() {
  local n=$1; shift
  timeout 70 python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8w --lanes 1 8 16 --set "$@" > "$OUT/gwg_probe$n.txt" 2>&1 || rc=1
  echo "--- probe $*"; grep -E "gate_up|down|gdn_in|gdn_out|attn_in|attn_o|lm_head|family" "$OUT/gwg_probe$n.txt"
}
gwg_steps() {
  local n=$1; shift
  timeout 80 python3 tools/gemv_prefetch_ab.py --mb 0 --set "$@" > "$OUT/gwg_steps$n.txt" 2>&1 || rc=1
  echo "--- steps $*"; grep -E "^prefetch|of read" "$OUT/gwg_steps$n.txt"
}
# ncu of one gemv_probe launch (kernel regex $1, log $2, rows $3, cols $4, lanes $5, then --set NAME=V ...): stall
# reasons per issue, pipe use, SM-active / elapsed cycles (the wave tail), DRAM; one line of the values that matter
gwg_ncu() {
  local kre=$1 log=$2 rows=$3 cols=$4 lanes=$5 stalls="" r; shift 5
  for r in long_scoreboard short_scoreboard wait barrier mio_throttle lg_throttle math_pipe_throttle not_selected \
           selected dispatch_stall no_instruction branch_resolving membar sleeping drain misc; do
    stalls="$stalls,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
  done
  local pipes="sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"
  pipes="$pipes,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active"
  local base="sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_elapsed.avg,dram__throughput.avg.pct_of_peak_sustained_elapsed"
  base="$base,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__waves_per_multiprocessor"
  timeout 90 ncu --metrics "$base$stalls,$pipes" -k regex:$kre python3 -m q27py.bench.gemv_probe --rows $rows --cols $cols \
    --impl a8w --lanes $lanes --once ${1:+--set "$@"} > "$log" 2>&1 || rc=1
  echo "--- ncu $kre $rows x $cols, $lanes lanes${1:+ ($*)}"
  grep -E "^\s+(sm__|smsp__|dram__|launch__)" "$log" | awk '{v=$NF; n=$1; sub("smsp__average_warps_issue_stalled_","stall:",n); sub("_per_issue_active.ratio","",n); if (v+0 > 0.05 || n !~ /stall/) printf "%s=%s ", n, v} END {print ""}'
}
# s10 / s10b: the prefill A/B of the shipped defaults against the GDN output pass in one TF32 product (tokens $2..,
# timeout $1); the probe and steps with PDL_NOWAIT 0 / 1; the tf32-out switch's GPU tests and quality (timeout $1)
s10_prefill() {
  local t=$1; shift
  Q27_PREFILL_WEIGHT_CACHE_GB=${CACHE_GB:-60} timeout $t python3 tools/prefill_levers.py --reps 3 --tokens "$@" \
    --configs rope+bf16x3f+gateup rope+bf16x3f+gateup+gdn1 > "$OUT/s10_prefill.txt" 2>&1 || rc=1
  grep -E "^prefill|H[12]00|tok/s" "$OUT/s10_prefill.txt" | tail -8
}
s10_nowait() {
  for v in 0 1; do gwg_probe w$v PDL_NOWAIT=$v; done
  for v in 0 1; do gwg_steps w$v PDL_NOWAIT=$v; done
}
s10_tf32() {
  timeout $1 $PYTEST -s tests/gpu/test_gdn_out_tf32.py > "$OUT/s10_tf32.txt" 2>&1 || rc=1
  grep -E "rel L2|kl_mean|passed|failed" "$OUT/s10_tf32.txt" | tail -14
}
# the per-kernel 8K prefill profiles with the "tf32 state" class off / on (one process each)
tf32st_prof() {
  for v in 0 1; do
    Q27_PREFILL_GDN_STATE_TF32=$v timeout 90 python3 tools/prefill_profile.py --tokens 8192 --warm-new 0 --top 12 \
      > "$OUT/tf32st_prof$v.txt" 2>&1 || rc=1
    echo "--- prefill_profile 8K, state tf32 $v"; grep -E "gdn2|device|tok/s" "$OUT/tf32st_prof$v.txt" | head -8
  done
}
# MLP_WALK: a smoke pair (a deadlock stops here; false if it did not pass), then the steps off / n8 / n8d / 16 lanes
# alternated in one process
walk_ab() {
  timeout 90 $PYTEST tests/gpu/test_mlp_walk.py -k "walk_equals and shape1" > "$OUT/walk_smoke.txt" 2>&1 || rc=1
  tail -2 "$OUT/walk_smoke.txt"
  grep -q " passed" "$OUT/walk_smoke.txt" && ! grep -q "failed" "$OUT/walk_smoke.txt" || return 1
  timeout 170 python3 tools/switch_ab.py --rounds 3 --shapes decode2k decode32k verify4 verify8 verify16 \
    --configs - MLP_WALK=1 MLP_WALK=2 "MLP_WALK=1 MLP_WALK_LANES=16" --json "$OUT/walk_switch.json" \
    > "$OUT/walk_switch.txt" 2>&1 || rc=1
  grep -E "^switch|read probe" "$OUT/walk_switch.txt" || tail -5 "$OUT/walk_switch.txt"
}
# ... its gates (the recorded md5s expected), then every bitwise test of it
walk_bits() {
  timeout 100 python3 -c "import runpy, sys; import q27py.gpu.constants as C; C.MLP_WALK = 1; C.MLP_WALK_LANES = 16; \
sys.argv = ['gates/run.py']; runpy.run_path('gates/run.py', run_name='__main__')" > "$OUT/walk_gates.txt" 2>&1 || rc=1
  echo "--- gates, MLP_WALK=1 MLP_WALK_LANES=16"; tail -4 "$OUT/walk_gates.txt"
  timeout 200 $PYTEST tests/gpu/test_mlp_walk.py > "$OUT/walk_tests.txt" 2>&1 || rc=1; tail -4 "$OUT/walk_tests.txt"
}
rc=0
for stage in "$@"; do
  say "$stage"
  case "$stage" in
    a8) timeout 300 $PYTEST tests/gpu/test_kernels.py -k "gemv or quant_act8 or rmsnorm" tests/gpu/test_a8_layout.py \
          tests/gpu/test_gemv_plan.py > "$OUT/a8.txt" 2>&1 || rc=1; tail -6 "$OUT/a8.txt" ;;
    probe) timeout 240 python3 -m q27py.bench.gemv_probe --shapes 27b --impl v1 a8 --lanes 1 8 16 \
          --json "$OUT/probe.json" > "$OUT/probe.txt" 2>&1 || rc=1; tail -24 "$OUT/probe.txt" ;;
    ncu)  # the a8 gate_up kernel at 1 lane (ncu locks clocks: read ratios, not times)
        timeout 200 ncu --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
          -k regex:gemv8_q4 python3 -m q27py.bench.gemv_probe --rows 34816 --cols 5120 --impl a8 --lanes 1 --once \
          > "$OUT/ncu.txt" 2>&1 || rc=1
        grep -E "DRAM Throughput|Achieved Occupancy|Warp Cycles Per Issued|Eligible Warps|SM Active" "$OUT/ncu.txt" | head ;;
    fused) timeout 300 $PYTEST tests/gpu/test_gdn_fused.py "tests/gpu/test_kernels.py::test_gdn_step_verify_and_commit" \
          > "$OUT/fused.txt" 2>&1 || rc=1; tail -6 "$OUT/fused.txt"
        Q27_GDN_FUSED=1 timeout 300 $PYTEST tests/gpu/test_forward.py > "$OUT/fused_forward.txt" 2>&1 || rc=1
        tail -4 "$OUT/fused_forward.txt" ;;
    kvrot) timeout 400 $PYTEST tests/gpu/test_kv_rotated_fast.py tests/gpu/test_kv_rotated_layout.py \
          tests/gpu/test_kv_rotated.py tests/gpu/test_kv_fp8.py tests/gpu/test_prefix_gpu.py > "$OUT/kvrot.txt" 2>&1 || rc=1
        tail -8 "$OUT/kvrot.txt" ;;
    gdn2) timeout 300 $PYTEST tests/gpu/test_gdn_chunk.py -k "chunked2" > "$OUT/gdn2.txt" 2>&1 || rc=1; tail -6 "$OUT/gdn2.txt"
        STUDY_ARGS=${STUDY_ARGS:-} timeout 200 python3 tools/device_gdn.py > "$OUT/gdn_study.txt" 2>&1 || rc=1
        tail -14 "$OUT/gdn_study.txt" ;;
    attn) timeout 300 $PYTEST tests/gpu/test_attention_mma.py > "$OUT/attn.txt" 2>&1 || rc=1; tail -6 "$OUT/attn.txt"
        timeout 200 python3 -m q27py.bench.attn_probe --json "$OUT/attn_probe.json" > "$OUT/attn_probe.txt" 2>&1 || rc=1
        tail -16 "$OUT/attn_probe.txt" ;;
    fa) timeout 300 $PYTEST tests/gpu/test_attention_prefill2.py tests/gpu/test_attention_prefill.py > "$OUT/fa.txt" 2>&1 || rc=1
        tail -6 "$OUT/fa.txt"
        timeout 200 python3 tools/bench_attn_prefill.py > "$OUT/fa_bench.txt" 2>&1 || rc=1; tail -12 "$OUT/fa_bench.txt" ;;
    masks) timeout 300 $PYTEST tests/gpu/test_device_masks.py tests/gpu/test_output_control_gpu.py > "$OUT/masks.txt" 2>&1 || rc=1
        tail -5 "$OUT/masks.txt" ;;
    slots) timeout 300 $PYTEST tests/gpu/test_slots_gpu.py > "$OUT/slots.txt" 2>&1 || rc=1; tail -5 "$OUT/slots.txt" ;;
    bench) timeout 420 python3 -m q27py bench --random-weights 27b --tier q4s --quick --json > "$OUT/bench.json" \
          2> "$OUT/bench.txt" || rc=1; grep -v "^  gemm " "$OUT/bench.txt" | tail -22 ;;
    gates) timeout 400 $PYTEST tests/gpu/test_gates.py > "$OUT/gates.txt" 2>&1 || rc=1; tail -4 "$OUT/gates.txt" ;;
    gates_old)  # the previous kernels (env back to split / v1): the canonicals must still hold bitwise
        Q27_ATTN_DECODE=split Q27_ATTN_PREFILL=v1 timeout 300 python3 gates/run.py 2>&1 | tail -6 || rc=1 ;;
    gates_new)  # re-record this arch's canonicals under the current defaults (old ones kept in $OUT)
        cp gates/canonical.json "$OUT/canonical_before.json"
        timeout 300 python3 gates/run.py 2>&1 | tail -6
        python3 -c "import json,sys; p='gates/canonical.json'; d=json.load(open(p)); [d.pop(k) for k in list(d) if k.endswith('@sm_90')]; json.dump(d, open(p,'w'), indent=1)"
        timeout 300 python3 gates/run.py --update 2>&1 | tail -6 || rc=1
        cp gates/canonical.json "$OUT/canonical.json" ;;
    suite) timeout 420 $PYTEST tests/gpu/test_forward.py tests/gpu/test_gates.py tests/gpu/test_prefix_gpu.py \
          tests/gpu/test_output_control_gpu.py tests/gpu/test_device_masks.py tests/gpu/test_slots_gpu.py \
          tests/gpu/test_attention_mma.py tests/gpu/test_attention_prefill.py tests/gpu/test_kv_fp8.py \
          tests/gpu/test_q27file.py tests/gpu/test_device_chain.py tests/gpu/test_prefill_blas.py \
          tests/gpu/test_gdn_fused.py tests/gpu/test_kernels.py -k "not gemv" > "$OUT/suite.txt" 2>&1 || rc=1
        tail -12 "$OUT/suite.txt" ;;
    all) timeout 560 $PYTEST tests/gpu > "$OUT/all.txt" 2>&1 || rc=1; tail -25 "$OUT/all.txt" ;;
    pdl)  # programmatic dependent launch: bits (tests, gates) under both trigger placements, then the step times
        for mode in on early; do
          Q27_PDL=$mode timeout 300 $PYTEST tests/gpu/test_pdl.py tests/gpu/test_forward.py -k "graph or pdl or verify" \
            > "$OUT/pdl_$mode.txt" 2>&1 || rc=1; tail -3 "$OUT/pdl_$mode.txt"
        done
        Q27_PDL=on timeout 300 python3 gates/run.py > "$OUT/pdl_gates.txt" 2>&1 || rc=1; tail -6 "$OUT/pdl_gates.txt"
        for mode in on early; do
          Q27_PDL=$mode timeout 200 python3 tools/pdl_bench.py > "$OUT/pdl_bench_$mode.txt" 2>&1 || rc=1
          grep -v '^{' "$OUT/pdl_bench_$mode.txt" | tail -8
        done ;;
    ahead)  # EngineConfig.prefill_expand_ahead (blas.ExpandAhead): bits, then prefill / warm turn / gap off vs on
        timeout 200 $PYTEST tests/gpu/test_prefill_blas.py tests/gpu/test_expand_ahead.py > "$OUT/ahead.txt" 2>&1 || rc=1
        tail -3 "$OUT/ahead.txt"
        timeout 300 python3 tools/prefill_compare.py --tokens 512 2048 8192 --gdn chunked2 --expand-ahead off on \
          > "$OUT/ahead_prefill.txt" 2>&1 || rc=1; grep "^prefill" "$OUT/ahead_prefill.txt"
        for a in 0 1; do
          Q27_PREFILL_EXPAND_AHEAD=$a timeout 240 python3 -m q27py bench load --random-weights 27b --tier q4s --streams 1 \
            --tokens 64 > "$OUT/ahead_load$a.txt" 2>&1 || rc=1; echo "--- expand ahead $a"; grep -iE "gap|long|C=" "$OUT/ahead_load$a.txt" | tail -4
        done ;;
    gdnst)  # the staged GDN recurrence (cuda/gdn.cu): bits (kernel, fused, prefill, forward tests, gates), then speed
        timeout 400 $PYTEST tests/gpu/test_kernels.py -k gdn tests/gpu/test_gdn_fused.py tests/gpu/test_gdn_chunk.py \
          tests/gpu/test_prefill_blas.py tests/gpu/test_forward.py tests/gpu/test_decode_batch.py \
          > "$OUT/gdnst.txt" 2>&1 || rc=1; tail -4 "$OUT/gdnst.txt"
        timeout 300 python3 gates/run.py > "$OUT/gdnst_gates.txt" 2>&1 || rc=1; tail -5 "$OUT/gdnst_gates.txt"
        timeout 200 python3 tools/device_gdn.py --lens 2048 8192 --reps 3 > "$OUT/gdnst_prefill.txt" 2>&1 || rc=1
        grep -iE "sequential|chunked2" "$OUT/gdnst_prefill.txt" | head -6
        timeout 420 python3 -m q27py bench --random-weights 27b --tier q4s --quick --json > "$OUT/bench.json" \
          2> "$OUT/bench.txt" || rc=1; grep -E "^decode|verify W|MTP|GDN chain" "$OUT/bench.txt" ;;
    gdnbench)  # the GDN recurrence alone (tools/gdn_step_bench.py) against REF (a gdn.cu; default: the
               # one-warp-per-column kernel of 077e4c8), VARIANTS "LPC:WARPS ..." of VSRC; then ncu of one launch each
        REF=${REF:-$OUT/gdn_ref.cu}; [ -f "$REF" ] || git show ${REF_REV:-077e4c8}:cuda/gdn.cu > "$REF" || rc=1
        timeout 300 python3 tools/gdn_step_bench.py ${REF:+--ref $REF} ${VARIANTS:+--variants $VARIANTS} ${VSRC:+--variant-src $VSRC} \
          --json "$OUT/gdnbench.json" > "$OUT/gdnbench.txt" 2>&1 || rc=1
        cat "$OUT/gdnbench.txt"
        [ "${NCU:-1}" = 0 ] || for m in "verify 8" "decode 1"; do
          for r in "" $REF; do
            timeout 120 ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
              --section LaunchStats --section MemoryWorkloadAnalysis -k regex:gdn_step \
              python3 tools/gdn_step_bench.py --once $m ${r:+--ref $r} > "$OUT/gdnncu_${m// /}${r:+_ref}.txt" 2>&1 || rc=1
            echo "--- ncu $m ${r:-head}"; grep -E "^    (Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Issued Warp|Eligible Warps|No Eligible|Block Limit|L1/TEX Hit|Mem Pipes|Memory Throughput|Grid Size)" "$OUT/gdnncu_${m// /}${r:+_ref}.txt" | head -20
            grep -iE "stall|cycles being stalled" "$OUT/gdnncu_${m// /}${r:+_ref}.txt" | head -4
          done
        done ;;
    budget)  # EngineConfig.interleave_budget_ms: the gap beside a 32K prefill, fixed pieces vs adaptive budgets
        for b in ${BUDGETS:-0 70 85}; do
          Q27_INTERLEAVE_BUDGET_MS=$b timeout 240 python3 -m q27py bench load --random-weights 27b --tier q4s --streams 1 \
            --tokens 64 --json > "$OUT/budget$b.json" 2> "$OUT/budget$b.txt" || rc=1
          echo "--- budget $b ms"; grep -E "^mixed" "$OUT/budget$b.txt" | tail -2
        done ;;
    cache)  # EngineConfig.prefill_weight_cache_gb (blas.ExpansionCache): bits, then prefill / the gap / warm turns off vs on
        timeout 200 $PYTEST tests/gpu/test_prefill_blas.py -k "resident or expand" > "$OUT/cache.txt" 2>&1 || rc=1
        tail -3 "$OUT/cache.txt"
        for g in 0 ${CACHE_GB:-60}; do
          Q27_PREFILL_WEIGHT_CACHE_GB=$g timeout 200 python3 tools/prefill_compare.py --tokens 512 2048 8192 --gdn chunked2 \
            > "$OUT/cache_prefill$g.txt" 2>&1 || rc=1; echo "--- weight cache $g GB"; grep "^prefill" "$OUT/cache_prefill$g.txt"
          Q27_PREFILL_WEIGHT_CACHE_GB=$g timeout 200 python3 -m q27py bench load --random-weights 27b --tier q4s \
            --streams 1 2 --tokens 64 --json > "$OUT/cache_load$g.json" 2> "$OUT/cache_load$g.txt" || rc=1
          grep -E "^mixed|^load" "$OUT/cache_load$g.txt" | tail -2
        done ;;
    defaults)  # the shipped defaults (prefill_weight_cache_gb auto, every module compiled at load): the
               # compile cost cold and cached, the slot / cache tests, the gap beside a 32K prefill, the warm turn
        for c in ${WARM_RUNS:-"cold 0" "cached 0"}; do read -r kind w <<< "$c"
          if [ "$kind" = cold ]; then export CUPY_CACHE_DIR=$(mktemp -d); else unset CUPY_CACHE_DIR; fi
          python3 -c "import time; from q27py.gpu.runtime import Runtime
t = time.time(); Runtime.get().warm_all(workers=$w or None); print('warm_all ($kind, workers $w; 0 = default): %.2f s' % (time.time() - t))"; done
        unset CUPY_CACHE_DIR
        timeout 240 $PYTEST tests/gpu/test_slots_gpu.py tests/gpu/test_expansion_cache.py tests/gpu/test_prefill_blas.py \
          > "$OUT/defaults.txt" 2>&1 || rc=1; tail -3 "$OUT/defaults.txt"
        timeout 200 python3 -m q27py bench load --random-weights 27b --tier q4s --streams 1 2 --tokens 64 --json \
          > "$OUT/defaults_load.json" 2> "$OUT/defaults_load.txt" || rc=1; grep -E "^q27py|^mixed|^C=" "$OUT/defaults_load.txt"
        timeout 250 python3 -m q27py bench replay --random-weights 27b --tier q4s --system-tokens 20000 --turns 10 --json \
          > "$OUT/defaults_replay.json" 2> "$OUT/defaults_replay.txt" || rc=1; grep -E "^q27py|reuse" "$OUT/defaults_replay.txt" | tail -3 ;;
    prefill)  # where prefill goes with the defaults (resident expansions: CACHE_GB, default 60): tok/s at 2K / 8K /
              # 32K and the per-family breakdown (tools/device_prefill.py, the engine's attention kernel)
        Q27_PREFILL_WEIGHT_CACHE_GB=${CACHE_GB:-60} timeout 300 python3 tools/device_prefill.py --no-routes --attn-prefill v2 \
          > "$OUT/prefill.txt" 2>&1 || rc=1; grep -E "^prefill" "$OUT/prefill.txt" ;;
    profile)  # per-kernel device time (Runtime.profile_kernels) of 8K / 32K prefills and of the warm agent turn
              # (807 new tokens on 24,471, through the engine as `bench replay` runs it); resident expansions:
              # CACHE_GB (default 60); PROFILE_ARGS go to tools/prefill_profile.py; JSON: $OUT/prefill_profile.json
        OUT="$OUT" timeout 540 python3 tools/prefill_profile.py --cache-gb ${CACHE_GB:-60} ${PROFILE_ARGS:-} \
          > "$OUT/profile.txt" 2>&1 || rc=1; tail -100 "$OUT/profile.txt" ;;
    rows)  # the prefill-chunk kernels (rows forms + bf16 rows from the producers): their bits against the
           # kernels they replace, the forward both ways, the GEMM / GDN / prefix tests, the gates
        timeout 400 $PYTEST tests/gpu/test_prefill_rows.py tests/gpu/test_prefill_blas.py \
          tests/gpu/test_kernels.py -k "not gemv and not attention" > "$OUT/rows.txt" 2>&1 || rc=1; tail -4 "$OUT/rows.txt"
        timeout 400 $PYTEST tests/gpu/test_forward.py tests/gpu/test_prefix_gpu.py tests/gpu/test_gates.py \
          > "$OUT/rows_model.txt" 2>&1 || rc=1; tail -4 "$OUT/rows_model.txt" ;;
    rowsq)  # the prefill rows kernels' bitwise tests alone
        timeout 200 $PYTEST tests/gpu/test_prefill_rows.py > "$OUT/rowsq.txt" 2>&1 || rc=1; tail -3 "$OUT/rowsq.txt" ;;
    gdnab)  # cuda/gdn_chunk2.cu against the copy in .ab/ (carry it): bits and per-kernel times, then its tests
        OUT="$OUT" timeout 200 python3 tools/kernel_ab.py --old .ab/gdn_chunk2.cu --tokens 8192 > "$OUT/gdnab.txt" 2>&1 || rc=1
        cat "$OUT/gdnab.txt" | tail -5
        timeout 300 $PYTEST tests/gpu/test_gdn_chunk.py -k "chunked2" > "$OUT/gdnab_tests.txt" 2>&1 || rc=1
        tail -3 "$OUT/gdnab_tests.txt" ;;
    warm)  # the warm agent turn alone, per kernel, and where its host time goes (cProfile of a second turn)
        OUT="$OUT" timeout 200 python3 tools/prefill_profile.py --cache-gb ${CACHE_GB:-60} --tokens --host-profile 20 \
          --top 14 > "$OUT/warm.txt" 2>&1 || rc=1; grep -v "^ *[0-9/]* *0.000 " "$OUT/warm.txt" | tail -60 ;;
    gatesall)  # every canonical gate (gates/run.py: the bundled model's three tiers and the random 27B)
        timeout 300 python3 gates/run.py > "$OUT/gatesall.txt" 2>&1 || rc=1; tail -6 "$OUT/gatesall.txt" ;;
    replay)  # warm / cold agent turns (bench replay, the shipped defaults)
        timeout 400 python3 -m q27py bench replay --random-weights 27b --tier q4s --system-tokens 20000 --turns 10 \
          --json > "$OUT/replay.json" 2> "$OUT/replay.txt" || rc=1; grep -E "^turn|^q27py|reuse|warm|cold" "$OUT/replay.txt" | tail -14 ;;
    pending)  # what session e left unmeasured: the spec replay's per-phase profile, the batch sweep with the
              # new GDN lanes kernel; then run the cache stage
        timeout 200 python3 -m q27py bench spec-replay --traces q27py/bench/data/spec_traces.json \
          q27py/bench/data/spec_traces_code.json --json > "$OUT/pending_spec.json" 2> "$OUT/pending_spec.txt" || rc=1
        grep -E "spec replay|per round" "$OUT/pending_spec.txt"
        timeout 150 python3 -m q27py.bench.batch_probe --reps 10 --json "$OUT/pending_batch.json" \
          > "$OUT/pending_batch.txt" 2>&1 || rc=1; tail -7 "$OUT/pending_batch.txt" ;;
    reuse)  # what the 2026-12-05 night session left unrun on a GPU, most telling first: the cold and warm 25K
            # turns of bench replay (state reuse + the prefill grid restarted at the marks; m1: 2,722 ms cold on an
            # H100), the in-place state reset (its bitwise test, the prefix / slot / batched / forward suites), the
            # gates, then the load bench with recorded acceptance (bench/trace_accept.py)
        Q27_PREFILL_WEIGHT_CACHE_GB=${CACHE_GB:-60} timeout 220 python3 -m q27py bench replay --random-weights 27b \
          --tier q4s --system-tokens 20000 --turns 10 > "$OUT/reuse_replay.txt" 2>&1 || rc=1
        tail -12 "$OUT/reuse_replay.txt"
        timeout 220 $PYTEST tests/gpu/test_prefix_gpu.py tests/gpu/test_slots_gpu.py tests/gpu/test_batched_rounds_gpu.py \
          tests/gpu/test_forward.py > "$OUT/reuse_tests.txt" 2>&1 || rc=1; tail -4 "$OUT/reuse_tests.txt"
        timeout 120 python3 gates/run.py > "$OUT/reuse_gates.txt" 2>&1 || rc=1; tail -5 "$OUT/reuse_gates.txt" ;;
    load)  # the batch_spec policy through the real scheduler, with the trained model's recorded acceptance
        timeout ${LOAD_S:-300} python3 -m q27py bench load --random-weights 27b --tier q4s --streams ${STREAMS:-1 2 4 8} --no-mixed \
          --traces q27py/bench/data/spec_traces.json q27py/bench/data/spec_traces_code.json \
          > "$OUT/load.txt" 2>&1 || rc=1; tail -10 "$OUT/load.txt" ;;
    groups)  # drafts in the shared sweep (FastModel.verify_batch, Q27_VERIFY_GROUPS) and the batched MTP chains
             # (mtp_draft_batch): their bitwise GPU tests, the solo chain and unwaited hidden rows, and the
             # batched-round suites with it on (the measurements: groupsbench)
        Q27_VERIFY_GROUPS=1 timeout 360 $PYTEST tests/gpu/test_verify_groups_gpu.py tests/gpu/test_mtp_draft_batch_gpu.py \
          tests/gpu/test_device_chain.py tests/gpu/test_hidden_owned.py tests/gpu/test_batched_rounds_gpu.py \
          tests/gpu/test_slots_gpu.py > "$OUT/groups_tests.txt" 2>&1 || rc=1; tail -4 "$OUT/groups_tests.txt" ;;
    groupsbench)  # (a call of its own, ~8 min): the spec replay's three ways of moving C streams (turns / plain sweep /
                  # sweep with drafts), then the load bench's scheduler with recorded acceptance, verify groups off vs on
        Q27_VERIFY_GROUPS=1 timeout 240 python3 -m q27py bench spec-replay --traces q27py/bench/data/spec_traces.json \
          --streams 2 4 8 16 --json > "$OUT/groups_replay.json" 2> "$OUT/groups_replay.txt" || rc=1
        grep -E "C=" "$OUT/groups_replay.txt"
        for g in 0 1; do
          Q27_VERIFY_GROUPS=$g timeout ${LOAD_S:-200} python3 -m q27py bench load --random-weights 27b --tier q4s \
            --streams ${STREAMS:-1 2 4 8 16} --no-mixed --traces q27py/bench/data/spec_traces.json \
            q27py/bench/data/spec_traces_code.json > "$OUT/groups_load$g.txt" 2>&1 || rc=1
          echo "--- verify groups $g"; tail -8 "$OUT/groups_load$g.txt"
        done ;;
    hostprof)  # (~3 min) where the load bench's rounds go on the host (issue 15: C=1 decodes at 278 t/s in the load bench
               # against ~470 in the spec replay; C=16 runs ~28 ms rounds against a ~12 ms 16-lane sweep): cProfile over
               # `bench load` at C=1 and C=16, the top functions by own and cumulative time
        for c in 1 16; do
          timeout ${LOAD_S:-150} python3 -m cProfile -o "$OUT/hostprof$c.prof" -m q27py bench load --random-weights 27b \
            --tier q4s --streams $c --no-mixed --traces q27py/bench/data/spec_traces.json \
            q27py/bench/data/spec_traces_code.json > "$OUT/hostprof$c.txt" 2>&1 || rc=1
          grep -E "C=" "$OUT/hostprof$c.txt"
          python3 -c "import pstats,sys; s=pstats.Stats(sys.argv[1]); s.sort_stats('tottime').print_stats(28); s.sort_stats('cumulative').print_stats(45)" \
            "$OUT/hostprof$c.prof" > "$OUT/hostprof${c}_stats.txt" 2>&1 || rc=1
          grep -A32 "tottime" "$OUT/hostprof${c}_stats.txt" | head -34 | cut -c1-150
        done ;;
    first)  # one call (~9 min) when a session gets a single machine: the verify-group / batched-chain / solo-chain /
            # hidden-row / prefix GPU tests with Q27_VERIFY_GROUPS=1 (the 27B-heads chain tests and the reset test
            # failed on 2026-12-06 before d18d1f4), the 32-lane wgmma GEMV's bitwise tests and its probe at
            # 1 / 16 / 32 lanes, then the cold and warm 25K turns (bench replay) with what time is left
        Q27_VERIFY_GROUPS=1 timeout 240 $PYTEST --tb=short tests/gpu/test_verify_groups_gpu.py tests/gpu/test_mtp_draft_batch_gpu.py \
          tests/gpu/test_device_chain.py tests/gpu/test_hidden_owned.py tests/gpu/test_prefix_gpu.py > "$OUT/first_groups.txt" 2>&1 || rc=1
        tail -12 "$OUT/first_groups.txt"
        timeout 100 $PYTEST --tb=short tests/gpu/test_gemv_wg.py > "$OUT/first_gemv.txt" 2>&1 || rc=1; tail -6 "$OUT/first_gemv.txt"
        timeout 80 python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8w --lanes 1 16 32 > "$OUT/first_probe.txt" 2>&1 || rc=1
        tail -12 "$OUT/first_probe.txt"
        Q27_PREFILL_WEIGHT_CACHE_GB=${CACHE_GB:-60} timeout $(( ${FIRST_S:-560} - SECONDS > 30 ? ${FIRST_S:-560} - SECONDS : 30 )) \
          python3 -m q27py bench replay --random-weights 27b --tier q4s --system-tokens 20000 --turns 10 > "$OUT/first_replay.txt" 2>&1 || rc=1
        tail -12 "$OUT/first_replay.txt" ;;
    gateup)  # EngineConfig.prefill_gate_up_bf16 (Q27_PREFILL_GATE_UP_BF16, issue 14; default off): its GPU tests and the
             # prefill rows' bitwise tests, then prefill 2K / 8K / 32K off vs on (tools/device_prefill.py, two processes
             # back to back; resident expansions CACHE_GB, default 60), then 8K off / on alternated in one process (REPS
             # each, default 3: the lever is ~1-1.5% of an 8K prefill, about one run's noise)
        timeout 180 $PYTEST tests/gpu/test_gate_up_bf16_gpu.py tests/gpu/test_prefill_rows.py > "$OUT/gateup.txt" 2>&1 || rc=1
        tail -4 "$OUT/gateup.txt"
        for g in 0 1; do
          Q27_PREFILL_GATE_UP_BF16=$g Q27_PREFILL_WEIGHT_CACHE_GB=${CACHE_GB:-60} timeout 130 python3 tools/device_prefill.py \
            --no-routes --attn-prefill v2 > "$OUT/gateup_prefill$g.txt" 2>&1 || rc=1
          echo "--- gate_up bf16 $g"; grep -E "^prefill" "$OUT/gateup_prefill$g.txt"
        done
        Q27_PREFILL_WEIGHT_CACHE_GB=${CACHE_GB:-60} REPS=${REPS:-3} timeout 140 python3 - > "$OUT/gateup_ab.txt" 2>&1 <<'PY' || rc=1
import os, statistics
from q27py.bench.random_weights import Bench
from q27py.gpu import kernels as K
b = Bench(tier="q4s", max_context=8192 + 64, chunk=4096, log=lambda *a: None)
tps = {False: [], True: []}
for _ in range(int(os.environ["REPS"])):
    for on in (False, True):
        K.PREFILL_GATE_UP_BF16 = on
        tps[on].append(b.prefill(8192)["tokens_per_s"])
for on in (False, True):
    print(f"prefill 8192 one process, gate_up bf16 {'on' if on else 'off'}: median {statistics.median(tps[on]):.0f} tok/s"
          f" (runs {' '.join(f'{x:.0f}' for x in tps[on])})")
print(f"prefill 8192 on / off: {statistics.median(tps[True]) / statistics.median(tps[False]):.4f}")
PY
        grep -E "^prefill" "$OUT/gateup_ab.txt" || tail -5 "$OUT/gateup_ab.txt" ;;
    gateupturn)  # the same switch: the device quality numbers (tiny model, q4s / q8: KL, top-1, NLL off vs on), the
                 # cold 25K agent turn off vs on (bench replay; CACHE_GB as above), the canonical gates with it on
                 # (their prompts are under 128 tokens: they must PASS unchanged)
        timeout 100 python3 tests/gpu/test_gate_up_bf16_gpu.py > "$OUT/gateup_quality.txt" 2>&1 || rc=1
        grep -E "quality" "$OUT/gateup_quality.txt" || tail -5 "$OUT/gateup_quality.txt"
        for g in 0 1; do
          Q27_PREFILL_GATE_UP_BF16=$g Q27_PREFILL_WEIGHT_CACHE_GB=${CACHE_GB:-60} timeout 190 python3 -m q27py bench replay \
            --random-weights 27b --tier q4s --system-tokens 20000 --turns 10 > "$OUT/gateup_replay$g.txt" 2>&1 || rc=1
          echo "--- gate_up bf16 $g"; grep -E "cold|^q27py" "$OUT/gateup_replay$g.txt" | tail -4
        done
        Q27_PREFILL_GATE_UP_BF16=1 timeout 110 python3 gates/run.py > "$OUT/gateup_gates.txt" 2>&1 || rc=1
        tail -5 "$OUT/gateup_gates.txt" ;;
    cold)  # the cold 25K turn after 1a819ac / 095f134 (~2 min): host snapshots past the device budget are pinned and
           # stream-ordered (their GPU rewind test), bench replay's cold engines are collected between turns; then the
           # replay (H200 2026-12-06 before: 2,695 ms cold, bar 2.5 s) and the same with every snapshot on the host
        timeout 90 $PYTEST tests/gpu/test_prefix_gpu.py -k rewind tests/gpu/test_host_snapshots.py > "$OUT/cold_tests.txt" 2>&1 || rc=1
        tail -3 "$OUT/cold_tests.txt"
        Q27_PREFILL_WEIGHT_CACHE_GB=${CACHE_GB:-60} timeout 150 python3 -m q27py bench replay --random-weights 27b --tier q4s \
          --system-tokens 20000 --turns 10 > "$OUT/cold_replay.txt" 2>&1 || rc=1
        tail -12 "$OUT/cold_replay.txt" ;;
    n16t)  # the two-pass 16-lane gemv_wg at 3 CTAs per SM (gemv8w_q4_n16t, constants GWG_N16_TWO; ~4 min): its bitwise GPU
           # tests, the 27B probe at 9 / 16 lanes off vs on, then the verify W=16 / 16-lane batched steps off vs on
        timeout 150 $PYTEST tests/gpu/test_gemv_wg.py -k n16t > "$OUT/n16t_tests.txt" 2>&1 || rc=1
        tail -3 "$OUT/n16t_tests.txt"
        for t in 0 1; do
          timeout 70 python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8w --lanes 1 9 16 --set GWG_N16_TWO=$t \
            > "$OUT/n16t_probe$t.txt" 2>&1 || rc=1
          echo "--- probe, GWG_N16_TWO=$t"; grep -vE "^(NVIDIA|launch)" "$OUT/n16t_probe$t.txt" | tail -10
        done
        for t in 0 1; do
          timeout 110 python3 tools/gemv_prefetch_ab.py --mb 0 0 --set GWG_N16_TWO=$t > "$OUT/n16t_steps$t.txt" 2>&1 || rc=1
          echo "--- steps, GWG_N16_TWO=$t"; grep -E "^prefetch|read probe" "$OUT/n16t_steps$t.txt"
        done ;;
    n32s)  # the 32-lane gemv_wg at 3 CTAs per SM (gemv8w_q4_n32s: two chunks a tensor-core batch, a 4-stage ring; constants
           # GWG_N32_SUB; ~3 min): its bitwise GPU tests, then the 27B probe at 16 / 24 / 32 lanes off vs on, and on with one
           # chunk a batch (GWG_SUB_N32S=1: fewer registers live, more waits)
        timeout 150 $PYTEST tests/gpu/test_gemv_wg.py -k n32s > "$OUT/n32s_tests.txt" 2>&1 || rc=1
        tail -3 "$OUT/n32s_tests.txt"
        for sets in "GWG_N32_SUB=0" "GWG_N32_SUB=1" "GWG_N32_SUB=1 GWG_SUB_N32S=1"; do
          timeout 70 python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8w --lanes 16 24 32 --set $sets \
            > "$OUT/n32s_probe.txt" 2>&1 || rc=1
          echo "--- probe, $sets"; grep -vE "^(NVIDIA|launch)" "$OUT/n32s_probe.txt" | tail -10
        done ;;
    next)  # the session after 2026-12-06 in one call (~8 min): the cold-turn fixes (GPU rewind test, bench replay), then
           # the two 3-CTA gemv_wg entries (n16t, n32s): their bitwise tests, the 27B probe at 1 / 16 / 32 lanes both off
           # vs both on, and the decode / verify / batched steps both off vs both on
        timeout 60 $PYTEST tests/gpu/test_prefix_gpu.py -k rewind tests/gpu/test_host_snapshots.py > "$OUT/next_cold_tests.txt" 2>&1 || rc=1
        tail -2 "$OUT/next_cold_tests.txt"
        Q27_PREFILL_WEIGHT_CACHE_GB=${CACHE_GB:-60} timeout 120 python3 -m q27py bench replay --random-weights 27b --tier q4s \
          --system-tokens 20000 --turns 10 > "$OUT/next_replay.txt" 2>&1 || rc=1
        tail -4 "$OUT/next_replay.txt"
        timeout 100 $PYTEST tests/gpu/test_gemv_wg.py -k "n16t or n32s" > "$OUT/next_wg_tests.txt" 2>&1 || rc=1
        tail -3 "$OUT/next_wg_tests.txt"
        for t in 0 1; do
          timeout 60 python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8w --lanes 1 16 32 --set GWG_N16_TWO=$t GWG_N32_SUB=$t \
            > "$OUT/next_probe$t.txt" 2>&1 || rc=1
          echo "--- probe, n16t / n32s $t"; grep -vE "^(NVIDIA|launch)" "$OUT/next_probe$t.txt" | tail -10
        done
        for t in 0 1; do
          timeout 100 python3 tools/gemv_prefetch_ab.py --mb 0 0 --set GWG_N16_TWO=$t GWG_N32_SUB=$t > "$OUT/next_steps$t.txt" 2>&1 || rc=1
          echo "--- steps, n16t / n32s $t"; grep -E "^prefetch|read probe" "$OUT/next_steps$t.txt"
        done ;;
    early)  # (~8 min) EngineConfig.pdl "early", the default since 2026-12-06: the PDL tests (graph replay = eager bits),
            # the canonical gates (md5s recorded under "on"), the verify-group and batched-round suites; then bench load
            # (full-size untimed run before each timed one, the default since the same day) at C in $STREAMS
        timeout 200 $PYTEST tests/gpu/test_pdl.py tests/gpu/test_verify_groups_gpu.py tests/gpu/test_batched_rounds_gpu.py \
          > "$OUT/early_tests.txt" 2>&1 || rc=1; tail -3 "$OUT/early_tests.txt"
        timeout 150 python3 gates/run.py > "$OUT/early_gates.txt" 2>&1 || rc=1; tail -5 "$OUT/early_gates.txt"
        timeout ${LOAD_S:-240} python3 -m q27py bench load --random-weights 27b --tier q4s --streams ${STREAMS:-1 2 16} \
          --no-mixed --traces q27py/bench/data/spec_traces.json q27py/bench/data/spec_traces_code.json \
          > "$OUT/early_load.txt" 2>&1 || rc=1; grep -E "^C=|rounds, |graph keys|^recorded" "$OUT/early_load.txt" ;;
    mixed)  # (~4 min) issue 15's interleaving bars on the shipped defaults: a running stream's gap beside a 32K prefill
            # (<= 100 ms) and a short request's first token during it (<= 0.5 s), with C=1 / C=2 plain (speculation
            # off: the f4 form of the C=2 / C=1 bar)
        timeout ${LOAD_S:-300} python3 -m q27py bench load --random-weights 27b --tier q4s --streams 1 2 --tokens 64 \
          > "$OUT/mixed.txt" 2>&1 || rc=1; grep -E "^C=|^mixed|^memory" "$OUT/mixed.txt" ;;
    roomy)  # (~5 min) issue 10: does room on each SM for the next launch's CTAs shorten the GEMV launches' fixed term?
            # The decode / verify / batched steps (tools/gemv_prefetch_ab.py, one process each) under PDL on / early
            # (Q27_PDL) x the 8-lane entry's shared-memory pad (GWG_N8_PAD: 0, or 24,576 = two CTAs an SM + room)
        for pdl in on early; do for pad in 0 24576; do
          Q27_PDL=$pdl timeout 110 python3 tools/gemv_prefetch_ab.py --mb 0 0 --set GWG_N8_PAD=$pad \
            > "$OUT/roomy_${pdl}_$pad.txt" 2>&1 || rc=1
          echo "--- PDL $pdl, pad $pad"; grep -E "^prefetch|of read" "$OUT/roomy_${pdl}_$pad.txt"
        done; done ;;
    prefill14)  # (~7 min, a session's first H200 call) issue 14's bars on the shipped defaults of 2026-12-06 (RoPE rows,
                # bf16x3f, gate_up bf16): the levers' GPU tests, the gates, the 8K / 32K prefill before vs after alternated
                # in one process (tools/prefill_levers.py), the warm / cold 25K agent turn (bench replay)
        timeout 150 $PYTEST tests/gpu/test_prefill_split3.py -m gpu tests/gpu/test_prefill_rows.py > "$OUT/prefill14_tests.txt" 2>&1 || rc=1
        tail -2 "$OUT/prefill14_tests.txt"
        timeout 150 python3 gates/run.py > "$OUT/prefill14_gates.txt" 2>&1 || rc=1; tail -5 "$OUT/prefill14_gates.txt"
        Q27_PREFILL_WEIGHT_CACHE_GB=${CACHE_GB:-60} timeout 240 python3 tools/prefill_levers.py --reps 3 --tokens ${LEVERS_TOKENS:-8192 32768} \
          --configs before rope+bf16x3f+gateup > "$OUT/prefill14_levers.txt" 2>&1 || rc=1; grep -E "^prefill" "$OUT/prefill14_levers.txt"
        Q27_PREFILL_WEIGHT_CACHE_GB=${CACHE_GB:-60} timeout 200 python3 -m q27py bench replay --random-weights 27b --tier q4s \
          --system-tokens 20000 --turns 10 > "$OUT/prefill14_replay.txt" 2>&1 || rc=1
        grep -E "turn  9|warm TTFT" "$OUT/prefill14_replay.txt" | tail -2 ;;
    h200)  # (~6 min; the next session's first call on an H200) issue 14's 8K / 32K prefill on the shipped defaults, then
           # issue 10's open H200 questions per launch and per step: the defaults (n8d on), n8d off, and the 4-CTA n8q
           # (negative on the H100, where 3 CTAs already reach its read rate; the H200's 1.45x read rate may differ)
        Q27_PREFILL_WEIGHT_CACHE_GB=${CACHE_GB:-60} timeout 170 python3 tools/prefill_levers.py --reps 3 --tokens 8192 32768 \
          --configs rope+bf16x3f+gateup > "$OUT/h200_prefill.txt" 2>&1 || rc=1; grep -E "^prefill|H[12]00" "$OUT/h200_prefill.txt"
        i=0
        for cfg in "GWG_DEEP=1" "GWG_DEEP=0" "GWG_DEEP=0 GWG_N8_FOUR=1"; do
          i=$((i + 1))
          timeout 70 python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8w --lanes 1 8 16 --set $cfg \
            > "$OUT/h200_probe$i.txt" 2>&1 || rc=1
          echo "--- probe $cfg"; grep -E "gate_up|down|gdn_in|gdn_out|attn_in|attn_o|lm_head|family" "$OUT/h200_probe$i.txt"
          timeout 80 python3 tools/gemv_prefetch_ab.py --mb 0 --set $cfg > "$OUT/h200_steps$i.txt" 2>&1 || rc=1
          echo "--- steps $cfg"; grep -E "^prefetch|of read" "$OUT/h200_steps$i.txt"
        done
        # placement or depth (docs/PERF.md, seventh session t5): the plain 5-stage entry held to 2 CTAs an SM by padding
        # (GWG_PLACE2) on every launch of one such wave (n8d off), then beside n8d (gdn_out / attn_o only), with its steps
        timeout 70 python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8w --lanes 1 8 --set GWG_DEEP=0 GWG_PLACE2=1 \
          > "$OUT/h200_probe_place2.txt" 2>&1 || rc=1
        echo "--- probe GWG_DEEP=0 GWG_PLACE2=1"; grep -E "down|gdn_in|gdn_out|attn_in|attn_o|family" "$OUT/h200_probe_place2.txt"
        timeout 80 python3 tools/gemv_prefetch_ab.py --mb 0 --set GWG_PLACE2=1 > "$OUT/h200_steps_place2.txt" 2>&1 || rc=1
        echo "--- steps GWG_PLACE2=1"; grep -E "^prefetch|of read" "$OUT/h200_steps_place2.txt" ;;
    s10)  # (<= ~9.5 min; the tenth session's first call, card-aware; most telling first)
          # 1. on an H200 only: issue 14's 8K / 32K prefill, the shipped defaults against the GDN output pass in one
          #    TF32 product (EngineConfig.prefill_gdn_out_tf32, off), alternated in one process;
          # 2. issue 10: where the step's time goes -- the probe at 1 / 8 / 16 lanes and the steps with PDL_NOWAIT 0 / 1
          #    (1: every griddepcontrol.wait compiled out, the graph's kernels free of their dependencies: the bound a
          #    persistent, dataflow-ordered step could reach; its results are wrong);
          # 3. the tf32-out switch's GPU tests and quality numbers (an H100: then its 8K prefill A/B);
          # 4. an H200: the 4-CTA n8q / n16q and the 7-stage ring per launch
        H200=""; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && H200=1
        [ -n "$H200" ] && s10_prefill 240 8192 32768
        s10_nowait
        s10_tf32 150
        if [ -z "$H200" ]; then
          s10_prefill 150 8192
        else
          gwg_probe 4 GWG_N8_FOUR=1 GWG_N16_FOUR=1
          gwg_probe 7 GWG_STAGES=7
        fi ;;
    trace)  # (~3 min) issue 10 / 15: the launch timeline of a captured step (tools/step_trace.py, STEP_TRACE stamps): the
            # decode step at 2K, the 16-lane verify round, and the decode step without waits (PDL_NOWAIT=1) beside it
        timeout 150 python3 tools/step_trace.py --ctx 2048 --json "$OUT/trace_decode.json" > "$OUT/trace_decode.txt" 2>&1 || rc=1
        grep -E "traced launches|^span|^  " "$OUT/trace_decode.txt" | head -16
        timeout 150 python3 tools/step_trace.py --ctx 2048 --lanes 16 --json "$OUT/trace_w16.json" > "$OUT/trace_w16.txt" 2>&1 || rc=1
        grep -E "traced launches|^span|^  " "$OUT/trace_w16.txt" | head -16
        timeout 150 python3 tools/step_trace.py --ctx 2048 --set PDL_NOWAIT=1 --json "$OUT/trace_nowait.json" \
          > "$OUT/trace_nowait.txt" 2>&1 || rc=1
        grep -E "traced launches|^span|^  " "$OUT/trace_nowait.txt" | head -16 ;;
    s11)  # (<= ~9 min; the eleventh session's first call) the step timeline (trace), then on an H200 issue 14's
          # 8K / 32K prefill A/B (shipped defaults against the TF32 GDN output pass) and that pass's GPU tests
        H200=""; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && H200=1
        for t in "" "--lanes 16" "--set PDL_NOWAIT=1"; do
          n=$(echo "x$t" | tr -cd 'a-z0-9'); timeout 110 python3 tools/step_trace.py --ctx 2048 $t --json "$OUT/trace_$n.json" \
            > "$OUT/trace_$n.txt" 2>&1 || rc=1
          echo "--- trace $t"; grep -E "traced launches|^span|^  " "$OUT/trace_$n.txt" | head -24; tail -3 "$OUT/trace_$n.txt"
        done
        if [ -n "$H200" ]; then s10_prefill 200 8192 32768; s10_tf32 100; fi ;;
    s12)  # (<= ~9.5 min; carry .ab: `git archive HEAD~ q27py cuda tools | tar -x -C .ab/base`, its q27py/data linked
          # here) the launch folds of 2026-12-07 (the GDN step and the attention combines write the out projections'
          # a8 activations: no quant_act8 launch before gdn_out / attn_o): their bitwise tests and the gates, the steps
          # against .ab/base, then the step timeline (gate_up's epilogue writes down's activations too); on an H200 the 8K prefill A/B last
        H200=""; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && H200=1
        timeout 200 $PYTEST tests/gpu/test_swiglu_act8.py tests/gpu/test_gdn_fused.py tests/gpu/test_attention_mma.py -k "a8 or q4s or quantiz or replays" \
          > "$OUT/s12_bits.txt" 2>&1 || rc=1; tail -4 "$OUT/s12_bits.txt"
        timeout 150 $PYTEST tests/gpu/test_gates.py > "$OUT/s12_gates.txt" 2>&1 || rc=1; tail -3 "$OUT/s12_gates.txt"
        [ -d .ab/base/q27py ] && ln -sfn "$PWD/q27py/data" .ab/base/q27py/data
        for side in base new; do
          if [ $side = base ]; then d=.ab/base; else d=.; fi
          (cd $d && timeout 90 python3 tools/gemv_prefetch_ab.py --mb 0 > "$OUT/s12_steps_$side.txt" 2>&1) || rc=1
          echo "--- steps $side"; grep -E "^prefetch|of read" "$OUT/s12_steps_$side.txt"
        done
        timeout 110 python3 tools/step_trace.py --ctx 2048 --json "$OUT/trace_decode.json" > "$OUT/trace_decode.txt" 2>&1 || rc=1
        echo "--- trace"; grep -E "traced launches|^span|^  " "$OUT/trace_decode.txt" | head -30; tail -3 "$OUT/trace_decode.txt"
        [ -n "$H200" ] && s10_prefill 150 8192 ;;
    fold)  # (~5 min) the a8 hand-overs (constants A8_FOLD: 1 the GDN step, 2 the attention combines, 4 gate_up's
           # epilogue write the next GEMV's int8 activations; 0 = the quant_act8 launches back): their bitwise tests
           # and the gates (last), the steps at 0 / 7 alternated then 3 (FOLD_MORE), and the step timeline at 0 and 7
        for f in 0 7 0 7 ${FOLD_MORE:-3}; do
          timeout 80 python3 tools/gemv_prefetch_ab.py --mb 0 --set A8_FOLD=$f > "$OUT/fold_steps$f.txt" 2>&1 || rc=1
          echo "--- A8_FOLD=$f"; grep -E "^prefetch" "$OUT/fold_steps$f.txt"
        done
        for f in 0 7; do
          timeout 100 python3 tools/step_trace.py --ctx 2048 --top 400 --set A8_FOLD=$f --json "$OUT/trace_f$f.json" \
            > "$OUT/trace_f$f.txt" 2>&1 || rc=1
          echo "--- trace A8_FOLD=$f"; grep -E "traced launches|^span|^  " "$OUT/trace_f$f.txt" | head -14
          tail -1 "$OUT/trace_f$f.txt"
        done
        timeout 120 $PYTEST tests/gpu/test_swiglu_act8.py tests/gpu/test_gdn_fused.py tests/gpu/test_attention_mma.py \
          -k "a8 or q4s or quantiz or replays" > "$OUT/fold_bits.txt" 2>&1 || rc=1; tail -3 "$OUT/fold_bits.txt"
        timeout 60 $PYTEST tests/gpu/test_gates.py > "$OUT/fold_gates.txt" 2>&1 || rc=1; tail -1 "$OUT/fold_gates.txt" ;;
    next12)  # (<= ~8 min; the twelfth session's first call) issue 10's two chain levers the eleventh session's
             # timeline named: (1) GEMV_BRANCH (the GDN layer's bf16 gates launch beside qkvz on a graph branch): its
             # bitwise test, then the steps at 0 / 1 alternated; (2) the fused GDN step again (Q27_GDN_FUSED, bitwise
             # the chain, tested; with it the A8_FOLD bit-1 hand-over applies): steps off / on alternated; then the
             # timeline with both on; on an H200 the 8K prefill A/B (issue 14) last
        H200=""; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && H200=1
        timeout 100 $PYTEST tests/gpu/test_gemv_branch.py > "$OUT/n12_bits.txt" 2>&1 || rc=1; tail -2 "$OUT/n12_bits.txt"
        for b in 0 1 0 1; do
          timeout 60 python3 tools/gemv_prefetch_ab.py --mb 0 --set GEMV_BRANCH=$b > "$OUT/n12_branch$b.txt" 2>&1 || rc=1
          echo "--- GEMV_BRANCH=$b"; grep -E "^prefetch|of read" "$OUT/n12_branch$b.txt"
        done
        for f in 0 1 0 1; do
          Q27_GDN_FUSED=$f timeout 60 python3 tools/gemv_prefetch_ab.py --mb 0 > "$OUT/n12_fused$f.txt" 2>&1 || rc=1
          echo "--- GDN_FUSED=$f"; grep -E "^prefetch|of read" "$OUT/n12_fused$f.txt"
        done
        Q27_GDN_FUSED=1 timeout 80 python3 tools/step_trace.py --ctx 2048 --top 800 --set GEMV_BRANCH=1 \
          --json "$OUT/n12_trace.json" > "$OUT/n12_trace.txt" 2>&1 || rc=1; head -1 "$OUT/n12_trace.txt"
        [ -n "$H200" ] && s10_prefill 150 8192 ;;
    merge)  # (<= ~7 min) issue 10: GEMV_MERGE (the GDN layer's bf16 gates in qkvz's grid, cuda/gemv_wg.cu
            # gemv8w_q4_n8d_g / n8_g / n16_g): its bitwise tests, the steps at modes 0 / 1 / 2 alternated, the gates with
            # modes 1 and 2, the 1- and 8-lane timelines; on an H200 the 8K prefill A/B (issue 14) last
        H200=""; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && H200=1
        timeout 200 $PYTEST tests/gpu/test_gemv_merge.py tests/gpu/test_gemv_branch.py > "$OUT/m13_bits.txt" 2>&1 || rc=1
        tail -2 "$OUT/m13_bits.txt"
        for b in 0 1 2 0 1 2; do
          timeout 60 python3 tools/gemv_prefetch_ab.py --mb 0 --set GEMV_MERGE=$b > "$OUT/m13_steps$b.txt" 2>&1 || rc=1
          echo "--- GEMV_MERGE=$b"; grep -E "^prefetch|of read" "$OUT/m13_steps$b.txt"
        done
        for b in 1 2; do
          timeout 150 python3 -c "import runpy, sys; import q27py.gpu.constants as C; C.GEMV_MERGE = $b; \
sys.argv = ['gates/run.py']; runpy.run_path('gates/run.py', run_name='__main__')" > "$OUT/m13_gates$b.txt" 2>&1 || rc=1
          echo "--- gates, GEMV_MERGE=$b"; tail -4 "$OUT/m13_gates$b.txt"
        done
        for t in 0:1 2:1 1:8 2:8; do  # GEMV_MERGE:lanes
          timeout 60 python3 tools/step_trace.py --ctx 2048 --lanes ${t#*:} --top 0 --set GEMV_MERGE=${t%:*} \
            --json "$OUT/m13_trace${t%:*}_${t#*:}.json" > "$OUT/m13_trace${t%:*}_${t#*:}.txt" 2>&1 || rc=1
          head -1 "$OUT/m13_trace${t%:*}_${t#*:}.txt"
        done
        python3 tools/step_trace.py --compare "$OUT/m13_trace0_1.json" "$OUT/m13_trace2_1.json" | head -20
        [ -n "$H200" ] && s10_prefill 150 8192 ;;
    s13)  # (<= ~9 min; the fourteenth session's first call) issue 10's thirteenth-session builds, their bits: the staged
          # attention combines (split_merge) and the top-2 pass (TOP2_BLOCKS 32), bitwise; GDN_GATES_IN_CONV (the conv
          # computes the GDN gates; its own bits) and CONV_COMMIT_FOLD (the conv slides the window; bitwise) -- their
          # tests, decode_batch's with the fold on, the gates on the defaults and with the fold on (the same md5s)
        timeout 240 $PYTEST tests/gpu/test_attention_mma.py tests/gpu/test_kernels.py tests/gpu/test_gates_in_conv.py \
          tests/gpu/test_conv_commit_fold.py tests/gpu/test_kv_rotated.py \
          -k "combine or top2 or float64 or width_invariant or gumbel or gates or fold or rotated" \
          > "$OUT/s13_bits.txt" 2>&1 || rc=1
        tail -2 "$OUT/s13_bits.txt"
        timeout 150 python3 -c "import sys, pytest; import q27py.gpu.constants as C; C.CONV_COMMIT_FOLD = 1; \
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/gpu/test_decode_batch.py']))" > "$OUT/s13_batchfold.txt" 2>&1 || rc=1
        echo "--- test_decode_batch.py, CONV_COMMIT_FOLD=1"; tail -1 "$OUT/s13_batchfold.txt"
        timeout 150 python3 gates/run.py > "$OUT/s13_gates.txt" 2>&1 || rc=1; tail -4 "$OUT/s13_gates.txt"
        timeout 150 python3 -c "import runpy, sys; import q27py.gpu.constants as C; C.CONV_COMMIT_FOLD = 1; \
sys.argv = ['gates/run.py']; runpy.run_path('gates/run.py', run_name='__main__')" > "$OUT/s13_gatesfold.txt" 2>&1 || rc=1
        echo "--- gates, CONV_COMMIT_FOLD=1"; tail -4 "$OUT/s13_gatesfold.txt" ;;
    s13b)  # (<= ~8 min; right after s13) the steps: the defaults (against the thirteenth session's H100 7.199-7.212 ms
           # decode 2K: the combine and top-2 changes), CONV_COMMIT_FOLD=1, GDN_GATES_IN_CONV=1, both, alternated; the
           # gates with GDN_GATES_IN_CONV=1 (which canonicals move); gdn_out's split sweep (47% of read at 3 splits)
        for cfg in "CONV_COMMIT_FOLD=0" "CONV_COMMIT_FOLD=1" "GDN_GATES_IN_CONV=1" "CONV_COMMIT_FOLD=1 GDN_GATES_IN_CONV=1" \
                   "CONV_COMMIT_FOLD=0" "CONV_COMMIT_FOLD=1 GDN_GATES_IN_CONV=1"; do
          timeout 70 python3 tools/gemv_prefetch_ab.py --mb 0 --set $cfg > "$OUT/s13_steps.txt" 2>&1 || rc=1
          echo "--- $cfg"; grep -E "^prefetch|of read" "$OUT/s13_steps.txt"
        done
        timeout 150 python3 -c "import runpy, sys; import q27py.gpu.constants as C; C.GDN_GATES_IN_CONV = 1; \
sys.argv = ['gates/run.py']; runpy.run_path('gates/run.py', run_name='__main__')" > "$OUT/s13_gates1.txt" 2>&1 || rc=1
        echo "--- gates, GDN_GATES_IN_CONV=1"; tail -4 "$OUT/s13_gates1.txt"
        # fewer, longer gdn_out units (1 split: 80 units of 96 chunks on the deep ring) against the shipped 3
        timeout 90 python3 -m q27py.bench.gemv_probe --shapes gdn_out --impl a8w --lanes 1 8 16 --splits 1 2 3 4 \
          > "$OUT/s13_splits.txt" 2>&1 || rc=1; grep -vE "^launch" "$OUT/s13_splits.txt" | tail -8 ;;
    s13c)  # (<= ~6 min, card-aware) on an H200 first: issue 14's 8K prefill with and without the tf32 output pass; then
           # the 1- and 8-lane timelines on the defaults and with both switches on, complete since STEP_TRACE_CAP 1 << 18
        if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
          s10_prefill 170 8192
        fi
        for t in 0:1 1:1 0:8 1:8; do  # switches (0: defaults, 1: CONV_COMMIT_FOLD and GDN_GATES_IN_CONV on):lanes
          sw=""; [ "${t%:*}" = 1 ] && sw="--set CONV_COMMIT_FOLD=1 GDN_GATES_IN_CONV=1"
          timeout 60 python3 tools/step_trace.py --ctx 2048 --lanes ${t#*:} --top 0 $sw \
            --json "$OUT/s13_trace${t%:*}_${t#*:}.json" > "$OUT/s13_trace${t%:*}_${t#*:}.txt" 2>&1 || rc=1
          head -1 "$OUT/s13_trace${t%:*}_${t#*:}.txt"; tail -9 "$OUT/s13_trace${t%:*}_${t#*:}.txt"
        done
        python3 tools/step_trace.py --compare "$OUT/s13_trace0_1.json" "$OUT/s13_trace1_1.json" | head -24
        (cd "$OUT" && tar czf s13_traces.tgz s13_trace*.json && rm -f s13_trace*.json) ;;
    s14)  # (<= ~7 min) issue 10's NORM_FOLD, GATED_FOLD, QUANT_FOLD (the GEMV CTAs compute
          # the RMSNorm / the GDN output norm / the act quant in front; bitwise): their tests, then decode_batch's / verify_batch's /
          # the fused step's with all three on, the gates
        timeout 200 $PYTEST tests/gpu/test_norm_fold.py > "$OUT/s14_bits.txt" 2>&1 || rc=1; tail -3 "$OUT/s14_bits.txt"
        timeout 200 python3 -c "import sys, pytest; import q27py.gpu.constants as C; C.NORM_FOLD = 1; C.GATED_FOLD = 1; C.QUANT_FOLD = 1; \
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/gpu/test_decode_batch.py', 'tests/gpu/test_verify_groups_gpu.py', \
'tests/gpu/test_gdn_fused.py', 'tests/gpu/test_gates_in_conv.py']))" > "$OUT/s14_suites.txt" 2>&1 || rc=1
        echo "--- decode_batch / verify_groups / gdn_fused / gates_in_conv, the three folds"; tail -3 "$OUT/s14_suites.txt"
        timeout 120 python3 -c "import runpy, sys; import q27py.gpu.constants as C; C.NORM_FOLD = 1; C.GATED_FOLD = 1; C.QUANT_FOLD = 1; \
sys.argv = ['gates/run.py']; runpy.run_path('gates/run.py', run_name='__main__')" > "$OUT/s14_gates.txt" 2>&1 || rc=1
        echo "--- gates, the three folds"; tail -4 "$OUT/s14_gates.txt" ;;
    s14b)  # (<= ~6 min; right after s14) the folds' steps against the defaults, each and all three (and at lanes 8:
           # verify W=8 folds too), one process alternating captured graphs (tools/switch_ab.py); the 1-lane timeline
           # with all three against off; gemv_trace of the wgmma kernel's phases
        timeout 200 python3 tools/switch_ab.py --rounds 3 --configs - NORM_FOLD=1 GATED_FOLD=1 QUANT_FOLD=1 \
          "NORM_FOLD=1 GATED_FOLD=1 QUANT_FOLD=1" "NORM_FOLD=1 GATED_FOLD=1 QUANT_FOLD=1 NORM_FOLD_LANES=8" \
          --json "$OUT/s14_switch.json" > "$OUT/s14_switch.txt" 2>&1 || rc=1
        grep -E "^switch|read probe" "$OUT/s14_switch.txt" || tail -5 "$OUT/s14_switch.txt"
        for t in 0 1; do
          timeout 60 python3 tools/step_trace.py --ctx 2048 --lanes 1 --top 0 --set NORM_FOLD=$t GATED_FOLD=$t QUANT_FOLD=$t \
            --json "$OUT/s14_trace$t.json" > "$OUT/s14_trace$t.txt" 2>&1 || rc=1
          head -1 "$OUT/s14_trace$t.txt"
        done
        python3 tools/step_trace.py --compare "$OUT/s14_trace0.json" "$OUT/s14_trace1.json" | head -24
        # where each GEMV's ~4-5 us past its bytes go (per-CTA phases of the wgmma kernel, GEMV_TRACE build)
        timeout 120 python3 tools/gemv_trace.py --impl a8w --shapes gdn_out down gate_up qkvz --lanes 1 \
          > "$OUT/s14_gemvtrace.txt" 2>&1 || rc=1; grep -vE "^\s*$" "$OUT/s14_gemvtrace.txt" | tail -13 ;;
    s15)  # (<= ~9 min; s14b's A/B and s14's bits in one call, for a scarce device) the folds' steps alternated in one
          # process, their bitwise tests, the gates with all three on
        timeout 200 python3 tools/switch_ab.py --rounds 3 --configs - NORM_FOLD=1 GATED_FOLD=1 QUANT_FOLD=1 \
          "NORM_FOLD=1 GATED_FOLD=1 QUANT_FOLD=1" "NORM_FOLD=1 GATED_FOLD=1 QUANT_FOLD=1 NORM_FOLD_LANES=8" \
          --json "$OUT/s15_switch.json" > "$OUT/s15_switch.txt" 2>&1 || rc=1
        grep -E "^switch|read probe" "$OUT/s15_switch.txt" || tail -5 "$OUT/s15_switch.txt"
        timeout 200 $PYTEST tests/gpu/test_norm_fold.py > "$OUT/s15_bits.txt" 2>&1 || rc=1; tail -4 "$OUT/s15_bits.txt"
        timeout 120 python3 -c "import runpy, sys; import q27py.gpu.constants as C; C.NORM_FOLD = 1; C.GATED_FOLD = 1; C.QUANT_FOLD = 1; \
sys.argv = ['gates/run.py']; runpy.run_path('gates/run.py', run_name='__main__')" > "$OUT/s15_gates.txt" 2>&1 || rc=1
        echo "--- gates, the three folds"; tail -4 "$OUT/s15_gates.txt" ;;
    bnd)  # (<= ~3 min) issue 10: what a kernel boundary costs -- a small producer -> wide consumer chain with the
          # consumer on griddepcontrol.wait / on a released ready word / on nothing (tools/boundary_probe.py)
        timeout 170 python3 tools/boundary_probe.py --pairs 64 --mb 5 15 40 --rounds 3 --json "$OUT/bnd.json" \
          > "$OUT/bnd.txt" 2>&1 || rc=1; grep -vE "^\s*$" "$OUT/bnd.txt" | tail -16 ;;
    s16)  # (<= ~8 min; the sixteenth session's first call) the boundary probe; then on an H200 only, issue 14's 8K
          # prefill and the decode / verify steps on the defaults (the H200 bars; no H200 came in nine sessions)
        timeout 170 python3 tools/boundary_probe.py --pairs 64 --mb 5 15 40 --rounds 3 --json "$OUT/bnd.json" \
          > "$OUT/bnd.txt" 2>&1 || rc=1; grep -vE "^\s*$" "$OUT/bnd.txt" | tail -16
        if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
          s10_prefill 170 8192
          timeout 120 python3 tools/switch_ab.py --rounds 3 --configs - --json "$OUT/s16_switch.json" \
            > "$OUT/s16_switch.txt" 2>&1 || rc=1
          grep -E "^switch|read probe" "$OUT/s16_switch.txt" || tail -5 "$OUT/s16_switch.txt"
        fi ;;
    s16h)  # (<= ~9 min; an H200 only, else nothing) issue 14's 8K prefill, the decode / verify steps on the defaults, then
           # issue 15's load bench at C = 1, 2, 16
        if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
          s10_prefill 170 8192
          timeout 120 python3 tools/switch_ab.py --rounds 3 --configs - --json "$OUT/s16_switch.json" \
            > "$OUT/s16_switch.txt" 2>&1 || rc=1
          grep -E "^switch|read probe" "$OUT/s16_switch.txt" || tail -5 "$OUT/s16_switch.txt"
          timeout ${LOAD_S:-220} python3 -m q27py bench load --random-weights 27b --tier q4s --streams 1 2 16 --no-mixed \
            --traces q27py/bench/data/spec_traces.json q27py/bench/data/spec_traces_code.json \
            > "$OUT/s16_load.txt" 2>&1 || rc=1; tail -10 "$OUT/s16_load.txt"
        else
          echo "not an H200: nothing run"
        fi ;;
    s17h)  # (<= ~10 min; an H200 only, else the walk stage) issue 14's 8K prefill, the walk's smoke pair and its steps
           # A/B (the defaults' row: issue 10's H200 bars), then issue 15's load bench at C = 1, 2, 16
        if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
          s10_prefill 170 8192
          walk_ab
          timeout ${LOAD_S:-150} python3 -m q27py bench load --random-weights 27b --tier q4s --streams 1 2 16 --no-mixed \
            --traces q27py/bench/data/spec_traces.json q27py/bench/data/spec_traces_code.json \
            > "$OUT/s17_load.txt" 2>&1 || rc=1; tail -10 "$OUT/s17_load.txt"
        else
          walk_ab && walk_bits
        fi ;;
    tail)  # (<= ~7 min) issue 10: NORM_TAIL, the post-attention norm in the out projection's last CTA -- its bitwise
           # tests first (a failure stops here), the steps off / on alternated in one process, the gates with it on
        timeout 240 $PYTEST tests/gpu/test_norm_tail.py > "$OUT/tail_tests.txt" 2>&1 || rc=1; tail -3 "$OUT/tail_tests.txt"
        if grep -q " passed" "$OUT/tail_tests.txt" && ! grep -qE "failed|error" "$OUT/tail_tests.txt"; then
          timeout 150 python3 tools/switch_ab.py --rounds 3 --shapes decode2k decode32k verify4 verify8 --configs - \
            NORM_TAIL=1 --json "$OUT/tail_switch.json" > "$OUT/tail_switch.txt" 2>&1 || rc=1
          grep -E "^switch|read probe" "$OUT/tail_switch.txt" || tail -5 "$OUT/tail_switch.txt"
          timeout 150 python3 -c "import runpy, sys; import q27py.gpu.constants as C; C.NORM_TAIL = 1; \
sys.argv = ['gates/run.py']; runpy.run_path('gates/run.py', run_name='__main__')" > "$OUT/tail_gates.txt" 2>&1 || rc=1
          echo "--- gates, NORM_TAIL=1"; tail -4 "$OUT/tail_gates.txt"
        fi ;;
    tf32st)  # (<= ~9 min) issue 14: the "tf32 state" class (prep + state pass in one TF32 product): the passes' ms per
             # 27B layer and their error (kernel_ab --tf32-ab) first, then its tests (the class against float64, pieces
             # bitwise one run, the forward, quality on the tiny model), the 8K and 32K (LEVERS_TOKENS) prefill A/B
             # against today's defaults and with tf32 out on top, then (TF32ST_PROF=1) the per-kernel 8K profiles
        timeout 100 python3 tools/kernel_ab.py --tf32-ab --tokens 8192 --reps 5 > "$OUT/tf32st_kab.txt" 2>&1 || rc=1
        grep -E "^\|" "$OUT/tf32st_kab.txt" | tail -11 || tail -5 "$OUT/tf32st_kab.txt"
        timeout 200 $PYTEST -s tests/gpu/test_gdn_state_tf32.py > "$OUT/tf32st_tests.txt" 2>&1 || rc=1
        grep -E "rel L2|kl_mean|passed|failed|Error" "$OUT/tf32st_tests.txt" | tail -24
        Q27_PREFILL_WEIGHT_CACHE_GB=${CACHE_GB:-60} timeout 240 python3 tools/prefill_levers.py --reps 3 --tokens ${LEVERS_TOKENS:-8192 32768} \
          --configs rope+bf16x3f+gateup rope+bf16x3f+gateup+gdnst rope+bf16x3f+gateup+gdn1+gdnst \
          > "$OUT/tf32st_prefill.txt" 2>&1 || rc=1
        grep -E "^prefill|H[12]00" "$OUT/tf32st_prefill.txt" | tail -8
        [ "${TF32ST_PROF:-1}" = 1 ] && tf32st_prof  # TF32ST_PROF=0: no per-kernel profiles (a short call)
        ;;
    tf32stq)  # (<= ~5 min) tf32st without the prefill A/B: the passes' A/B per 27B layer, then the class's tests
        timeout 110 python3 tools/kernel_ab.py --tf32-ab --tokens 8192 --reps 5 > "$OUT/tf32st_kab.txt" 2>&1 || rc=1
        grep -E "^\|" "$OUT/tf32st_kab.txt" | tail -14 || tail -5 "$OUT/tf32st_kab.txt"
        timeout 190 $PYTEST -s tests/gpu/test_gdn_state_tf32.py > "$OUT/tf32st_tests.txt" 2>&1 || rc=1
        grep -E "rel L2|kl_mean|passed|failed|Error" "$OUT/tf32st_tests.txt" | tail -24 ;;
    tf32stp)  # (<= ~3 min) the per-kernel 8K profiles of tf32st alone (state tf32 off / on)
        tf32st_prof ;;
    splitk)  # (<= ~6 min) issue 10: GEMV_SPLIT_CTAS = 3 for every a8 q4 matrix vs for K <= 96 chunks only
             # (GEMV_SPLIT_MAX_KCH: gdn_out / attn_o / attention q, not down) against the default, one process each
             # (the splits are fixed at plan time); bits change with the splits, so no gates here
        for cfg in "GEMV_SPLIT_CTAS=0" "GEMV_SPLIT_CTAS=3" "GEMV_SPLIT_CTAS=3 GEMV_SPLIT_MAX_KCH=96"; do
          timeout 120 python3 tools/gemv_prefetch_ab.py --mb 0 0 --set $cfg > "$OUT/splitk.txt" 2>&1 || rc=1
          echo "--- steps, $cfg"; grep -E "^prefetch|read probe" "$OUT/splitk.txt" || tail -4 "$OUT/splitk.txt"
        done ;;
    tail2)  # (<= ~8 min) issue 10: NORM_TAIL with wg_norm_tail's shared-memory row (eighteenth session) -- its bitwise
            # tests first (a failure stops here), the steps off / 1 (post-attention norms) / 3 (+ the input norms)
            # alternated in one process, the decode step's timeline off / 3, the gates with 3
        timeout 240 $PYTEST tests/gpu/test_norm_tail.py > "$OUT/tail_tests.txt" 2>&1 || rc=1; tail -3 "$OUT/tail_tests.txt"
        if grep -q " passed" "$OUT/tail_tests.txt" && ! grep -qE "failed|error" "$OUT/tail_tests.txt"; then
          timeout 170 python3 tools/switch_ab.py --rounds 3 --shapes decode2k decode32k verify2 verify4 verify8 --configs - \
            NORM_TAIL=1 NORM_TAIL=3 --json "$OUT/tail_switch.json" > "$OUT/tail_switch.txt" 2>&1 || rc=1
          grep -E "^switch|read probe" "$OUT/tail_switch.txt" || tail -5 "$OUT/tail_switch.txt"
          for t in $([ "${TAIL_TRACE:-1}" = 1 ] && echo 0 1); do  # TAIL_TRACE=0: no timelines (a short call)
            timeout 60 python3 tools/step_trace.py --ctx 2048 --lanes 1 --top 6 --set NORM_TAIL=$((3 * t)) \
              --json "$OUT/tail_trace$t.json" > "$OUT/tail_trace$t.txt" 2>&1 || rc=1
          done
          [ "${TAIL_TRACE:-1}" = 1 ] && timeout 20 python3 tools/step_trace.py --compare "$OUT/tail_trace0.json" \
            "$OUT/tail_trace1.json" 2>&1 | head -30
          timeout 150 python3 -c "import runpy, sys; import q27py.gpu.constants as C; C.NORM_TAIL = 3; \
sys.argv = ['gates/run.py']; runpy.run_path('gates/run.py', run_name='__main__')" > "$OUT/tail_gates.txt" 2>&1 || rc=1
          echo "--- gates, NORM_TAIL=3"; tail -4 "$OUT/tail_gates.txt"
        fi ;;
    walk)  # (<= ~9 min) issue 10: MLP_WALK, a layer's gate_up and down as one grid -- a smoke pair first (a deadlock
           # stops here), the decode / verify steps off / n8 / n8d alternated in one process, the bitwise tests, the
           # gates with it on
        walk_ab && walk_bits ;;
    dpa)  # (<= ~5 min) issue 10: GEMV_DP_ASYNC, gemv_dp's shared-memory ring -- the probe, the steps, its bitwise tests
        timeout 60 python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8w --lanes 1 2 4 \
          --set GEMV_DP4A=1 GEMV_DP_ASYNC=1 GEMV_DP_LANES=4 > "$OUT/dpa_probe.txt" 2>&1 || rc=1
        grep -vE "^(NVIDIA|launch)" "$OUT/dpa_probe.txt" | tail -10
        timeout 120 python3 tools/switch_ab.py --rounds 3 --shapes decode2k verify4 --configs - \
          "GEMV_DP4A=1 GEMV_DP_ASYNC=1" "GEMV_DP4A=1 GEMV_DP_ASYNC=1 GEMV_DP_LANES=4" \
          --json "$OUT/dpa_switch.json" > "$OUT/dpa_switch.txt" 2>&1 || rc=1
        grep -E "^switch|read probe" "$OUT/dpa_switch.txt" || tail -5 "$OUT/dpa_switch.txt"
        timeout 150 $PYTEST tests/gpu/test_gemv_dp.py -k "1-1 or 2-1 or 3-1 or 4-1" > "$OUT/dpa_bits.txt" 2>&1 || rc=1
        tail -4 "$OUT/dpa_bits.txt" ;;
    dp)  # (<= ~9 min) issue 10: GEMV_DP4A, the a8 q4 GEMV on dp4a -- the probe off / on (1, 4, 8 lanes), the steps
         # alternated in one process (ring depth, the pre-wait L2 prefetch, 2-8 lanes), then its bitwise tests
        for t in 0 1; do
          timeout 70 python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8w --lanes 1 2 4 8 \
            --set GEMV_DP4A=$t GEMV_DP_LANES=8 > "$OUT/dp_probe$t.txt" 2>&1 || rc=1
          echo "--- probe GEMV_DP4A=$t"; grep -vE "^(NVIDIA|launch)" "$OUT/dp_probe$t.txt" | tail -12
        done
        timeout 200 python3 tools/switch_ab.py --rounds 3 --shapes decode2k decode32k verify4 verify8 --configs - GEMV_DP4A=1 \
          "GEMV_DP4A=1 GEMV_DP_DEPTH=8" "GEMV_DP4A=1 GEMV_DP_L2PF=32" "GEMV_DP4A=1 GEMV_DP_LANES=4" \
          "GEMV_DP4A=1 GEMV_DP_LANES=8" --json "$OUT/dp_switch.json" > "$OUT/dp_switch.txt" 2>&1 || rc=1
        grep -E "^switch|read probe" "$OUT/dp_switch.txt" || tail -5 "$OUT/dp_switch.txt"
        timeout 220 $PYTEST tests/gpu/test_gemv_dp.py > "$OUT/dp_bits.txt" 2>&1 || rc=1; tail -6 "$OUT/dp_bits.txt"
        timeout 120 python3 -c "import runpy, sys; import q27py.gpu.constants as C; C.GEMV_DP4A = 1; \
sys.argv = ['gates/run.py']; runpy.run_path('gates/run.py', run_name='__main__')" > "$OUT/dp_gates.txt" 2>&1 || rc=1
        echo "--- gates, GEMV_DP4A=1"; tail -4 "$OUT/dp_gates.txt" ;;
    tf32suite)  # (<= ~7 min) issue 14: the suites a default change of prefill_gdn_out_tf32 needs -- forward, prefix,
                # the GDN chunk kernels, prefill BLAS and the gates -- with the switch on
        Q27_PREFILL_GDN_OUT_TF32=1 timeout 400 $PYTEST tests/gpu/test_forward.py tests/gpu/test_prefix_gpu.py \
          tests/gpu/test_gdn_chunk.py tests/gpu/test_prefill_blas.py tests/gpu/test_gates.py tests/gpu/test_gdn_out_tf32.py \
          > "$OUT/tf32suite.txt" 2>&1 || rc=1
        tail -12 "$OUT/tf32suite.txt" ;;
    tf32stsuite)  # (<= ~7 min) issue 14: the suites a default change of prefill_gdn_state_tf32 needs -- forward, prefix,
                  # the GDN chunk kernels, prefill BLAS and the gates -- with the switch on (TF32_OUT=1: tf32 out too)
        Q27_PREFILL_GDN_STATE_TF32=1 Q27_PREFILL_GDN_OUT_TF32=${TF32_OUT:-0} timeout ${SUITE_S:-400} $PYTEST \
          tests/gpu/test_forward.py tests/gpu/test_prefix_gpu.py tests/gpu/test_gdn_chunk.py tests/gpu/test_prefill_blas.py \
          tests/gpu/test_gates.py > "$OUT/tf32stsuite.txt" 2>&1 || rc=1
        tail -12 "$OUT/tf32stsuite.txt" ;;
    s10b)  # (<= ~7 min; s10 for a nearly spent budget) the 8K prefill A/B (an H200 only), the PDL_NOWAIT probe and
           # steps, the tf32-out GPU tests and quality, an H100's 8K prefill A/B last
        H200=""; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && H200=1
        [ -n "$H200" ] && s10_prefill 150 8192
        s10_nowait
        s10_tf32 130
        [ -z "$H200" ] && s10_prefill 130 8192 ;;
    deep)  # (~3-5 min) issue 10: gemv8w_q4_n8d (GWG_DEEP) -- its bitwise tests, the probe at 1 / 8 lanes and the steps,
           # off / on in separate processes; on an H200 the 8K / 32K prefill on the shipped defaults first
        if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
          Q27_PREFILL_WEIGHT_CACHE_GB=${CACHE_GB:-60} timeout 170 python3 tools/prefill_levers.py --reps 3 --tokens 8192 32768 \
            --configs rope+bf16x3f+gateup > "$OUT/deep_prefill.txt" 2>&1 || rc=1; grep -E "^prefill|H[12]00" "$OUT/deep_prefill.txt"
        fi
        timeout 150 $PYTEST tests/gpu/test_gemv_wg.py -k n8d > "$OUT/deep_tests.txt" 2>&1 || rc=1; tail -2 "$OUT/deep_tests.txt"
        for cfg in "GWG_DEEP=0" "GWG_DEEP=1"; do
          timeout 60 python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8w --lanes 1 8 --set $cfg \
            > "$OUT/deep_probe_${cfg#*=}.txt" 2>&1 || rc=1  # no "=" in names: $OUT does not return such files
          echo "--- probe $cfg"; grep -E "gate_up|down|gdn_in|gdn_out|attn_in|attn_o|lm_head|family" "$OUT/deep_probe_${cfg#*=}.txt"
        done
        i=0
        for cfg in "GWG_DEEP=0" "GWG_DEEP=1"; do
          i=$((i + 1))
          timeout 80 python3 tools/gemv_prefetch_ab.py --mb 0 --set $cfg > "$OUT/deep_steps$i.txt" 2>&1 || rc=1
          echo "--- steps $cfg"; grep -E "^prefetch|of read" "$OUT/deep_steps$i.txt"
        done ;;
    one)  # (<= ~9 min; a session whose device time is nearly spent) the two open measurements in one call: on an H200
          # issue 14's 8K / 32K prefill on the shipped defaults first, then on any card the 4-CTA gemv_wg entries' steps
          # (off / n8q + n16q / + every q4 split and the tail sized for 4 CTAs an SM); the bitwise tests of n8q / n16q last
        if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
          Q27_PREFILL_WEIGHT_CACHE_GB=${CACHE_GB:-60} timeout 170 python3 tools/prefill_levers.py --reps 3 --tokens 8192 32768 \
            --configs rope+bf16x3f+gateup > "$OUT/one_prefill.txt" 2>&1 || rc=1; grep -E "^prefill|H[12]00" "$OUT/one_prefill.txt"
        fi
        i=0
        for cfg in "GWG_N8_FOUR=0" "GWG_N8_FOUR=1 GWG_N16_FOUR=1" "GWG_N8_FOUR=1 GWG_N16_FOUR=1 GEMV_TAIL_CTAS=4 GEMV_SPLIT_CTAS=4"; do
          i=$((i + 1))
          timeout 90 python3 tools/gemv_prefetch_ab.py --mb 0 --set $cfg > "$OUT/one_steps$i.txt" 2>&1 || rc=1
          echo "--- steps $cfg"; grep -E "^prefetch|of read" "$OUT/one_steps$i.txt"
        done
        timeout 100 $PYTEST tests/gpu/test_gemv_wg.py -k "n8q or n16q" > "$OUT/one_tests.txt" 2>&1 || rc=1
        tail -2 "$OUT/one_tests.txt" ;;
    pf200)  # (~5 min) issue 14's 8K / 32K bars and the 25K turns on the shipped defaults only (no "before" A/B, no
            # tests): the figures an H200 owes the issue, in the fewest device seconds
        Q27_PREFILL_WEIGHT_CACHE_GB=${CACHE_GB:-60} timeout 200 python3 tools/prefill_levers.py --reps 3 --tokens 8192 32768 \
          --configs rope+bf16x3f+gateup > "$OUT/pf200_prefill.txt" 2>&1 || rc=1; grep -E "^prefill|H[12]00" "$OUT/pf200_prefill.txt"
        Q27_PREFILL_WEIGHT_CACHE_GB=${CACHE_GB:-60} timeout 200 python3 -m q27py bench replay --random-weights 27b --tier q4s \
          --system-tokens 20000 --turns 10 > "$OUT/pf200_replay.txt" 2>&1 || rc=1
        grep -E "turn  9|warm TTFT|cold" "$OUT/pf200_replay.txt" | tail -3 ;;
    wg3)  # (~8 min) the 3-CTA gemv_wg entries by launch (GWG_N16_TWO / GWG_N32_SUB = 2, the new default: only
          # launches of more than one wave of the plain entry): the gemv_wg tests, the decode / verify / batched
          # steps and the probe at 1 / 9 / 16 / 32 lanes, 0 (never) vs 2 (by launch), the gates under the default,
          # then bench load with recorded acceptance (C = 1 2 4 8 16)
        timeout 120 $PYTEST tests/gpu/test_gemv_wg.py > "$OUT/wg3_tests.txt" 2>&1 || rc=1; tail -2 "$OUT/wg3_tests.txt"
        wg3_ab "1 9 16 32" "1 2 4 8 16" 200 ;;
    wg3s)  # wg3 without the test file, at fewer widths, with load at C = 1 and 16 only (~6 min; a short budget)
        wg3_ab "9 16 32" "1 16" 150 ;;
    gwgncu)  # why gemv_wg stops short of the read probe (issues 10 / 15; ~4 min): ncu stall reasons, pipe use and
             # SM-active / elapsed cycles (the wave tail) of gate_up at 1 and 32 lanes and down at 1 lane, then the
             # probe at 1 / 16 lanes with the ring 4-7 stages deep (GWG_STAGES; 5 is the default)
        for spec in "34816 5120 1" "5120 17408 1" "34816 5120 32" "34816 5120 16"; do
          set -- $spec
          gwg_ncu gemv8w "$OUT/gwgncu_$1x$2_$3.txt" $1 $2 $3
        done
        for st in 4 5 6 7; do
          timeout 60 python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8w --lanes 1 16 --set GWG_STAGES=$st \
            > "$OUT/gwgstages$st.txt" 2>&1 || rc=1
          echo "--- GWG_STAGES=$st"; grep -E "gate_up|^down|gdn_out|GEMV family" "$OUT/gwgstages$st.txt"
        done ;;
    splits)  # (~8 min) issue 10, two launch-shape levers, bitwise neutral to lanes: (1) a8 q4 splits sized for gemv_wg's
             # 3 CTAs per SM (GEMV_SPLIT_CTAS=3: down / gdn_out / attn_o 240 -> 320 units, attn_in's q 192 -> 384) and
             # gate_up's tail split over K on those slots (GEMV_TAIL_SPLIT=1); (2) the wide-stage entries (GWG_WIDE_STAGE:
             # 8 chunks a stage). The wide entries' bitwise tests, then the decode / verify / batched steps per setting
             # (one process each, the baseline first and last)
        timeout 150 $PYTEST tests/gpu/test_gemv_wg.py -k "wide or stage_walk" > "$OUT/splits_tests.txt" 2>&1 || rc=1
        tail -2 "$OUT/splits_tests.txt"
        i=0
        for cfg in "GEMV_SPLIT_CTAS=0" "GEMV_SPLIT_CTAS=3" "GEMV_SPLIT_CTAS=3 GEMV_TAIL_SPLIT=1" "GWG_WIDE_STAGE=1" \
                   "GEMV_SPLIT_CTAS=3 GWG_WIDE_STAGE=1" "GEMV_SPLIT_CTAS=0"; do
          i=$((i + 1))
          timeout 100 python3 tools/gemv_prefetch_ab.py --mb 0 --set $cfg > "$OUT/splits_steps$i.txt" 2>&1 || rc=1
          echo "--- $cfg"; grep -E "^prefetch|of read" "$OUT/splits_steps$i.txt"
        done ;;
    flip)  # (~9 min) after `splits`, with its winners made the defaults in constants.py: the bitwise suites (gemv_wg against
           # gemv8 on the 27B launches and forced splits, verify = decode, verify groups, batched rounds), the gates
           # re-recorded (split counts move the md5s: gates_new's steps), the steps, then bench load at C = 1 2 16
        timeout 170 $PYTEST tests/gpu/test_gemv_wg.py -k "27b or forced" tests/gpu/test_verify_groups_gpu.py \
          tests/gpu/test_batched_rounds_gpu.py tests/gpu/test_pdl.py > "$OUT/flip_tests.txt" 2>&1 || rc=1
        tail -3 "$OUT/flip_tests.txt"
        cp gates/canonical.json "$OUT/canonical_before.json"
        timeout 120 python3 gates/run.py 2>&1 | tail -5
        python3 -c "import json; p='gates/canonical.json'; d=json.load(open(p)); [d.pop(k) for k in list(d) if k.endswith('@sm_90')]; json.dump(d, open(p,'w'), indent=1)"
        timeout 120 python3 gates/run.py --update 2>&1 | tail -5 || rc=1
        cp gates/canonical.json "$OUT/canonical.json"
        timeout 90 python3 tools/gemv_prefetch_ab.py --mb 0 > "$OUT/flip_steps.txt" 2>&1 || rc=1
        grep -E "^prefetch|of read" "$OUT/flip_steps.txt"
        timeout ${LOAD_S:-200} python3 -m q27py bench load --random-weights 27b --tier q4s --streams ${STREAMS:-1 2 16} \
          --no-mixed --traces q27py/bench/data/spec_traces.json q27py/bench/data/spec_traces_code.json \
          > "$OUT/flip_load.txt" 2>&1 || rc=1; grep -E "^C=|rounds, |graph keys|^recorded" "$OUT/flip_load.txt" ;;
    n8q)  # (~7 min) issue 10: 1-8 / 9-16 lanes on gemv8w_q4_n8q / n16q (4 CTAs an SM, GWG_N8_FOUR / GWG_N16_FOUR): bitwise
          # tests, the probe per launch at 1 / 8 lanes, then the steps, off / on (and on with the tail split sized for 4
          # CTAs an SM, then every q4 split sized for 4: one partition serves 1-16 lanes at 4 CTAs an SM), one process
          # each; on an H200 this is the lever past the 3-CTA cap (~3.2 TB/s)
        timeout 120 $PYTEST tests/gpu/test_gemv_wg.py -k "n8q or n16q or stage_walk" > "$OUT/n8q_tests.txt" 2>&1 || rc=1
        tail -2 "$OUT/n8q_tests.txt"
        for cfg in "GWG_N8_FOUR=0 GWG_N16_FOUR=0" "GWG_N8_FOUR=1 GWG_N16_FOUR=1" \
                   "GWG_N8_FOUR=1 GWG_N16_FOUR=1 GEMV_TAIL_CTAS=4 GEMV_SPLIT_CTAS=4"; do
          timeout 80 python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8w --lanes 1 8 16 --set $cfg \
            > "$OUT/n8q_probe_${cfg// /_}.txt" 2>&1 || rc=1
          echo "--- probe $cfg"; grep -vE "^(launch|NVIDIA)" "$OUT/n8q_probe_${cfg// /_}.txt" | tail -10
        done
        i=0
        for cfg in "GWG_N8_FOUR=0" "GWG_N8_FOUR=1" "GWG_N8_FOUR=1 GWG_N16_FOUR=1" "GWG_N8_FOUR=1 GWG_N16_FOUR=1 GEMV_TAIL_CTAS=4" \
                   "GWG_N8_FOUR=1 GWG_N16_FOUR=1 GEMV_TAIL_CTAS=4 GEMV_SPLIT_CTAS=4"; do
          i=$((i + 1))
          timeout 90 python3 tools/gemv_prefetch_ab.py --mb 0 --set $cfg > "$OUT/n8q_steps$i.txt" 2>&1 || rc=1
          echo "--- steps $cfg"; grep -E "^prefetch|of read" "$OUT/n8q_steps$i.txt"
        done ;;
    splitsprobe)  # (~3 min) the same levers per launch: gemv_probe at 1 / 8 / 16 lanes, each setting
        for cfg in "GEMV_SPLIT_CTAS=0" "GEMV_SPLIT_CTAS=3 GEMV_TAIL_SPLIT=1" "GWG_WIDE_STAGE=1"; do
          timeout 80 python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8w --lanes 1 8 16 --set $cfg \
            > "$OUT/splitsprobe_${cfg// /_}.txt" 2>&1 || rc=1
          echo "--- $cfg"; grep -vE "^(launch|NVIDIA)" "$OUT/splitsprobe_${cfg// /_}.txt" | tail -10
        done ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
exit $rc
