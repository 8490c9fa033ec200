// Gated DeltaNet front end: causal depthwise conv1d + SiLU + per-head l2norm of q and k,
// and the decay/beta gates, for W lanes (tokens) at once; plus the conv-window commit.
//
// Lane t's conv taps are [window (K-1 committed raw rows), raw rows of lanes 0..t]: lanes
// never write the window, so a verify round leaves committed state untouched, and the
// commit (gdn_conv_commit) later slides the window by the n accepted raw rows. Raw rows are
// the in_proj_qkv outputs, kept per layer until the commit. The *_groups entries are
// FastModel.verify_batch's: several sequences' verify lanes in one launch, each group run by the
// one-sequence body at its own offsets (common.cuh group table), so a lane's bits are its solo verify's.
#include "common.cuh"

// The gates' in-conv form (constants GDN_GATES_IN_CONV; kernels.GatesInConv): b and a of v head h for one lane, the
// dot products of rows h and HV + h of the bf16 decay / beta matrix with the lane's normed row x, computed by the
// head's conv block instead of a GEMV launch before qkvz (7.9 us a GDN layer on the step's critical path for 1 MB,
// tools/step_trace.py, docs/PERF.md thirteenth session). wab: the matrix's packed codes (layout.py pack_codes: 16-row
// tiles x 64-k chunks of 2,048 B, the mma A-fragment order -- row r of a tile, k pair p of a chunk in word
// s * 128 + (g * 4 + t) * 4 + r / 8 + 2 * ((p % 8) / 4) with g = r % 8, s = p / 8, t = p % 4), kch chunks. A thread
// takes k pairs q = tid, tid + blockDim.x, ... (chunk q / 32, pair q % 32) as fmaf chains (the weights exact in fp32),
// then block_sum's fixed order: fp32 sums of exact products, not the GEMV's bits (its x is split hi + lo into bf16
// mma operands), so the switch is its own bits (the gates re-recorded where it becomes the default).
// The weights are constants: a thread's first GATES_PRE pairs of both rows are loaded before the kernel's PDL wait
// (gates_preload), so they arrive while qkvz streams; after the wait only the lane's x row (from L2) is on the path.
constexpr int GATES_PRE = 24;  // pairs a thread holds from before the wait (27B: 2,560 pairs on 128 threads = 20)
struct GatesPre {
    u32 vb[GATES_PRE], va[GATES_PRE];
};

__device__ __forceinline__ int gates_word(int q) {  // k pair q's word in its row's (tile, chunk) blocks
    const int c = q >> 5, p = q & 31;
    return c * 512 + (p >> 3) * 128 + (p & 3) * 4 + 2 * ((p & 7) >> 2);
}

__device__ __forceinline__ void gates_rows(const u32* __restrict__ wab, int kch, int HV, int h, const u32*& tb,
                                           const u32*& ta) {
    const int rb = h, ra = HV + h;  // the b row, the a row: their tiles' first words, plus the row's offset
    tb = wab + (i64)(rb >> 4) * kch * 512 + (rb & 7) * 16 + ((rb & 15) >> 3);
    ta = wab + (i64)(ra >> 4) * kch * 512 + (ra & 7) * 16 + ((ra & 15) >> 3);
}

// Before the wait: every load unpredicated (past the last pair: the last pair again, unused), so all issue at once.
__device__ __forceinline__ void gates_preload(const u32* __restrict__ wab, int kch, int HV, int h, GatesPre& g) {
    const u32 *tb, *ta;
    gates_rows(wab, kch, HV, h, tb, ta);
    const int np = kch * 32;
#pragma unroll
    for (int i = 0; i < GATES_PRE; i++) {
        const int w = gates_word(min((int)threadIdx.x + i * (int)blockDim.x, np - 1));
        g.vb[i] = tb[w];
        g.va[i] = ta[w];
    }
}

