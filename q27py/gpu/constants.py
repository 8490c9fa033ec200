"""The one table of kernel constants shared by Python and CUDA.

Every number a kernel in cuda/ is built with and that Python must agree with (formats, modes,
descriptor fields, tile sizes, warps, ring stages, split counts) is defined here once. The
runtime passes the whole table to every NVRTC compile as `-DNAME=value` (runtime.compile_options),
and the .cu files use the names without defining them, so nothing is hand-mirrored: change a
value here and both sides move. tests/gpu/test_compile.py checks that no cuda file defines a
table name (or any other bare numeric macro) itself and that the sources build with this table.

No cupy here (the packer, the repack tool and CPU tests import it).
"""

from __future__ import annotations

from q27py.gpu import layout as L

# ---------------------------------------------------------------- packed matrices (layout.py is the spec)
FMT_BF16, FMT_Q8, FMT_Q4 = L.FMT_BF16, L.FMT_Q8, L.FMT_Q4
# bytes of one (16-row tile, 64-k chunk) block, and 16-byte words per thread in it
CB_BF16, CB_Q8, CB_Q4 = L.CHUNK_BYTES[FMT_BF16], L.CHUNK_BYTES[FMT_Q8], L.CHUNK_BYTES[FMT_Q4]
WPC_BF16, WPC_Q8, WPC_Q4 = CB_BF16 // 512, CB_Q8 // 512, CB_Q4 // 512
# chunks per scale group the kernels are built for (q4 64 k, q8 128 k)
GSC_Q8, GSC_Q4 = L.DEFAULT_GROUP[FMT_Q8] // L.CHUNK_K, L.DEFAULT_GROUP[FMT_Q4] // L.CHUNK_K

# epilogues of the GEMV / GEMM
MODE_STORE, MODE_ADD, MODE_SWIGLU = 0, 1, 2