__device__ __forceinline__ float2 gates_dot2(const GatesPre& g, const u32* __restrict__ wab, int kch, int HV, int h,
                                             const float* __restrict__ x, float* red) {
    const int np = kch * 32, step = blockDim.x, tid = threadIdx.x;
    const float2* x2 = reinterpret_cast<const float2*>(x);
    float2 xv[GATES_PRE];
#pragma unroll
    for (int i = 0; i < GATES_PRE; i++) xv[i] = x2[min(tid + i * step, np - 1)];
    float sb = 0.f, sa = 0.f;
#pragma unroll
    for (int i = 0; i < GATES_PRE; i++)
        if (tid + i * step < np) {
            sb = fmaf(bf16x2_lo(g.vb[i]), xv[i].x, sb);
            sb = fmaf(bf16x2_hi(g.vb[i]), xv[i].y, sb);
            sa = fmaf(bf16x2_lo(g.va[i]), xv[i].x, sa);
            sa = fmaf(bf16x2_hi(g.va[i]), xv[i].y, sa);
        }
    const u32 *tb, *ta;
    gates_rows(wab, kch, HV, h, tb, ta);
    for (int q = tid + GATES_PRE * step; q < np; q += step) {  // rows longer than the preload (not the 27B's)
        const int w = gates_word(q);
        const u32 vb = tb[w], va = ta[w];
        const float2 v = x2[q];
        sb = fmaf(bf16x2_lo(vb), v.x, sb);
        sb = fmaf(bf16x2_hi(vb), v.y, sb);
        sa = fmaf(bf16x2_lo(va), v.x, sa);
        sa = fmaf(bf16x2_hi(va), v.y, sa);
    }
    sb = block_sum(sb, red);
    sa = block_sum(sa, red);
    return make_float2(sb, sa);
}

// Conv + SiLU (+ l2 norm for q / k) of one lane's channel c of head slot `slot`. Taps: t + j in
// [window (K-1 rows) ; raw rows 0..t]; the lane's outputs go to qkvn_row / gb_row, its b / a
// gates come from ab_row -- or, with wab (gates_dot2), from the lane's normed row x_row.
// win_commit (constants CONV_COMMIT_FOLD; only for a lane t = 0 that commits alone, so its thread is the one reader
// of its channel's window): after the lane's outputs, the window slides by its raw row here, tap i + 1 into row i
// (gdn_conv_commit's n = 1: the same values), one launch fewer a decode step's GDN layer. The window is read and
// written through these pointers, so neither is __restrict__: each row's store stays after its load. Apart from the
// fp work, so the conv's arithmetic compiles as in the entries without it (test_verify_groups_layout's PTX check).
__device__ __forceinline__ void gdn_conv_body(const float* __restrict__ raw, int ldr, const float* window,
                                              const float* __restrict__ convw, const float* __restrict__ ab_row,
                                              const float* __restrict__ neg_a, const float* __restrict__ dt_bias,
                                              int H, int HV, int dk, int dv, int KW, float q_scale, int t,
                                              float* __restrict__ qkvn_row, float* __restrict__ gb_row,
                                              const GatesPre* pre = nullptr, const u32* __restrict__ wab = nullptr,
                                              int kch = 0, const float* __restrict__ x_row = nullptr,
                                              float* win_commit = nullptr) {
    __shared__ float red[32];
    const int slot = blockIdx.y, c = threadIdx.x;
    const int C = 2 * H * dk + HV * dv;
    const bool is_qk = slot < 2 * H;
    const int d = is_qk ? dk : dv;
    const int ch = is_qk ? slot * dk + c : 2 * H * dk + (slot - 2 * H) * dv + c;
    float y = 0.f;
    if (c < d) {
        float acc = 0.f;
        for (int j = 0; j < KW; j++) {
            const int idx = t + j;  // position in [window ; raw rows]
            const float xv = idx < KW - 1 ? window[(i64)idx * C + ch] : raw[(i64)(idx - (KW - 1)) * ldr + ch];
            acc = __fadd_rn(acc, __fmul_rn(convw[(i64)ch * KW + j], xv));
        }
        y = acc * sigmoid_f(acc);
    }
    if (is_qk) {
        const float ss = block_sum(y * y, red);
        y = y / sqrtf(ss + 1e-6f);
        if (slot < H) y *= q_scale;
    }
    if (c < d) qkvn_row[ch] = y;
    if (win_commit != nullptr && c < d)
        for (int i = 0; i < KW - 1; i++) {  // read row i + 1 (or the raw row), then write row i: in place, in order
            const int idx = t + i + 1;
            win_commit[(i64)i * C + ch] = idx < KW - 1 ? window[(i64)idx * C + ch] : raw[(i64)(idx - (KW - 1)) * ldr + ch];
        }
    if (!is_qk) {  // block-uniform: the slot is the block's
        const int h = slot - 2 * H;
        float b, a;
        if (wab != nullptr) {
            const float2 ba = gates_dot2(*pre, wab, kch, HV, h, x_row, red);
            b = ba.x, a = ba.y;
        } else {
            b = ab_row[h], a = ab_row[HV + h];
        }
        if (c == 0) {
            gb_row[h] = neg_a[h] * softplus_f(a + dt_bias[h]);
            gb_row[HV + h] = sigmoid_f(b);
        }
    }
}