# ---------------------------------------------------------------- GEMV (cuda/gemv.cu v1, cuda/gemv2.cu v2)
GEMV_R = 4  # row tiles (16 rows) per row group: the rows a warp owns
GEMV_WARPS = 8  # warps per CTA
GEMV_MAX_LANES = 16  # lanes per launch (two 8-lane mma tiles)
# v1 cp.async ring depth per format, and resident CTAs of 8 warps per SM (its launch bounds)
RING_BF16, RING_Q8, RING_Q4 = 2, 3, 4
# a8 on q4 weights carries the activations in the ring (cuda/gemv.cu RingCfg): 16 lanes with 4 stages
# would not fit two CTAs per SM, so they run 3
RING_Q4_NT2 = 3
GEMV_ACT_RING = 1  # 0: the register look-ahead everywhere (A/B)
V1_CTAS_NT1, V1_CTAS_NT2, V1_CTAS_BF16 = 2, 1, 1
# a8 kernels (int8 activations, mma.m16n8k32 s8): their 16-lane loop holds no hi/lo activation
# pairs, so it fits two CTAs per SM as well
A8_CTAS_NT1, A8_CTAS_NT2 = 2, 2
# sm_90: a split row group's CTAs run as one thread-block cluster and reduce through DSMEM
# (cuda/gemv.cu; same bits as the ticket path), for splits up to this many (0: always the ticket)
GEMV_CLUSTER_MAX = 0  # 8 measured slower: clusters of 3 halve the resident CTAs (docs/PERF.md)
# v1 / a8: 1 runs a matrix's thin last wave of CTAs split over K (kernels.tail_split). 0 (default):
# measured slower on the H200 (device run g2: decode 2K 7.151 -> 7.325 ms; docs/PERF.md)
GEMV_TAIL_SPLIT = 0
# sm_90a (cuda/gemv_wg.cu runs the a8 q4 launches): resident CTAs per SM that a q4 matrix's K splits
# (kernels.choose_splits) and its tail split (kernels.tail_split) are sized to fill, as one wave at most. 0: the
# v1 / a8 rule of 2 per SM (gemv.cu's CTAs), which leaves a third of gemv_wg's 3-CTA slots idle on the 80-row-group
# matrices (down, gdn_out, attn_o: 240 units on 396 slots). A function of the card only, never of the lane count.
GEMV_SPLIT_CTAS = 0
# The same for the tail split alone (kernels.tail_split), which it turns on for those matrices whatever
# GEMV_TAIL_SPLIT says: gate_up's 544 row groups run as 396 whole units and 148 split in two (296 halves on the
# slots the first wave frees). H100, 2026-12-06 (docs/PERF.md, sixth session): gate_up 2,366 -> 2,489 GB/s at 1 lane,
# 1,864 -> 1,935 at 16; decode 2K -1.7%, verify W=16 -1.0%, the 16-lane batched round -0.9%. GEMV_SPLIT_CTAS = 3
# (the other matrices' splits too) gained 3.6% at 1 lane but lost 1.5% at 16: left at 0.
GEMV_TAIL_CTAS = 3
# GEMV_SPLIT_CTAS only for the matrices of at most this many chunks of K (0: every one). Why: at 27B it moves down
# (272 chunks, 3 -> 4 splits), gdn_out / attn_o (96: 3 -> 4; the launches at half their bytes' floor, docs/PERF.md
# eighteenth session) and attention's q (80: 1 -> 2) together; 96 keeps down as it is, to tell which of them carried
# the 1-lane gain and which the 16-lane loss (`device_wave.sh splitk`). A function of the shape: bits width-invariant.
GEMV_SPLIT_MAX_KCH = 0
# next-launch L2 prefetch (cuda/gemv.cu gemv_prefetch, kernels.link_prefetch): L2 ranges one CTA of
# a launch may prefetch for the launch after it (its last warp's lanes 0..GEMV_PF_PER-1, one each)
GEMV_PF_PER = 8
GEMV_TRACE = 0  # tools/gemv_trace.py: per-CTA %globaltimer stamps of the unit kernels' phases
# tools/step_trace.py: every PDL kernel's CTAs stamp %globaltimer around their wait (common.cuh pdl_wait_if), up to
# STEP_TRACE_CAP records a module (32 B each, only in a STEP_TRACE build). 1 << 16 overflowed: a 27B decode step's
# gemv_wg CTAs number ~95K, so every timeline before 2026-12-07's thirteenth session lost its last ~20% of launches
# (the "?" rows and "NOT labelled"; docs/PERF.md)
STEP_TRACE, STEP_TRACE_CAP = 0, 1 << 18
# a8 q4 GEMV on wgmma (cuda/gemv_wg.cu, sm_90a): CTAs of one warpgroup, one unit each. A ring stage holds
# GWG_CPS consecutive 64-k chunks of the unit's 64 rows (2 KB of weights each); stages per CTA, and
# resident CTAs per SM at 8 / 16 / 32 lanes (their launch bounds: 168 / 255 / 255 registers; ptxas
# sm_90a uses 154 / 200 / 253). 32 lanes: 5 stages of 17 KB, two CTAs in 174 KB of the 227 KB
GWG_CPS = 4
GWG_STAGES = 5
# an experiment knob (0: off): extra dynamic shared memory of each 8-lane gemv_wg CTA, so that two of them fill an SM
# (e.g. 24,576: 2 x 79 KB of 228) and the next launch's CTAs find room beside them under PDL "early" (Q27_PDL=early),
# streaming their first stages during this launch's tail instead of after it (docs/PERF.md: the launches' fixed term)
GWG_N8_PAD = 0
GWG_CTAS_N8, GWG_CTAS_N16, GWG_CTAS_N32 = 3, 2, 2
# 9-16 lanes on gemv8w_q4_n16t: the 32-lane two-pass walk (4 residue partials live, bitwise the same) at
# GWG_CTAS_N16T resident CTAs per SM (12 warps instead of 8: ncu found the 16-lane kernel latency-bound, 0.43
# issued per scheduler-cycle, SM active 70% of its elapsed cycles over 2.06 waves of gate_up). Python-side
# switch (the bench tools' `--set GWG_N16_TWO=V`): 0 never, 1 every launch, 2 (default) launches of more units than
# one wave of the plain entry (GWG_CTAS_N16 per SM), the only ones a third CTA per SM can reach. Why by launch: the
# H200 (2026-12-06 session 2, docs/PERF.md) measured n16t 19% faster on gate_up (544 units: 1,764 -> 2,104 GB/s)
# and 9% on lm_head (3,880 units), but 17-22% slower on every launch of at most 256 units (down, gdn_in,
# attn_in, gdn_out, attn_o), where the two-pass walk only costs.
GWG_CTAS_N16T = 3
GWG_N16_TWO = 2
# 17-32 lanes on gemv8w_q4_n32s: each stage's chunks go to the tensor cores GWG_SUB_N32S at a time (half the int32
# results and A fragments live), a ring of GWG_STAGES_N32S stages, GWG_CTAS_N32S CTAs per SM (12 warps instead of 8;
# ncu: the 32-lane kernel issues 0.35 instructions per scheduler-cycle, latency-bound). Bitwise the same sums.
# Python-side switch (`--set GWG_N32_SUB=V`), values as GWG_N16_TWO's (the same H200 run: gate_up 1,009 -> 1,215
# GB/s, lm_head 1,476 -> 1,585, the launches of at most 256 units 14-27% slower)
GWG_SUB_N32S, GWG_STAGES_N32S, GWG_CTAS_N32S = 2, 4, 3
GWG_N32_SUB = 2
# 1-16 lanes on the wide-stage entries gemv8w_q4_n8w / n16w (the one-pass walk; Python-side switch GWG_WIDE_STAGE, 0
# off, 1 on for 8-lane launches and the 16-lane ones on the plain 2-CTA entry): GWG_CPS_W chunks a stage (all 8
# residues), tensor-core batches of GWG_SUB_W chunks, GWG_STAGES_W stages. Why: ncu puts ~35% of the 1-lane
# kernel's stall samples on the per-stage cp.async wait and barriers, paid per GWG_CPS chunks; a stage of 8 pays
# them half as often per byte (docs/PERF.md). Bitwise the same sums.
GWG_WIDE_STAGE = 0
GWG_CPS_W, GWG_SUB_W, GWG_STAGES_W = 8, 4, 3
# 1-8 lanes on gemv8w_q4_n8q (Python-side switch GWG_N8_FOUR, 0 off, 1 on): the two-pass walk at 8 lanes fits 128
# registers (ptxas sm_90a: 128, no spill), so GWG_CTAS_N8Q CTAs an SM in the same shared memory (4 x 54,400 B). Why:
# a gemv_wg CTA streams ~8 GB/s (a latency-bound loop), so 3 an SM cap a launch at ~3.2 TB/s, 70% of an H200's read
# rate; 4 an SM would allow ~4.2 (docs/PERF.md, 2026-12-06 sixth session). Bitwise the same sums. Measured (seventh
# session, H100): negative, the fourth CTA costs ~10% at every ring depth (GEMV family 2,154 -> 1,907 GB/s at 1 lane,
# decode 2K +8.6%), while the two-pass walk itself at 3 CTAs costs nothing; not yet run on an H200.
GWG_N8_FOUR = 0
GWG_CTAS_N8Q = 4
# 9-16 lanes on gemv8w_q4_n16q (switch GWG_N16_FOUR, 0 off, 1 every 16-lane launch): the two-pass walk with each
# chunk its own tensor-core batch (GWG_SUB_N16Q) and a GWG_STAGES_N16Q-stage ring: 128 registers, no spill, 4 CTAs an SM
GWG_N16_FOUR = 0
GWG_CTAS_N16Q, GWG_SUB_N16Q, GWG_STAGES_N16Q = 4, 1, 4
# 1-8 lanes of a launch that fits one wave at GWG_CTAS_N8D CTAs an SM and whose units stream at least
# GWG_DEEP_MIN_CHUNKS chunks each, on gemv8w_q4_n8d (Python-side switch GWG_DEEP, 0 off, 1 on): the plain entry's walk
# with a GWG_STAGES_N8D-stage ring at GWG_CTAS_N8D CTAs an SM (87,040 B each). Why: such a launch (gdn_in 258 units,
# attn_in 224, down 240) holds ~2 units an SM, and with room for only 2 its CTAs spread evenly (with room for 3 some SMs
# likely stack 3 and finish last: docs/PERF.md reads the 7-stage column so; the deeper ring is how 2 is enforced): on the
# H100 8 stages streamed gdn_in / attn_in / down 7-8% / 7% / 4% faster at 1-8 lanes, but gdn_out / attn_o (32 chunks a
# unit) 8% slower (2026-12-06 seventh session, docs/PERF.md). Bitwise the same sums. On by default since that session's
# t6: decode 2K 7.423 -> 7.247 ms, verify W=8 8.577 -> 8.255 ms on the H100, the gates' md5s unchanged.
GWG_DEEP = 1
GWG_CTAS_N8D, GWG_STAGES_N8D, GWG_DEEP_MIN_CHUNKS = 2, 8, 64
# An experiment (Python-side switch GWG_PLACE2, 0 off, 1 on): an 8-lane launch on the plain entry of at most 2 x SMs units
# asks for GWG_PLACE2_BYTES of shared memory (its 5-stage ring + padding), so at most 2 of its CTAs share an SM. It tests
# the placement reading of n8d's gain (docs/PERF.md, seventh session t5) launch by launch, e.g. on gdn_out / attn_o
# (n8d's rule leaves them on the plain entry). Same kernel, same bits.
GWG_PLACE2 = 0
GWG_PLACE2_BYTES = 78976
# The 1-lane a8 q4 GEMV on the CUDA cores (cuda/gemv_dp.cu gemv8p_q4_d<D>; Python-side switch GEMV_DP4A, read at
# launch time: 0 off, 1 every 1-lane q4 launch of an a8 plan that the tensor-core kernels would run, bar the
# next-launch prefetch and clusters): each thread streams its 16-byte fragments through a register ring GEMV_DP_DEPTH
# chunks deep (8 or 16) and sums them with dp4a, no shared-memory ring, no block barrier in the loop. Why: a gemv_wg
# CTA streams ~8-10 GB/s, a latency-bound loop (docs/PERF.md), and 1-lane launches pay an N = 8 tensor-core
# instruction for one column. Bitwise the tensor-core kernels (same units, exact int32 sums, same fp32 order).
# Measured slower (docs/PERF.md, 2026-12-07 sixteenth session, H100: GEMV family 2,216 -> 1,288 GB/s at 1 lane, decode
# 2K 6.99 -> 11.2-11.8 ms; long-scoreboard stalls at 17 warps an SM), bitwise: off, kept as the experiment.
# Resident CTAs an SM the entries are built for (launch bounds of 128 threads: the 1-lane 8- / 16-deep rings and the
# 2-lane entry GEMV_DP_CTAS_D8 / _D16 / _D8, the 4-lane GEMV_DP_CTAS_D16, the 8-lane GEMV_DP_CTAS_N8).
# GEMV_DP_L2PF (read at launch): chunks past the ring each warp asks L2 for before its PDL wait (0: none), so more
# bytes move during the launch boundary than the ring holds. GEMV_DP_LANES (read at launch, at most 8): the widest
# launch gemv_dp takes (2-8 lanes: entries of 2 / 4 / 8 lanes on the 8-deep ring; the weights unpack once a chunk, each
# lane adds 8 dp4a, and a butterfly over the quad leaves each thread the full sums of the lanes it finishes).
GEMV_DP4A = 0
GEMV_DP_DEPTH = 16
GEMV_DP_L2PF = 0
GEMV_DP_LANES = 1
# GEMV_DP_ASYNC (read at launch; 1-4 lanes): the entries whose ring is in shared memory, GEMV_DP_STAGES chunks a thread
# (cp.async, each thread reading only its own copies: no barrier), GEMV_DP_CTAS_A resident an SM. Measured (same
# session): GEMV family 1,844-1,928 GB/s at 1 lane across 16-32 stages against gemv_wg's 2,247, decode 2K 7.01 -> 7.71
# ms: off.
GEMV_DP_ASYNC = 0
GEMV_DP_STAGES, GEMV_DP_CTAS_A = 24, 3
GEMV_DP_CTAS_D8, GEMV_DP_CTAS_D16, GEMV_DP_CTAS_N8 = 5, 4, 3  # the 8-lane entry: 3 (at 4 it spilled 8 bytes)
# lanes of one gemv_wg launch (gemv8w_q4_n32: one weight sweep for 17-32 lanes, kernels.GemvPlan.run;
# GEMV_MAX_LANES stays the 16 of every other a8 / v1 / v2 launch and of the activation layout's halves)
GWG_MAX_LANES = 32
# v2: CTAs of G2_WARPS warps; resident CTAs per SM the kernels are built for (launch bounds:
# 128 registers at 8 lanes, 168 at 16), and the partition model's slots per SM
G2_WARPS = 4
G2_CTAS_NT1, G2_CTAS_NT2 = 4, 3
G2_CTAS_NT2_Q8 = 2  # q8 at 16 lanes spills at 3 CTAs unless its pipeline is 1 deep: 2 CTAs, 4 slices
# v2 register pipeline: 16-byte slices (one per row tile) kept in flight per warp, by format
PIPE_BF16, PIPE_Q8, PIPE_Q4 = 3, 3, 3  # 8-lane kernels (they also load activations a slice ahead)
PIPE2_BF16, PIPE2_Q8, PIPE2_Q4 = 3, 4, 2  # 16-lane kernels (168 registers, q8 255: deeper ones spill)
# descriptor fields (int64 each), one row per matrix of a launch
D_W, D_S, D_Y, D_WS, D_CNT, D_LDY, D_NOUT, D_KCH = 0, 1, 2, 3, 4, 5, 6, 7
D_RT, D_FMT, D_MODE, D_SPLITS, D_RG, D_CTA0, D_GSC, D_NGROUPS = 8, 9, 10, 11, 12, 13, 14, 15
D_RGB = 16  # v2: row groups per CTA (its warps split as D_RGB x G2_WARPS / D_RGB over K)
# a SwiGLU matrix whose epilogue also writes the next plan's a8 activations (kernels.GemvPlan quant_into; 0: none):
# that plan's codes / scales / code row stride, the chunk arrival counters, and the piece's first output in the matrix
D_XQ, D_XS, D_LDQ, D_QCNT, D_O0 = 17, 18, 19, 20, 21
# ... and where that epilogue publishes each chunk it quantized (an int flag a chunk; 0: none): the MLP walk's down units
# wait on them in the same grid (constants MLP_WALK, cuda/gemv_wg.cu's *_walk entries)
D_QRDY = 22
D_NFIELDS = 23

# ---------------------------------------------------------------- prefill GEMM (cuda/gemm.cu)
GM_WARPS = 8
GM_TOK = 64  # tokens per CTA
GM_XS = 72  # bf16 per activation row in shared memory (64 + 8 pad: conflict-free)
GM_STAGES = 4

# ---------------------------------------------------------------- attention (cuda/attention.cu, attention_prefill.cu)
NSPLIT = 64  # position splits of the decode / verify kernel
REPMAX = 8  # q heads per kv head the decode kernel holds
ATT_WARPS = 8
PF_ROWS = 64  # (lane, q head) rows per prefill CTA
# tensor-core decode / verify kernel (attention.cu attn_mma_*, EngineConfig.attn_decode "mma"): one CTA
# per (kv head, split) takes every lane and q head of that kv head, so the KV is read once per round
ATTD_KT = 32  # positions per K / V tile staged through shared memory (two 16-position mma steps)
ATTD_STAGES = 3  # cp.async ring depth: 2 tiles in flight while one is computed
ATTD_ROWS = 8  # (lane, q head) rows per warp: the n = 8 side of mma.m16n8k16 (S^T = K Q^T)
ATTD_MIN_WARPS = 4  # warps per CTA at least (the ones past the rows only stage / convert tiles)
ATTD_MAX_WARPS = 12  # launch bound: 96 rows (16 lanes x 6 q heads); more rows keep the split kernel
ATTD_MIN_SPLIT = 64  # positions per split at least (a multiple of ATTD_KT)
ATTD_NSPLIT_MAX = 128  # splits per kv head at most (partials buffer)
ATTD_WAVES = 2  # splits are sized for this many CTAs per SM over the kv heads
# 1: Q and the softmax weights enter as bf16 hi + lo (fp32-grade, 2 mma per product) wherever that fits
# the registers (every head dim; 256 on sm_90+ only, sm_80-89 round to bf16 there); 0: bf16 once (1 mma)
ATTD_QSPLIT = 1
PF_THREADS = 128
# prefill attention v2 (cuda/attention_prefill2.cu): K/V cp.async stages, the absolute key block a
# CTA covers (rows past it merge per-block partials; a multiple of every NK), and the three tile
# variants (warps of 16 rows, keys per tile): a 227 KB parts, b 163 KB, c 99 KB
PF2_STAGES = 2
PF2_SPLIT_KEYS = 4096
PF2_WARPS_A, PF2_NK_A = 8, 64
PF2_WARPS_B, PF2_NK_B = 8, 32
PF2_WARPS_C, PF2_NK_C = 4, 32
# prefill attention v3 (cuda/attention_prefill3.cu, sm_90a wgmma): v2's contract and key blocks; warps (two
# warpgroups of 64 rows: 16 rows a warp, as v2's variant a), keys per tile, and its one head dim
PF3_WARPS, PF3_NK, PF3_HD = 8, 64, 256