// grid (nlanes, 2H + HV [, layers]), block >= max(dk, dv) rounded to 32.
// slot < H: q head; slot < 2H: k head; else v head (also computes g and beta of that head).
extern "C" __global__ void gdn_conv(const float* __restrict__ raw, int ldr,  // lane t raw row: raw + t*ldr, C channels
                                    const float* window,                    // [K-1, C], oldest first
                                    const float* __restrict__ convw,        // [C, K]
                                    const float* __restrict__ ab, int ldab,  // lane t: b [HV] then a [HV]
                                    const float* __restrict__ neg_a, const float* __restrict__ dt_bias, int H, int HV,
                                    int dk, int dv, int KW, float q_scale, float* __restrict__ qkvn,  // [lane][C]
                                    float* __restrict__ gb,                                              // [lane][2HV]
                                    const u32* __restrict__ wab, int kch, const float* __restrict__ x, int ldx,
                                    float* win_commit)  // CONV_COMMIT_FOLD: window again, for one committing lane
{
    GatesPre pre;
    if (wab != nullptr && (int)blockIdx.y >= 2 * H) gates_preload(wab, kch, HV, blockIdx.y - 2 * H, pre);
    pdl_entry();
    const int t = blockIdx.x;
    gdn_conv_body(raw, ldr, window, convw, ab + (i64)t * ldab, neg_a, dt_bias, H, HV, dk, dv, KW, q_scale, t,
                  qkvn + (i64)t * (2 * H * dk + HV * dv), gb + (i64)t * 2 * HV, &pre, wab, kch, x + (i64)t * ldx,
                  win_commit);
}

// decode_batch (common.cuh lane table): lane b is its own sequence's next token -- taps [its state's
// window (+ win_off bytes: this layer) ; its raw row b], i.e. t = 0 of a one-token decode.
// grid (lanes, 2H + HV), block as gdn_conv.
extern "C" __global__ void gdn_conv_lanes(const float* __restrict__ raw, int ldr, const i64* __restrict__ lanes,
                                          i64 win_off, const float* __restrict__ convw, const float* __restrict__ ab,
                                          int ldab, const float* __restrict__ neg_a,
                                          const float* __restrict__ dt_bias, int H, int HV, int dk, int dv, int KW,
                                          float q_scale, float* __restrict__ qkvn, float* __restrict__ gb,
                                          const u32* __restrict__ wab, int kch, const float* __restrict__ x, int ldx,
                                          int commit /* CONV_COMMIT_FOLD: each lane's window slides here */) {
    GatesPre pre;
    if (wab != nullptr && (int)blockIdx.y >= 2 * H) gates_preload(wab, kch, HV, blockIdx.y - 2 * H, pre);
    pdl_entry();
    const int b = blockIdx.x;
    float* win = lane_ptr<float>(lanes, b, LT_WIN, win_off);
    gdn_conv_body(raw + (i64)b * ldr, ldr, win, convw, ab + (i64)b * ldab, neg_a, dt_bias, H, HV, dk, dv, KW, q_scale,
                  0, qkvn + (i64)b * (2 * H * dk + HV * dv), gb + (i64)b * 2 * HV, &pre, wab, kch, x + (i64)b * ldx,
                  commit ? win : nullptr);
}

// verify_batch (common.cuh group table): lane b is lane t = b - r0 of its group's verify (r0: the group's first
// row) -- taps [its state's window (+ win_off bytes: this layer) ; the group's raw rows r0 .. b], i.e. gdn_conv's
// lane t of that sequence's solo verify, its outputs in rows b. No window commit (commit_batch slides it).
// grid (lanes, 2H + HV), block as gdn_conv.
extern "C" __global__ void gdn_conv_groups(const float* __restrict__ raw, int ldr, const i64* __restrict__ lanes,
                                           const int* __restrict__ groups, i64 win_off,
                                           const float* __restrict__ convw, const float* __restrict__ ab, int ldab,
                                           const float* __restrict__ neg_a, const float* __restrict__ dt_bias, int H,
                                           int HV, int dk, int dv, int KW, float q_scale, float* __restrict__ qkvn,
                                           float* __restrict__ gb, const u32* __restrict__ wab, int kch,
                                           const float* __restrict__ x, int ldx,
                                           float* no_commit /* null: gdn_conv's arguments; commit_batch slides */) {
    GatesPre pre;
    if (wab != nullptr && (int)blockIdx.y >= 2 * H) gates_preload(wab, kch, HV, blockIdx.y - 2 * H, pre);
    pdl_entry();
    const int b = blockIdx.x, r0 = group_first_of_lane(groups, b);
    gdn_conv_body(raw + (i64)r0 * ldr, ldr, lane_ptr<const float>(lanes, b, LT_WIN, win_off), convw, ab + (i64)b * ldab,
                  neg_a, dt_bias, H, HV, dk, dv, KW, q_scale, b - r0, qkvn + (i64)b * (2 * H * dk + HV * dv),
                  gb + (i64)b * 2 * HV, &pre, wab, kch, x + (i64)b * ldx);
}