# ---------------------------------------------------------------- tables, norms, sampling
TAB_F32, TAB_BF16, TAB_Q8 = 0, 1, 2
NORM_PER_THREAD = 8  # row elements a rmsnorm thread keeps in registers
NORM_A8_MAX_K = 8192  # rmsnorm_rows_a8 quantizes from a shared copy of rows up to this long (32 KB)
GATED_A8_MAX_DV = 1024  # gated_rmsnorm_a8: value head dims it stages (one block of dv threads)
# GemvPlan.run at GEMV widths: a plan of two or more launches runs its first (smallest) one on a side branch
# (Runtime.side_branch) beside the others, so the chain no longer waits for it: the GDN layer's bf16 decay / beta gates
# beside qkvz (the decode step's timeline, docs/PERF.md eleventh session: 8.1 us a GDN layer for 1 MB), attention's
# q8 kv beside q. 0: off; 1: every such plan; 2: a plan whose first launch is bf16 only (the GDN gates; mode 1
# measured better on every step). Bitwise either way (the same launches). Off: -1.1% on the 1-lane step but
# +0.7% on verify W=8, and the engine's rounds are W=4 / W=8 (docs/PERF.md twelfth session)
GEMV_BRANCH = 0
# GemvPlan.run at GEMV widths: a plan of a bf16 launch then a q4 one on gemv_wg (the GDN layer's decay / beta gates and
# qkvz) as ONE grid (cuda/gemv_wg.cu gemv8w_q4_n8_g / n8d_g / n16_g: its first CTAs run the bf16 units on 4 warps,
# gemv_v1.cuh gemv_body_w4, the rest the q4 units): the gates' launch leaves the chain and the grid keeps its PDL
# wait, which the side branch above cannot. 0: off; 1: on, the gates' K splits sized so both fit one wave of the
# deep-ring entry (GemvPlan._fit_merge: 4 splits, not 10; the gates' sums differ from mode 0's); 2: on where the
# grid of both launches' units fits one wave of the entry it takes (at <= 8 lanes 276 units on the plain entry's 3 an
# SM; the gates' splits and bits as mode 0's). Merged or launched apart, the same bits within a mode. Measured on the
# H100 (docs/PERF.md thirteenth session): the merged grid takes the gates off the chain (21.0 -> 15.7 us a GDN layer at
# mode 2, 18.1 at mode 1; the 10-split merge without a fit ran a second wave, 22.7), but the step does not follow:
# decode 2K -0.1% / -0.3%, verify W=8 +0.5% / 0%, W=16 0% / +0.5% (mode 2 / mode 1). Off; and with GDN_GATES_IN_CONV
# on (the default) there is no bf16 gates launch left to merge
GEMV_MERGE = 0
# decode / verify (<= VERIFY_SPAN lanes) of a GDN layer: gdn_conv's v-head blocks compute the decay / beta gates (b, a)
# from the normed rows themselves (cuda/conv.cu gates_dot2, kernels.GatesInConv) and the layer's in plan skips its
# bf16 launch (GemvPlan.run skip_bf16). Why: that launch held the 27B step's critical path 7.9 us a GDN layer for
# 1 MB (48 layers: 379 us of 7,286, the complete tools/step_trace.py timeline, docs/PERF.md thirteenth session),
# where the conv's blocks add two 5,120-long dot products. Not bitwise GEMV_MERGE / the GEMV's b / a (fp32 sums of
# exact products, not the GEMV's hi + lo bf16 operands): its own bits, the gates re-recorded if it becomes the
# default. Read when a FastModel is built. 0: off; 1: on (the default since 2026-12-07, fourteenth session, H100:
# decode 2K 7.08-7.10 -> 6.97 ms, -1.6%; verify W=8 -2.2%; the gates PASS with the same md5s -- the greedy ids do
# not move, though the gates' fp32 bits differ from the GEMV's)
GDN_GATES_IN_CONV = 1
# a decode step's GDN layer (one committing lane; decode_batch: one a state): gdn_conv slides the conv window by the
# lane's raw row as it reads the taps (cuda/conv.cu gdn_conv_body win_commit), so no gdn_conv_commit launch (1.34 us a
# GDN layer on the step's critical path, 64 us a 2K step on the H100, docs/PERF.md thirteenth session). Bitwise: the
# same values land in the window. Read at launch time (graphs capture what was set). 0: off; 1: on (the default since
# 2026-12-07, fourteenth session, H100: decode 2K -0.2% alone, -0.7% on top of GDN_GATES_IN_CONV; tests and gates
# bitwise)
CONV_COMMIT_FOLD = 1
# decode / verify GEMV plans of at most NORM_FOLD_LANES lanes whose input is an RMSNorm of the residual rows (a
# layer's in plan and gate_up: 128 norm launches of a 27B step) run their q4 launch on gemv_wg's *_nf entries: each
# CTA replays the norm in front of its unit (cuda/gemv_wg.cu wg_norm_fold), row group 0 writes the normed rows, and where
# the plan has other launches (attention's q8 kv, the GDN gates' bf16 GEMV) the first matrix's row group 0 writes
# their int8 activations too and they run after it; the norm launch goes (kernels.GemvPlan.folds_norm /
# _fold_launch, FastModel._norm / _take_norm). Why: rmsnorm_rows_a8 is one CTA a lane holding the 27B step's critical
# path 3.7 us x 128 (~470 us of 7,025, docs/PERF.md fourteenth session), where each GEMV CTA can sum a 5,120-long row
# from L2 while its first weight stages stream. Bitwise the norm launch + prequantized GEMV (the sum of squares in
# rmsnorm_row's exact order). Each lane costs every CTA another row read, so only small widths. Read at launch
# time. 0: off; 1: on -- measured 2026-12-07 (H100, docs/PERF.md fifteenth session): bitwise, but decode 2K 6.911 ->
# 9.417 ms: the fold is O(K) work in every CTA after its wait (gate_up's 692 CTAs, two waves, each normalizing all
# 80 chunks: 39 -> 62 us a launch), far more than the 3.7 us the norm launch held the chain. Kept as the experiment.
NORM_FOLD = 0
NORM_FOLD_LANES = 2
# decode / verify down plans of at most QUANT_FOLD_LANES lanes run their q4 launch on the *_nf entries' quant-only
# mode (cuda/gemv_wg.cu wg_norm_fold with no weights): each CTA quantizes its own unit's chunks of the SwiGLU rows after
# its PDL wait, and the quant_act8 launch before down goes (kernels.GemvPlan.folds_quant, FastModel._mlp). Why: that
# launch holds the 27B step's chain ~1.5 us x 64 layers plus a hand-over; here a CTA reads only its ~chunks of fp32
# rows (no sum to replay, unlike NORM_FOLD), so wider blocks pay too. Bitwise quant_act8 + prequantized down.
# Read at launch time. 0: off; 1: on -- measured 2026-12-07 (H100, fifteenth session): bitwise, decode 2K 6.911 ->
# 7.457 ms (+8.5 us a down: the quantizing sits after the wait, before the first stage). A8_FOLD's bit 4 (gate_up's
# epilogue quantizes for down) wins where both are set.
QUANT_FOLD = 0
QUANT_FOLD_LANES = 8
# decode / verify gdn_out plans of at most NORM_FOLD_LANES lanes (the GDN layer's output projection, one q4 launch
# on gemv8w_q4_n8 / n8d) run gemv_wg's *_gf entries: each CTA computes the GDN output norm (gated RMSNorm, per value
# head) of the heads its unit's chunks lie in (cuda/gemv_wg.cu wg_gated_fold), and the gated_rmsnorm_a8 launch goes
# (kernels.GemvPlan.folds_gated, FastModel._gdn_out). Why: that launch holds the 27B decode step's chain 1.6 us a GDN
# layer (77 us a 2K step, docs/PERF.md fourteenth session), for 48 heads of 128 values. Bitwise (block_sum's order:
# the CTA's 128 threads are the norm's block of dv). GF_HEADS: heads summed per barrier. Read at launch time. 0: off;
# 1: on -- measured 2026-12-07 (H100, fifteenth session): bitwise, decode 2K 6.911 -> 7.228 ms (+6.6 us a GDN layer)
GATED_FOLD = 0
GF_HEADS = 4
# shared memory of an sm_90 SM (228 KB; each resident CTA also takes 1 KB): what an *_nf launch's fold buffer may not
# push its entry's resident CTAs past (GemvPlan.folds_norm)
GWG_SM_SHARED = 233472
# which producers hand the next GEMV its a8 activations in decode / verify steps (bits; each bitwise, none changes a
# value): 1 the fused GDN step (gdn_out's), 2 the attention combines (attn_o's), 4 gate_up's SwiGLU epilogue (down's).
# Cleared bits bring back those quant_act8 launches (tools/gemv_prefetch_ab.py --set A8_FOLD=N: the A/B). 3 since
# 2026-12-07 (H100, docs/PERF.md eleventh session): 1 | 2 neutral to slightly ahead; 4 cost the decode step +0.6%
# (the chunk arrival on every gate_up unit's exit path outweighs the quant_act8 launch it removes)
A8_FOLD = 3
# a decode / verify layer's MLP of 1-8 lanes -- gate_up (SwiGLU epilogue) then down -- as one grid of both plans'
# units (cuda/gemv_wg.cu *_walk entries, kernels.GemvPlan.walks_into, FastModel._mlp): gate_up's epilogue quantizes
# down's input a chunk at a time and flags it, and down's units (claimed after every gate_up unit) wait on their own
# chunks' flags, not on a grid: the gate_up -> down boundary (and A8_FOLD 4's quant_act8 launch) goes. Bitwise the
# two launches. Read at launch time. 0: off; 1: both plans on gemv8w_q4_n8's entry (3 CTAs an SM); 2: on n8d's (2 an
# SM, the deep ring). MLP_WALK_LANES: the widest block it takes (8; 16: 9-16 lanes too, on gemv8w_q4_n16t's walk).
# MLP_WALK_SLEEP: ns a waiting down unit sleeps between polls of its flags. Measured 2026-12-07 (H100, seventeenth
# session): bitwise, and slower -- decode 2K 6.878 -> 7.367 ms (1) / 7.231 (2), verify W=16 10.157 -> 11.139: the
# walk grid takes 63.9 us a layer against 55.5 for gate_up + quant_act8 + down (step_trace): down's units get SM slots
# only as gate_up's CTAs leave, as under PDL, and then run on gate_up's entry instead of n8d's.
MLP_WALK = 0
MLP_WALK_LANES = 8
MLP_WALK_SLEEP = 128
# a decode / verify layer's residual GEMVs (bit 1: gdn_out / attn_o before the MLP; bit 2: down before the next layer,
# the last layer's excepted; 1-8 lanes on gemv8w_q4_n8 / n8d) compute the next RMSNorm in their own last CTA
# (cuda/gemv_wg.cu *_nt entries, wg_norm_tail; kernels.GemvPlan.set_norm_tail, FastModel._norm): the CTAs count out on
# a plan-owned ticket after their unit and the last one writes the normed rows and the next plan's a8 activations, so
# the rmsnorm_rows_a8 launch (~3.7 us of the chain: docs/PERF.md seventeenth session's timeline) and one grid boundary
# go, with no work repeated. Bitwise the norm launch. Read at launch time, as is NORM_TAIL_LANES (the widest block it
# takes). Measured 2026-12-07 (H100, eighteenth session): bitwise, and much slower -- decode 2K 6.945 -> 7.945 ms (1)
# / 8.900 (3), verify W=8 8.009 -> 13.789 / 19.361. The timeline: the out projection's grid ends ~19 us later at 1
# lane (busy 11.0 -> 30.2 us), against the 3.6 us norm launch it replaces: the norm's latency-bound chain, spread over
# the norm kernel's 32 warps, runs in the GEMV CTA's 4 (keeping the row and the weights in shared memory changed
# nothing measurable). Off; the entries stay as the measured experiment.
NORM_TAIL = 0
NORM_TAIL_LANES = 8
ATT_A8_MAX_HD = 1024  # the attention combines' a8 output (attention_a8_fuses): head dims they stage (a block of hd)
GATED_ROWS = 16  # gated_rmsnorm_rows (prefill chunks): tokens of one value head per block
CONV_ROWS = 32  # gdn_conv_rows_k4 (prefill chunks): consecutive tokens of one head slot per block