// One channel's window slide by n raw rows: rows n.. of [window ; raw rows 0..n-1] become the window.
__device__ __forceinline__ void conv_commit_body(float* __restrict__ win, const float* __restrict__ rw, int ldr, int C,
                                                 int KW, int n, int ch) {
    float keep[8];
    for (int i = 0; i < KW - 1 && i < 8; i++) {
        const int idx = n + i;  // in [window ; raw rows 0..n-1]
        keep[i] = idx < KW - 1 ? win[(i64)idx * C + ch] : rw[(i64)(idx - (KW - 1)) * ldr + ch];
    }
    for (int i = 0; i < KW - 1 && i < 8; i++) win[(i64)i * C + ch] = keep[i];
}

// Slide the window of every layer by n accepted raw rows (n from the device when n_dev is
// given, so the launch can be captured once). grid (ceil(C/256), layers), block 256.
extern "C" __global__ void gdn_conv_commit(float* __restrict__ window, i64 window_layer_stride,
                                           const float* __restrict__ raw, int ldr, i64 raw_layer_stride, int C, int KW,
                                           const int* __restrict__ n_dev, int n_const) {
    pdl_entry();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C) return;
    const int n = n_dev ? *n_dev : n_const;
    conv_commit_body(window + blockIdx.y * window_layer_stride, raw + blockIdx.y * raw_layer_stride, ldr, C, KW, n, ch);
}

// decode_batch: slide lane b's window (its state's, + win_off bytes: this layer) by its one raw row b.
// grid (ceil(C/256), lanes), block 256.
extern "C" __global__ void gdn_conv_commit_lanes(const i64* __restrict__ lanes, i64 win_off,
                                                 const float* __restrict__ raw, int ldr, int C, int KW) {
    pdl_entry();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C) return;
    const int b = blockIdx.y;
    conv_commit_body(lane_ptr<float>(lanes, b, LT_WIN, win_off), raw + (i64)b * ldr, ldr, C, KW, 1, ch);
}

// commit_batch: slide group g's window (its state's, layer blockIdx.y: + that many win_layer_bytes) by its
// GT_KEEP[g] = n kept raw rows r0 .. r0 + n - 1 (layer blockIdx.y's records), as gdn_conv_commit slides one
// state's; n = 0 leaves the group's state untouched. grid (ceil(C/256), layers, groups), block 256.
extern "C" __global__ void gdn_conv_commit_groups(const i64* __restrict__ lanes, const int* __restrict__ groups,
                                                  i64 win_layer_bytes, const float* __restrict__ raw, int ldr,
                                                  i64 raw_layer_stride, int C, int KW) {
    pdl_entry();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C) return;
    const int g = blockIdx.z, n = group_field(groups, GT_KEEP, g);
    if (n == 0) return;
    const int r0 = group_field(groups, GT_FIRST, g);
    conv_commit_body(lane_ptr<float>(lanes, r0, LT_WIN, blockIdx.y * win_layer_bytes),
                     raw + blockIdx.y * raw_layer_stride + (i64)r0 * ldr, ldr, C, KW, n, ch);
}