# ---------------------------------------------------------------- prefill through cuBLAS (cuda/dequant.cu)
DQ_WARPS = 8  # warps per expansion CTA, one (tile, chunk) block each
# the small bf16 matrices' fused three-term prefill GEMM (cuda/dequant.cu gemm3_small, prefill_small_gemm "bf16x3f"):
# n8 token tiles a warp (4 warps: 2 token groups x 2 row halves, so 16 GEMM3_NTW tokens a CTA; 2 measured slower),
# 64-column stages in its cp.async ring, row tiles it is built for (MT 1..GEMM3_MT)
GEMM3_NTW, GEMM3_STAGES, GEMM3_MT = 1, 4, 8
DQ_LD = 72  # bf16 per staged row (64 + 8 pad: 16-byte aligned rows, no bank conflicts)

# ---------------------------------------------------------------- GDN recurrence (cuda/gdn.cu gdn_step_*)
GDN_ST_LPC = 4  # lanes per value column (cuda/gdn.cu's butterfly layout): a warp carries 32 / LPC columns
GDN_ST_WARPS = 4  # warps per CTA, on consecutive columns of one head
GDN_ST_TILE = 16  # tokens staged in shared memory per burst (>= the verify width: one burst per round)
# ---------------------------------------------------------------- fused GDN decode (cuda/gdn_decode.cu)
GDN_FD_COLS = 4  # value columns per warp (the recurrence of each exactly as gdn_step's)
GDN_FD_WARPS = 8  # warps per block by default: 32 columns, so a 128-column head spans 4 blocks
GDN_FD_MAX_WARPS = 32  # launch bounds (a whole 128-column head in one block, no norm ticket)
GDN_FD_LANES_MAX_WARPS = 16  # launch bounds of the decode_batch entry (its lane pointers need registers: 128 max)
# ---------------------------------------------------------------- GDN chunked pipeline (cuda/gdn_chunk2.cu)
GDN2_C = 64  # tokens per chunk (chunks start at absolute multiples of it)
GDN2_BV = 64  # value columns per CTA of the state pass (4 warps of 16 rows)
GDN2_GATES = 4  # gate rows per (head, chunk) in the scratch: G hi, G lo, e^{G_last - G}, e^G
# ---------------------------------------------------------------- programmatic dependent launch (common.cuh)
# 1: the short kernels let the next kernel launch before their own wait (EngineConfig.pdl "early");
# the runtime compiles with the engine's choice (runtime.compile_options), this is the default
PDL_EARLY = 0
# A timing probe of the dependency-free step only (`--set PDL_NOWAIT=N` of gemv_probe / tools/gemv_prefetch_ab.py;
# the engine refuses to load with it, the results are wrong): griddepcontrol.wait compiled out (common.cuh) in every
# kernel (1), in every kernel but the GEMVs (2), in the GEMVs only (3). docs/PERF.md, 2026-12-07.
PDL_NOWAIT = 0
# partial blocks per row of the argmax / sampling pass (top2_final merges them in one warp: <= 32). 32 since the
# thirteenth session (was 16: the 27B's 248K-logit row held the step ~26 us; the same ids, the keys carry them)
TOP2_BLOCKS = 32
# ---------------------------------------------------------------- decode_batch lane table (FastModel.decode_batch)
# One weight sweep for up to LANES_MAX sequences: per lane one row of LT_NFIELDS int64 state base
# addresses (layer 0 of each array; kernels add the layer's byte offset), then LANES_MAX int32
# positions, then LANES_MAX int32 token ids (common.cuh lane_ptr / lane_positions read it).
LANES_MAX = GEMV_MAX_LANES
LT_K, LT_V, LT_KX, LT_VX, LT_GDN, LT_WIN = 0, 1, 2, 3, 4, 5  # K / V rows, fp8 K / V exponents, GDN S, conv window
LT_NFIELDS = 6
# ---------------------------------------------------------------- verify_batch group table (FastModel.verify_batch)
# A verify_batch runs several sequences' verify forwards in one sweep: group g is the W_g consecutive lane-table
# rows of one sequence (its pending token and drafts, row r0 + j at that state's position + j; every row carries
# the state's addresses). The kernels whose bits depend on the group (the GDN conv / recurrence / window commit,
# attention's split size) read it from this int32 table, the host's image written with the lane table: field f
# of entry i at word f * LANES_MAX + i. GT_FIRST / GT_COUNT: group g's first lane row and lane count; GT_KEEP:
# its kept lanes for commit_batch (0: untouched); GT_GROUP: lane b's group.
GT_FIRST, GT_COUNT, GT_KEEP, GT_GROUP = 0, 1, 2, 3
GT_NFIELDS = 4


def table() -> dict[str, int]:
    """Every UPPER_CASE integer above, by name (what the kernels are compiled with)."""
    return {k: int(v) for k, v in globals().items() if k.isupper() and isinstance(v, int) and not isinstance(v, bool)}


def defines() -> tuple[str, ...]:
    """The table as NVRTC / nvcc options."""
    return tuple(f"-D{k}={v}" for k, v in sorted(table().items()))