// gdn_conv for prefill chunks: CONV_ROWS consecutive tokens of one head slot per block, KW a compile-time
// tap count. Why: gdn_conv is one block per (token, slot), 327,680 blocks of 128 threads for a
// 4,096-token chunk of the 27B, each loading its KW taps per channel again and paying two barriers
// for the l2 norm (device run g5: 39 ms of an 8K prefill, ~10x its bytes). Here a thread slides its
// channel's taps along the block's tokens in registers, so each raw value is loaded once; per token
// the same products summed in the same order (__fmul_rn / __fadd_rn), the same SiLU, and for q / k
// slots the same block-wide sum of squares as gdn_conv at this block size (each warp's warp_sum, then
// the warp_sum of the warp sums): the same bits. grid (ceil(T / CONV_ROWS), 2H + HV), block as gdn_conv.
template <int KW>
__device__ __forceinline__ void gdn_conv_rows_body(const float* __restrict__ raw, int ldr,
                                                   const float* __restrict__ window, const float* __restrict__ convw,
                                                   const float* __restrict__ ab, int ldab,
                                                   const float* __restrict__ neg_a, const float* __restrict__ dt_bias,
                                                   int H, int HV, int dk, int dv, float q_scale, int T,
                                                   float* __restrict__ qkvn, float* __restrict__ gb) {
    __shared__ float red[CONV_ROWS][32];
    const int slot = blockIdx.y, c = threadIdx.x;
    const int C = 2 * H * dk + HV * dv;
    const bool is_qk = slot < 2 * H;
    const int d = is_qk ? dk : dv;
    const int ch = is_qk ? slot * dk + c : 2 * H * dk + (slot - 2 * H) * dv + c;
    const bool live = c < d;
    const int t0 = blockIdx.x * CONV_ROWS;
    // Every tap of the block's tokens is loaded first, as predicated loads with no branch between them: the
    // CONV_ROWS + KW - 1 positions t0 .. of [window (KW - 1 rows) ; raw rows] for this channel (0 past the
    // chunk or the head). Why: written as a load per token beside its SiLU (whose division has a called
    // slow path), ptxas kept one load in flight per thread and the kernel ran at ~2.7x its bytes (H100
    // profile, 2026-12-05); here the 35 loads are independent and all issue before the first product.
    float xs[CONV_ROWS + KW - 1], wt[KW], y[CONV_ROWS];
#pragma unroll
    for (int j = 0; j < KW; j++) wt[j] = live ? convw[(i64)ch * KW + j] : 0.f;
#pragma unroll
    for (int i = 0; i < CONV_ROWS + KW - 1; i++) {
        const int p = t0 + i, r = p - (KW - 1);
        const float* src = p < KW - 1 ? window + (i64)p * C + ch : raw + (i64)r * ldr + ch;
        xs[i] = live && r < T ? __ldg(src) : 0.f;
    }
#pragma unroll
    for (int r = 0; r < CONV_ROWS; r++) {  // token t0 + r taps positions t0 + r .. t0 + r + KW - 1
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < KW; j++) acc = __fadd_rn(acc, __fmul_rn(wt[j], xs[r + j]));
        y[r] = live ? acc * sigmoid_f(acc) : 0.f;
    }
    if (is_qk) {  // block-uniform: the slot is the block's
        float sq[CONV_ROWS];
#pragma unroll
        for (int r = 0; r < CONV_ROWS; r++) sq[r] = y[r] * y[r];
        block_sums_post<CONV_ROWS>(sq, red);
#pragma unroll
        for (int r = 0; r < CONV_ROWS; r++) {
            y[r] = y[r] / sqrtf(block_total(red[r]) + 1e-6f);
            if (slot < H) y[r] *= q_scale;
        }
    }
    if (live) {
#pragma unroll
        for (int r = 0; r < CONV_ROWS; r++)
            if (t0 + r < T) qkvn[(i64)(t0 + r) * C + ch] = y[r];
    }
    if (!is_qk) {
        const int h = slot - 2 * H;
        for (int r = c; r < CONV_ROWS; r += blockDim.x) {
            const int t = t0 + r;
            if (t >= T) break;
            const float b = ab[(i64)t * ldab + h], a = ab[(i64)t * ldab + HV + h];
            gb[(i64)t * 2 * HV + h] = neg_a[h] * softplus_f(a + dt_bias[h]);
            gb[(i64)t * 2 * HV + HV + h] = sigmoid_f(b);
        }
    }
}

// the model family's conv kernel size (linear_conv_kernel_dim = 4); kernels.gdn_conv_rows falls back to
// gdn_conv for any other
extern "C" __global__ void gdn_conv_rows_k4(const float* __restrict__ raw, int ldr, const float* __restrict__ window,
                                            const float* __restrict__ convw, const float* __restrict__ ab, int ldab,
                                            const float* __restrict__ neg_a, const float* __restrict__ dt_bias, int H,
                                            int HV, int dk, int dv, float q_scale, int T, float* __restrict__ qkvn,
                                            float* __restrict__ gb) {
    pdl_entry();
    gdn_conv_rows_body<4>(raw, ldr, window, convw, ab, ldab, neg_a, dt_bias, H, HV, dk, dv, q_scale, T, qkvn, gb);
}
