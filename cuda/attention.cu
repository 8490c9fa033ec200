// Attention over the KV cache for decode / verify lanes (flash-decoding, split over
// positions), GQA-packed: one CTA per (kv head, position split, lane) computes all the q
// heads that share the kv head. Lane t attends to positions 0..pos0+t (causal per lane).
// The split size depends only on (pos0, span) -- span is the launch's lane capacity (16 for
// verify graphs), never the live width -- so lane t's bits do not depend on how many lanes
// run with it. Partials {m, l, acc[hd]} are merged in split order by attn_combine, which also
// applies the sigmoid output gate. The tensor-core kernel below (attn_mma_*) reads the KV once per
// round for all lanes (EngineConfig.attn_decode). The *_lanes entries are FastModel.decode_batch's:
// lanes of different sequences (common.cuh lane table), each run by the same body as its own
// one-token decode, so a lane's bits never depend on the others. The *_groups entries are
// FastModel.verify_batch's: each sequence's verify lanes (a group of consecutive lane rows, common.cuh
// group table) run as that sequence's solo verify round runs them -- pos0 and split size of the round,
// lane t = its offset in the group -- whatever the other groups are.
#include "common.cuh"


__device__ __forceinline__ int split_size(int pos0, int span) {
    const int need = (pos0 + span + NSPLIT - 1) / NSPLIT;
    return max(64, (need + 63) / 64 * 64);
}

template <int DPL>
__device__ __forceinline__ void load_row(const float* p, float (&v)[DPL]) {
    if (DPL == 1) v[0] = p[0];
#pragma unroll
    for (int i = 0; i + 1 < DPL; i += 2) {
        const float2 a = *reinterpret_cast<const float2*>(p + i);
        v[i] = a.x;
        v[i + 1] = a.y;
    }
}
template <int DPL>
__device__ __forceinline__ void load_row(const u16* p, float (&v)[DPL]) {
    if (DPL == 1) v[0] = bf16_to_float(p[0]);
#pragma unroll
    for (int i = 0; i + 1 < DPL; i += 2) {
        const u32 a = *reinterpret_cast<const u32*>(p + i);
        v[i] = bf16x2_lo(a);
        v[i + 1] = bf16x2_hi(a);
    }
}

// fp8 e4m3 rows (kvformat "fp8"): codes / 256; the caller applies the row scale 2^(e+8).
template <int DPL>
__device__ __forceinline__ void load_row(const u8* p, float (&v)[DPL]) {
    if constexpr (DPL == 1) v[0] = e4m3_to_float_div256(p[0]);
    if constexpr (DPL == 2) e4m3x2_to_float_div256(*reinterpret_cast<const u16*>(p), v[0], v[1]);
#pragma unroll
    for (int i = 0; i + 3 < DPL; i += 4) {  // 4 codes per 32-bit load (lane * DPL is a multiple of 4)
        const u32 w = *reinterpret_cast<const u32*>(p + i);
        e4m3x2_to_float_div256(w & 0xffffu, v[i], v[i + 1]);
        e4m3x2_to_float_div256(w >> 16, v[i + 2], v[i + 3]);
    }
}

// grid (nkv, NSPLIT, nlanes), block 256, dynamic smem ATT_WARPS * rep * (hd + 2) floats.
// kx / vx: the fp8 row exponents [nkv][max_pos] (u8 codes only; null otherwise). The K row scale
// multiplies the score, the V row scale the softmax weight of that row's value (not l).
// q: the lane's row; part: the lane's partials (nq x NSPLIT slots); t: the lane's offset from pos0
// (it sees positions 0..pos0+t), so the split size is the same for every lane of a round.
template <typename KVT, int DPL>
__device__ __forceinline__ void attn_split_body(const float* __restrict__ q, const KVT* __restrict__ kc,
                                                const KVT* __restrict__ vc, int max_pos, int nq, int nkv, float scale,
                                                int pos0, int t, int span, float* __restrict__ part,
                                                const signed char* __restrict__ kx = nullptr,
                                                const signed char* __restrict__ vx = nullptr) {
    constexpr bool FP8 = sizeof(KVT) == 1;
    extern __shared__ float sm[];
    constexpr int HD = 32 * DPL;
    const int g = blockIdx.x, sp = blockIdx.y;
    const int len = pos0 + t + 1;
    const int ssz = split_size(pos0, span);
    const int start = sp * ssz;
    if (start >= len) return;
    const int end = min(start + ssz, len);
    const int rep = nq / nkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    float qv[REPMAX][DPL], acc[REPMAX][DPL], m[REPMAX], l[REPMAX];
#pragma unroll
    for (int j = 0; j < REPMAX; j++) {
        m[j] = -INFINITY;
        l[j] = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            acc[j][i] = 0.f;
            qv[j][i] = j < rep ? q[(g * rep + j) * HD + lane * DPL + i] : 0.f;
        }
    }
    const KVT* kh = kc + (i64)g * max_pos * HD + lane * DPL;
    const KVT* vh = vc + (i64)g * max_pos * HD + lane * DPL;
    // K/V rows of the next position are loaded while this one is computed
    float kn[DPL], vn[DPL];
    if (start + warp < end) {
        load_row<DPL>(kh + (i64)(start + warp) * HD, kn);
        load_row<DPL>(vh + (i64)(start + warp) * HD, vn);
    }
    for (int p = start + warp; p < end; p += ATT_WARPS) {
        float kv[DPL], vv[DPL];
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            kv[i] = kn[i];
            vv[i] = vn[i];
        }
        if (p + ATT_WARPS < end) {
            load_row<DPL>(kh + (i64)(p + ATT_WARPS) * HD, kn);
            load_row<DPL>(vh + (i64)(p + ATT_WARPS) * HD, vn);
        }
        float ks = 1.f, vs = 1.f;
        if constexpr (FP8) {
            ks = exp2_int(kx[(i64)g * max_pos + p] + 8);
            vs = exp2_int(vx[(i64)g * max_pos + p] + 8);
        }
#pragma unroll
        for (int j = 0; j < REPMAX; j++) {
            if (j >= rep) break;
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < DPL; i++) dot = fmaf(qv[j][i], kv[i], dot);
            const float sc = FP8 ? warp_sum(dot) * ks * scale : warp_sum(dot) * scale;
            const float mn = fmaxf(m[j], sc);
            const float corr = expf(m[j] - mn);
            const float pj = expf(sc - mn);
            l[j] = l[j] * corr + pj;
            const float pv = FP8 ? pj * vs : pj;
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[j][i] = fmaf(pv, vv[i], acc[j][i] * corr);
            m[j] = mn;
        }
    }
    // merge the warps in fixed order
    float* wsm = sm + warp * rep * (HD + 2);
#pragma unroll
    for (int j = 0; j < REPMAX; j++) {
        if (j >= rep) break;
#pragma unroll
        for (int i = 0; i < DPL; i++) wsm[j * (HD + 2) + 2 + lane * DPL + i] = acc[j][i];
        if (lane == 0) {
            wsm[j * (HD + 2)] = m[j];
            wsm[j * (HD + 2) + 1] = l[j];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < rep * HD; idx += blockDim.x) {
        const int j = idx / HD, dd = idx - j * HD;
        float M = -INFINITY;
        for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, sm[(w * rep + j) * (HD + 2)]);
        float L = 0.f, A = 0.f;
        for (int w = 0; w < ATT_WARPS; w++) {
            const float* b = sm + (w * rep + j) * (HD + 2);
            const float e = expf(b[0] - M);  // exp(-inf) = 0 for warps that saw no position
            L = fmaf(b[1], e, L);
            A = fmaf(b[2 + dd], e, A);
        }
        float* dst = part + ((i64)(g * rep + j) * NSPLIT + sp) * (HD + 2);
        dst[2 + dd] = A;
        if (dd == 0) {
            dst[0] = M;
            dst[1] = L;
        }
    }
}

#define ATT_KERNEL(NAME, KVT, DPL)                                                                                       \
    extern "C" __global__ void __launch_bounds__(256) NAME(const float* q, int ldq, const KVT* kc, const KVT* vc,       \
                                                           int max_pos, int nq, int nkv, float scale,                   \
                                                           const int* pos0_dev, int span, float* part) {                \
        pdl_entry();                                                                                                    \
        const int t = blockIdx.z;                                                                                      \
        attn_split_body<KVT, DPL>(q + (i64)t * ldq, kc, vc, max_pos, nq, nkv, scale, *pos0_dev, t, span,              \
                                  part + (i64)t * nq * NSPLIT * (32 * DPL + 2));                                       \
    }

ATT_KERNEL(attn_split_f32_d1, float, 1)
ATT_KERNEL(attn_split_f32_d2, float, 2)
ATT_KERNEL(attn_split_f32_d4, float, 4)
ATT_KERNEL(attn_split_f32_d8, float, 8)
ATT_KERNEL(attn_split_bf16_d1, u16, 1)
ATT_KERNEL(attn_split_bf16_d2, u16, 2)
ATT_KERNEL(attn_split_bf16_d4, u16, 4)
ATT_KERNEL(attn_split_bf16_d8, u16, 8)

#define ATT_KERNEL_FP8(NAME, DPL)                                                                                       \
    extern "C" __global__ void __launch_bounds__(256) NAME(const float* q, int ldq, const u8* kc, const u8* vc,         \
                                                           int max_pos, int nq, int nkv, float scale,                   \
                                                           const int* pos0_dev, int span, float* part,                  \
                                                           const signed char* kx, const signed char* vx) {              \
        pdl_entry();                                                                                                    \
        const int t = blockIdx.z;                                                                                      \
        attn_split_body<u8, DPL>(q + (i64)t * ldq, kc, vc, max_pos, nq, nkv, scale, *pos0_dev, t, span,               \
                                 part + (i64)t * nq * NSPLIT * (32 * DPL + 2), kx, vx);                                \
    }

ATT_KERNEL_FP8(attn_split_fp8_d1, 1)
ATT_KERNEL_FP8(attn_split_fp8_d2, 2)
ATT_KERNEL_FP8(attn_split_fp8_d4, 4)
ATT_KERNEL_FP8(attn_split_fp8_d8, 8)

// decode_batch (common.cuh lane table): grid (nkv, NSPLIT, lanes), lane b = the next token of its own
// sequence: its position as pos0 (t = 0, the split size a one-token decode of that sequence uses),
// its state's K / V (+ kv_off bytes: this layer; fp8 exponents + x_off), its q row and partials.
#define ATT_LANES_KERNEL(NAME, KVT, DPL)                                                                               \
    extern "C" __global__ void __launch_bounds__(256) NAME(const float* q, int ldq, const i64* lanes, i64 kv_off,    \
                                                           i64 x_off, int max_pos, int nq, int nkv, float scale,       \
                                                           int span, float* part) {                                     \
        pdl_entry();                                                                                                   \
        const int b = blockIdx.z;                                                                                      \
        constexpr bool FP8 = sizeof(KVT) == 1;                                                                         \
        attn_split_body<KVT, DPL>(q + (i64)b * ldq, lane_ptr<const KVT>(lanes, b, LT_K, kv_off),                      \
                                  lane_ptr<const KVT>(lanes, b, LT_V, kv_off), max_pos, nq, nkv, scale,               \
                                  lane_positions(lanes)[b], 0, span, part + (i64)b * nq * NSPLIT * (32 * DPL + 2),    \
                                  FP8 ? lane_ptr<const signed char>(lanes, b, LT_KX, x_off) : nullptr,                \
                                  FP8 ? lane_ptr<const signed char>(lanes, b, LT_VX, x_off) : nullptr);               \
    }

ATT_LANES_KERNEL(attn_split_lanes_f32_d1, float, 1)
ATT_LANES_KERNEL(attn_split_lanes_f32_d2, float, 2)
ATT_LANES_KERNEL(attn_split_lanes_f32_d4, float, 4)
ATT_LANES_KERNEL(attn_split_lanes_f32_d8, float, 8)
ATT_LANES_KERNEL(attn_split_lanes_bf16_d1, u16, 1)
ATT_LANES_KERNEL(attn_split_lanes_bf16_d2, u16, 2)
ATT_LANES_KERNEL(attn_split_lanes_bf16_d4, u16, 4)
ATT_LANES_KERNEL(attn_split_lanes_bf16_d8, u16, 8)
ATT_LANES_KERNEL(attn_split_lanes_fp8_d1, u8, 1)
ATT_LANES_KERNEL(attn_split_lanes_fp8_d2, u8, 2)
ATT_LANES_KERNEL(attn_split_lanes_fp8_d4, u8, 4)
ATT_LANES_KERNEL(attn_split_lanes_fp8_d8, u8, 8)

// verify_batch (common.cuh group table): grid (nkv, NSPLIT, lanes), lane b = lane t = b - r0 of its group's
// verify (r0: the group's first row, at the round's pos0 = that row's position): the split size of that
// sequence's solo verify round (from its pos0, not the lane's own position, which can cross a split-size
// step), its state's K / V (+ kv_off bytes: this layer; fp8 exponents + x_off), its q row and partials.
// The lane stores of every lane ran before (the store launch), so lane t sees its group's rows pos0 .. pos0 + t.
#define ATT_GROUPS_KERNEL(NAME, KVT, DPL)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) NAME(const float* q, int ldq, const i64* lanes,                \
                                                           const int* groups, i64 kv_off, i64 x_off, int max_pos,      \
                                                           int nq, int nkv, float scale, int span, float* part) {      \
        pdl_entry();                                                                                                   \
        const int b = blockIdx.z, r0 = group_first_of_lane(groups, b);                                                 \
        constexpr bool FP8 = sizeof(KVT) == 1;                                                                         \
        attn_split_body<KVT, DPL>(q + (i64)b * ldq, lane_ptr<const KVT>(lanes, b, LT_K, kv_off),                      \
                                  lane_ptr<const KVT>(lanes, b, LT_V, kv_off), max_pos, nq, nkv, scale,               \
                                  lane_positions(lanes)[r0], b - r0, span,                                            \
                                  part + (i64)b * nq * NSPLIT * (32 * DPL + 2),                                       \
                                  FP8 ? lane_ptr<const signed char>(lanes, b, LT_KX, x_off) : nullptr,                \
                                  FP8 ? lane_ptr<const signed char>(lanes, b, LT_VX, x_off) : nullptr);               \
    }

ATT_GROUPS_KERNEL(attn_split_groups_f32_d1, float, 1)
ATT_GROUPS_KERNEL(attn_split_groups_f32_d2, float, 2)
ATT_GROUPS_KERNEL(attn_split_groups_f32_d4, float, 4)
ATT_GROUPS_KERNEL(attn_split_groups_f32_d8, float, 8)
ATT_GROUPS_KERNEL(attn_split_groups_bf16_d1, u16, 1)
ATT_GROUPS_KERNEL(attn_split_groups_bf16_d2, u16, 2)
ATT_GROUPS_KERNEL(attn_split_groups_bf16_d4, u16, 4)
ATT_GROUPS_KERNEL(attn_split_groups_bf16_d8, u16, 8)
ATT_GROUPS_KERNEL(attn_split_groups_fp8_d1, u8, 1)
ATT_GROUPS_KERNEL(attn_split_groups_fp8_d2, u8, 2)
ATT_GROUPS_KERNEL(attn_split_groups_fp8_d4, u8, 4)
ATT_GROUPS_KERNEL(attn_split_groups_fp8_d8, u8, 8)

// Merge of the split partials {m, l, acc[hd]} of (lane t, q head h) in split order, then the sigmoid
// output gate: out[t][h*hd + d] = (sum_s acc e^(m_s-M)) / (sum_s l e^(m_s-M)) * sigmoid(gate).
// ssz: the launch's split size; stride: splits per (lane, head) in the partials buffer.
// row: the lane's row of part / qg / out; t: its offset from pos0 (row for one sequence, 0 for decode_batch).
// xq (may be null): also the out projection's a8 activations of the row (kernels.attention_a8_fuses: hd % 64 == 0,
// so the head owns whole 64-k chunks), the bytes quant_act8 makes from out's row -- one launch fewer before
// each attention out projection of a decode / verify step (the block's values staged in shared memory, then a
// warp a chunk, as gated_rmsnorm_a8 does).
__device__ __forceinline__ void combine_body(const float* __restrict__ part, int nq, int hd, int pos0, int t, int row,
                                             int ssz, int stride, const float* __restrict__ qg, int ldq,
                                             float* __restrict__ out, int ldo, u8* __restrict__ xq, int ldxq,
                                             float* __restrict__ xs) {
    const int h = blockIdx.y, d = threadIdx.x;
    const int len = pos0 + t + 1;
    const int ns = (len + ssz - 1) / ssz;
    const float* base = part + (i64)(row * nq + h) * stride * (hd + 2);
    const float gate = qg[(i64)row * ldq + h * 2 * hd + hd + d];
    const float r = split_merge(base, ns, hd, d) * sigmoid_f(gate);
    out[(i64)row * ldo + h * hd + d] = r;
    if (xq == nullptr) return;
    __shared__ __align__(16) float ys[ATT_A8_MAX_HD];
    ys[d] = r;
    __syncthreads();
    const int warp = d >> 5, lane = d & 31;
    if (warp < hd / 64)
        act8_quantize_pair(*reinterpret_cast<const float2*>(ys + warp * 64 + 2 * lane), (h * hd) / 64 + warp,
                           xq + (i64)row * ldxq, xs + row, lane);
}

// split_merge (common.cuh) as it was written before 2026-12-07 (thirteenth session): one split at a time, its loads in the
// loop. Kept only as the bitwise reference tests/gpu/test_attention_mma.py holds the staged form to; grid (nlanes, nq),
// block hd, attn_mma_combine's partials, no gate (out = A / L).
extern "C" __global__ void attn_combine_seq_ref(const float* __restrict__ part, int nq, int hd, int pos0, int ssz,
                                                int stride, float* __restrict__ out) {
    pdl_entry();
    const int h = blockIdx.y, d = threadIdx.x, row = blockIdx.x;
    const int ns = (pos0 + row + 1 + ssz - 1) / ssz;
    const float* base = part + (i64)(row * nq + h) * stride * (hd + 2);
    float M = -INFINITY;
    for (int s = 0; s < ns; s++) M = fmaxf(M, base[(i64)s * (hd + 2)]);
    float L = 0.f, A = 0.f;
    for (int s = 0; s < ns; s++) {
        const float* b = base + (i64)s * (hd + 2);
        const float e = expf(b[0] - M);
        L = fmaf(b[1], e, L);
        A = fmaf(b[2 + d], e, A);
    }
    out[(i64)row * nq * hd + h * hd + d] = A / L;
}

// grid (nlanes, nq), block hd: the split kernel's partials (NSPLIT per lane and head).
extern "C" __global__ void attn_combine(const float* __restrict__ part, int nq, int hd, const int* __restrict__ pos0_dev,
                                        int span, const float* __restrict__ qg, int ldq, float* __restrict__ out, int ldo, u8* __restrict__ xq, int ldxq,
    float* __restrict__ xs) {
    pdl_entry();
    const int pos0 = *pos0_dev;
    combine_body(part, nq, hd, pos0, blockIdx.x, blockIdx.x, split_size(pos0, span), NSPLIT, qg, ldq, out, ldo, xq, ldxq, xs);
}

// decode_batch: grid (lanes, nq), lane b at its own position (attn_split_lanes_*' partials).
extern "C" __global__ void attn_combine_lanes(const float* __restrict__ part, int nq, int hd,
                                              const i64* __restrict__ lanes, int span, const float* __restrict__ qg,
                                              int ldq, float* __restrict__ out, int ldo, u8* __restrict__ xq, int ldxq,
    float* __restrict__ xs) {
    pdl_entry();
    const int pos0 = lane_positions(lanes)[blockIdx.x];
    combine_body(part, nq, hd, pos0, 0, blockIdx.x, split_size(pos0, span), NSPLIT, qg, ldq, out, ldo, xq, ldxq, xs);
}

// verify_batch: grid (lanes, nq), lane b = lane b - r0 of its group's round at pos0 = row r0's position
// (attn_split_groups_*' partials).
extern "C" __global__ void attn_combine_groups(const float* __restrict__ part, int nq, int hd,
                                               const i64* __restrict__ lanes, const int* __restrict__ groups, int span,
                                               const float* __restrict__ qg, int ldq, float* __restrict__ out, int ldo, u8* __restrict__ xq, int ldxq,
    float* __restrict__ xs) {
    pdl_entry();
    const int b = blockIdx.x, r0 = group_first_of_lane(groups, b);
    const int pos0 = lane_positions(lanes)[r0];
    combine_body(part, nq, hd, pos0, b - r0, b, split_size(pos0, span), NSPLIT, qg, ldq, out, ldo, xq, ldxq, xs);
}

// ================================================================ tensor-core decode / verify (attn_mma_*)
//
// The split kernel above gives every lane its own CTAs, so a W-lane verify round reads the KV W
// times, and each warp walks positions one at a time with scalar dot products. Here one CTA per
// (kv head, split) takes every (lane, q head) row of that kv head at once -- rows flattened
// lane-major, row = lane * rep + j, 8 per warp -- so the KV is read once per round whatever W is.
//
// Per 16-position step a warp computes S^T = K Q^T (mma.m16n8k16: A = 16 positions x 16 dims of K
// from shared memory by ldmatrix, B = its 8 rows of Q held in registers, as bf16 hi + lo when
// QS so the scores keep fp32-grade accuracy), masks each row to its lane's causal limit
// (lane t sees 0..pos0+t), runs the online softmax in fp32 per row, and adds O^T += V^T P^T
// (A = V^T by ldmatrix.trans, B = P^T: the S^T accumulators rounded to bf16 and transposed in
// registers by movmatrix). Positions as the mma's M side and rows as its N = 8 side keep the
// padding small (W = 1 has 6 rows: one n-tile) and Q out of shared memory.
// With QS the softmax weights P enter as bf16 hi + lo too (two mma per product on both sides, like
// the prefill kernel): fp32-grade results. Without (the "_bq" variants) Q and P are rounded to bf16
// once and l sums the rounded weights: ~1e-3 relative, half the tensor work.
//
// K / V tiles of ATTD_KT positions stream through an ATTD_STAGES-deep cp.async ring (rows XOR-
// swizzled in 16-byte chunks so ldmatrix is conflict-free). Bytes in flight per CTA at head dim
// 256: (ATTD_STAGES - 1) x 32 KB bf16 (16 KB fp8); 2 CTAs per SM at W <= 8, 1 at W = 16 (registers).
// fp8 KV (e4m3 codes + int8 row exponents) is staged as codes, converted once per tile to bf16
// (code / 256: exact) in a shared tile all warps read, and the row scales 2^(e+8) multiply the
// score (K) and the softmax weight of the V row (not l), as in the split kernel.
//
// Determinism: the split size depends only on (pos0, span, nsplit) -- nsplit comes from the model
// shape and the SM count, never the live width -- tiles start at fixed offsets in a split, every
// row's max, sum and accumulators are its own (mma columns are independent; no per-CTA reduction
// crosses rows), and positions past a row's limit weigh exactly 0, so the extra tiles a wider
// launch walks leave a row's bits unchanged: lane t's output is the same at any width.
// Positions past the launch's last lane are zero-filled, never read from memory.

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr bool ATTD_SM90_BUILD = false;
#else
constexpr bool ATTD_SM90_BUILD = true;
#endif

__device__ __forceinline__ int attd_split_size(int pos0, int span, int nsplit) {
    const int need = (pos0 + span + nsplit - 1) / nsplit;
    return max(ATTD_MIN_SPLIT, (need + ATTD_KT - 1) / ATTD_KT * ATTD_KT);
}

__device__ __forceinline__ void ldsm_x4(u32 a, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a)
                 : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(u32 a, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a)
                 : "memory");
}
// transpose of an 8x8 b16 matrix held as mma fragments (thread (g, t) holds row g, cols 2t, 2t+1)
__device__ __forceinline__ u32 movm_t(u32 x) {
    u32 y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

// Byte offset of 16-byte chunk c in a swizzled row addressed by `lane` (row & SWZ == lane & SWZ):
// (c / G) * G + ((c % G) ^ (lane & SWZ)) chunks, G = SWZ + 1. With c = 2k + (a lane bit) and k an
// unrolled constant, the compiler keeps G / 2 per-thread values and folds the rest into immediates.
template <int SWZ>
__device__ __forceinline__ u32 swz_off(int c, int lane) {
    return 16u * (u32)((c & ~SWZ) | ((c & SWZ) ^ (lane & SWZ)));
}

// grid (nkv, nsplit), block 32 x max(ATTD_MIN_WARPS, ceil(nlanes * rep / ATTD_ROWS)) (<= ATTD_MAX_WARPS),
// dynamic smem kernels.attention_mma_shared_bytes. q [nlanes][ldq] fp32; kc / vc [nkv][max_pos][HD]
// bf16 bits or e4m3 codes (kx / vx: row exponents [nkv][max_pos]); part as the split kernel's, with
// nsplit splits per (lane, q head).
template <int HD, bool FP8, bool QS>
__device__ __forceinline__ void attn_mma_body(const float* __restrict__ q, int ldq, const unsigned char* __restrict__ kc,
                                              const unsigned char* __restrict__ vc, int max_pos, int nq, int nkv,
                                              float scale, const int* __restrict__ pos0_dev, int span, int nsplit,
                                              int nlanes, float* __restrict__ part, const signed char* __restrict__ kx,
                                              const signed char* __restrict__ vx) {
    constexpr int KT = ATTD_KT;
    constexpr int CH = HD / 8;                 // 16-byte chunks of a bf16 row
    constexpr int SWZ = (CH < 8 ? CH : 8) - 1;  // chunk c of row r sits at chunk c ^ (r & SWZ)
    constexpr int TILE = KT * HD;              // elements of one K (or V) tile
    constexpr int KS = HD / 16;                // k-steps of S^T, and 16-dim m-tiles of O^T
    constexpr int EB = FP8 ? 1 : 2;            // bytes per staged element
    constexpr int CHS = HD * EB / 16;          // 16-byte chunks per staged row
    constexpr int STAGE_BYTES = 2 * TILE * EB;
    extern __shared__ __align__(16) unsigned char attd_sm[];

    const int g = blockIdx.x, sp = blockIdx.y;
    const int pos0 = *pos0_dev;
    const int ssz = attd_split_size(pos0, span, nsplit);
    const int start = sp * ssz;
    const int len = pos0 + nlanes;  // positions the launch's last lane sees
    if (start >= len) return;
    const int end = min(start + ssz, len);
    const int ntiles = (end - start + KT - 1) / KT;
    const int rep = nq / nkv, rows = nlanes * rep;
    const int tid = threadIdx.x, nthr = blockDim.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
    const unsigned char* kb = kc + (i64)g * max_pos * HD * EB;
    const unsigned char* vb = vc + (i64)g * max_pos * HD * EB;
    u16* cvt = reinterpret_cast<u16*>(attd_sm + ATTD_STAGES * STAGE_BYTES);  // fp8: the bf16 K, V tiles
    signed char* exs = reinterpret_cast<signed char*>(cvt + 2 * TILE);       // fp8: K, V exponents [ssz]

    // stage `tile` of the split into its ring slot (one commit group per call, empty past the end)
    auto issue = [&](int tile) {
        if (tile < ntiles) {
            unsigned char* st = attd_sm + (tile % ATTD_STAGES) * STAGE_BYTES;
            const int p0 = start + tile * KT;
            for (int u = tid; u < 2 * KT * CHS; u += nthr) {
                const int which = u / (KT * CHS), rem = u - which * (KT * CHS);
                const int r = rem / CHS, c = rem - r * CHS;
                const int p = p0 + r;
                const bool ok = p < end;
                const unsigned char* src = (which ? vb : kb) + (i64)(ok ? p : start) * (HD * EB) + c * 16;
                const int cs = FP8 ? c : (c ^ (r & SWZ));  // fp8 codes are re-laid out by the conversion
                // zero-filled past end (src-size 0: nothing is read)
                cp_async_cg16_zfill_mem(smem_addr(st + which * TILE * EB + r * (HD * EB) + cs * 16), src, ok ? 16 : 0);
            }
        }
        cp_async_commit_mem();
    };
#pragma unroll 1
    for (int s = 0; s < ATTD_STAGES - 1; s++) issue(s);
    if constexpr (FP8) {  // the split's row exponents, once (their latency overlaps the first copies)
        for (int i = tid; i < ssz; i += nthr) {
            const int p = start + i;
            exs[i] = p < end ? kx[(i64)g * max_pos + p] : (signed char)0;
            exs[ssz + i] = p < end ? vx[(i64)g * max_pos + p] : (signed char)0;
        }
    }

    // this thread's B fragments of Q (row warp*8 + gq; zeros past the rows) and the limits of its
    // two accumulator columns (rows warp*8 + 2tq + i; -1 past the rows: nothing visible)
    const bool active = warp * ATTD_ROWS < rows;
    u32 qh[KS][2], ql[KS][2];
    int lim[2];
    {
        const int r = warp * ATTD_ROWS + gq;
        const bool ok = r < rows;
        const int ln = ok ? r / rep : 0;
        const float* qr = q + (i64)ln * ldq + (g * rep + (ok ? r - ln * rep : 0)) * HD + 2 * tq;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const float2 v = ok ? *reinterpret_cast<const float2*>(qr + ks * 16 + h * 8) : make_float2(0.f, 0.f);
                if constexpr (FP8) {  // f16 Q against the f16 K codes (exact values; 11-bit halves)
                    qh[ks][h] = pack_f16x2(v.x, v.y);
                    ql[ks][h] = QS ? pack_f16x2(v.x - f16x2_lo(qh[ks][h]), v.y - f16x2_hi(qh[ks][h])) : 0u;
                } else {
                    qh[ks][h] = pack_bf16x2(v.x, v.y);
                    ql[ks][h] = QS ? pack_bf16x2(v.x - bf16x2_lo(qh[ks][h]), v.y - bf16x2_hi(qh[ks][h])) : 0u;
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int rr = warp * ATTD_ROWS + 2 * tq + i;
            lim[i] = rr < rows ? pos0 + rr / rep : -1;
        }
    }

    float o[KS][4];
#pragma unroll
    for (int d = 0; d < KS; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // l: this thread's positions only

#pragma unroll 1
    for (int tile = 0; tile < ntiles; tile++) {
        cp_async_wait_mem<ATTD_STAGES - 2>();
        __syncthreads();  // tile's copies landed for every thread; every warp is done with tile - 1
        issue(tile + ATTD_STAGES - 1);
        const unsigned char* st = attd_sm + (tile % ATTD_STAGES) * STAGE_BYTES;
        const u16* kt = reinterpret_cast<const u16*>(st);
        if constexpr (FP8) {
            // codes -> exact values, swizzled like a bf16 stage: K as f16 (one cvt per two codes; the
            // S^T mma takes f16), V as bf16 (P carries the row scales 2^e, whose range f16 lacks)
            for (int rem = tid; rem < KT * CHS; rem += nthr) {  // K: codes -> f16
                const int r = rem / CHS, c = rem - r * CHS;
                const uint4 w = *reinterpret_cast<const uint4*>(st + r * HD + c * 16);
                u16* dst = cvt + r * HD;
                *reinterpret_cast<uint4*>(dst + (((2 * c) ^ (r & SWZ)) << 3)) =
                    make_uint4(e4m3x2_to_f16x2(w.x & 0xffffu), e4m3x2_to_f16x2(w.x >> 16),
                               e4m3x2_to_f16x2(w.y & 0xffffu), e4m3x2_to_f16x2(w.y >> 16));
                *reinterpret_cast<uint4*>(dst + (((2 * c + 1) ^ (r & SWZ)) << 3)) =
                    make_uint4(e4m3x2_to_f16x2(w.z & 0xffffu), e4m3x2_to_f16x2(w.z >> 16),
                               e4m3x2_to_f16x2(w.w & 0xffffu), e4m3x2_to_f16x2(w.w >> 16));
            }
            for (int rem = tid; rem < KT * CHS; rem += nthr) {  // V: codes -> bf16 (exact values)
                const int r = rem / CHS, c = rem - r * CHS;
                const uint4 w = *reinterpret_cast<const uint4*>(st + TILE + r * HD + c * 16);
                const u32 wv[4] = {w.x, w.y, w.z, w.w};
                u32 b[8];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float f0, f1, f2, f3;
                    e4m3x2_to_float_div256(wv[i] & 0xffffu, f0, f1);
                    e4m3x2_to_float_div256(wv[i] >> 16, f2, f3);
                    b[2 * i] = pack_bf16x2(f0 * 256.f, f1 * 256.f);  // exact: a power of two
                    b[2 * i + 1] = pack_bf16x2(f2 * 256.f, f3 * 256.f);
                }
                u16* dst = cvt + TILE + r * HD;
                *reinterpret_cast<uint4*>(dst + (((2 * c) ^ (r & SWZ)) << 3)) = make_uint4(b[0], b[1], b[2], b[3]);
                *reinterpret_cast<uint4*>(dst + (((2 * c + 1) ^ (r & SWZ)) << 3)) = make_uint4(b[4], b[5], b[6], b[7]);
            }
            __syncthreads();
            kt = cvt;
        }
        // ldmatrix addresses: row r's chunk c sits at chunk c ^ (r & SWZ), and r & SWZ = lane & SWZ for
        // every row this lane addresses, so a k-step's offset is a per-thread pattern over G / 2 steps
        // plus an immediate (keeps the address math out of the register budget)
        const u32 k_row = smem_addr(kt) + 2 * HD * (lane & 15);
        const u32 v_row = smem_addr(kt + TILE) + 2 * HD * ((lane & 7) + ((lane >> 4) << 3));
        if (active) {
            const int p0 = start + tile * KT;
#pragma unroll 1  // unrolled, the two steps' live ranges overlap past the 168-register bound
            for (int mi = 0; mi < KT / 16; mi++) {
                // S^T (16 positions x 8 rows): hi and lo chains apart (twice the mma in flight)
                float sh[4] = {0.f, 0.f, 0.f, 0.f}, sl[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int ks = 0; ks < KS; ks++) {
                    u32 a0, a1, a2, a3;
                    ldsm_x4(k_row + mi * 32 * HD + swz_off<SWZ>(2 * ks + (lane >> 4), lane), a0, a1, a2, a3);
                    if constexpr (FP8) {
                        mma_f16_16816(sh[0], sh[1], sh[2], sh[3], a0, a1, a2, a3, qh[ks][0], qh[ks][1]);
                        if (QS) mma_f16_16816(sl[0], sl[1], sl[2], sl[3], a0, a1, a2, a3, ql[ks][0], ql[ks][1]);
                    } else {
                        mma_bf16_16816(sh[0], sh[1], sh[2], sh[3], a0, a1, a2, a3, qh[ks][0], qh[ks][1]);
                        if (QS) mma_bf16_16816(sl[0], sl[1], sl[2], sl[3], a0, a1, a2, a3, ql[ks][0], ql[ks][1]);
                    }
                }
                // c0, c1: position gq, rows 2tq, 2tq+1; c2, c3: position gq + 8
                const int pa = p0 + mi * 16 + gq, pb = pa + 8;
                float kscale[2] = {scale, scale}, vscale[2] = {1.f, 1.f};
                if constexpr (FP8) {
                    kscale[0] = scale * exp2_int((int)exs[pa - start]);  // the tiles hold code values
                    kscale[1] = scale * exp2_int((int)exs[pb - start]);
                    vscale[0] = exp2_int((int)exs[ssz + pa - start]);
                    vscale[1] = exp2_int((int)exs[ssz + pb - start]);
                }
                float x[4], mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    const int p = c < 2 ? pa : pb;
                    x[c] = p <= lim[c & 1] ? (sh[c] + sl[c]) * kscale[c >> 1] : -INFINITY;
                    mx[c & 1] = fmaxf(mx[c & 1], x[c]);
                }
                float corr[2], mu[2];
#pragma unroll
                for (int i = 0; i < 2; i++) {  // a row's 16 positions sit on the 8 threads of one tq
                    mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 4));
                    mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 8));
                    mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 16));
                    const float mn = fmaxf(m[i], mx[i]);
                    mu[i] = mn == -INFINITY ? 0.f : mn;  // nothing visible yet: weights 0, no NaN
                    corr[i] = expf(m[i] - mu[i]);        // exp(-inf) = 0 on the first visible step
                    m[i] = mn;
                    l[i] *= corr[i];
                }
                // P: bf16 hi + lo (QS), or bf16 once with l summing the rounded weights (so O / l stays a
                // convex combination of V rows, weights within 2^-9 relative of the fp32 softmax)
                u32 pk[2], pl[2];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    float e0 = expf(x[2 * h] - mu[0]), e1 = expf(x[2 * h + 1] - mu[1]);
                    if (!QS) {
                        const u32 w = pack_bf16x2(e0, e1);
                        e0 = bf16x2_lo(w);
                        e1 = bf16x2_hi(w);
                    }
                    l[0] += e0;
                    l[1] += e1;
                    const float f0 = FP8 ? e0 * vscale[h] : e0, f1 = FP8 ? e1 * vscale[h] : e1;
                    pk[h] = pack_bf16x2(f0, f1);  // exact when !QS (a power-of-two multiple of a bf16)
                    pl[h] = QS ? pack_bf16x2(f0 - bf16x2_lo(pk[h]), f1 - bf16x2_hi(pk[h])) : 0u;
                }
                const u32 b0 = movm_t(pk[0]), b1 = movm_t(pk[1]);  // P^T B fragment: positions 2tq.. of row gq
                const u32 c0 = QS ? movm_t(pl[0]) : 0u, c1 = QS ? movm_t(pl[1]) : 0u;
#pragma unroll
                for (int dt = 0; dt < KS; dt++) {
                    o[dt][0] *= corr[0];
                    o[dt][1] *= corr[1];
                    o[dt][2] *= corr[0];
                    o[dt][3] *= corr[1];
                    u32 a0, a1, a2, a3;
                    ldsm_x4_t(v_row + mi * 32 * HD + swz_off<SWZ>(2 * dt + ((lane >> 3) & 1), lane), a0, a1, a2, a3);
                    if (QS) mma_bf16_16816(o[dt][0], o[dt][1], o[dt][2], o[dt][3], a0, a1, a2, a3, c0, c1);
                    mma_bf16_16816(o[dt][0], o[dt][1], o[dt][2], o[dt][3], a0, a1, a2, a3, b0, b1);
                }
            }
        }
    }
    cp_async_wait_mem<0>();  // the trailing groups are empty; nothing is in flight when the CTA exits

    if (!active) return;
#pragma unroll
    for (int i = 0; i < 2; i++) {  // the row's sum over its 8 position threads (same bits in each)
        l[i] += __shfl_xor_sync(FULL_MASK, l[i], 4);
        l[i] += __shfl_xor_sync(FULL_MASK, l[i], 8);
        l[i] += __shfl_xor_sync(FULL_MASK, l[i], 16);
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int r = warp * ATTD_ROWS + 2 * tq + i;
        if (r >= rows) continue;
        const int ln = r / rep, h = g * rep + (r - ln * rep);
        float* dst = part + ((i64)(ln * nq + h) * nsplit + sp) * (HD + 2);
        if (gq == 0) {
            dst[0] = m[i];
            dst[1] = l[i];
        }
#pragma unroll
        for (int dt = 0; dt < KS; dt++) {
            dst[2 + dt * 16 + gq] = o[dt][i];
            dst[2 + dt * 16 + gq + 8] = o[dt][2 + i];
        }
    }
}

#define ATTD_KERNEL(NAME, HD, FP8, QS)                                                                             \
    extern "C" __global__ void __launch_bounds__(32 * ATTD_MAX_WARPS)                                          \
        NAME(const float* q, int ldq, const unsigned char* kc, const unsigned char* vc, int max_pos, int nq,   \
             int nkv, float scale, const int* pos0_dev, int span, int nsplit, int nlanes, float* part,          \
             const signed char* kx, const signed char* vx) {                                                    \
        pdl_entry();                                                                                            \
        attn_mma_body<HD, FP8, QS>(q, ldq, kc, vc, max_pos, nq, nkv, scale, pos0_dev, span, nsplit, nlanes, part,   \
                               kx, vx);                                                                         \
    }

// QS: Q and P as bf16 hi + lo (fp32-grade); the "_bq" variants round Q and P to bf16 once (one mma
// per product: what sm_80-89 run at head dim 256, where hi + lo does not fit 168 registers, and
// every card with ATTD_QSPLIT = 0)
ATTD_KERNEL(attn_mma_bf16_d32, 32, false, true)
ATTD_KERNEL(attn_mma_bf16_d64, 64, false, true)
ATTD_KERNEL(attn_mma_bf16_d128, 128, false, true)
ATTD_KERNEL(attn_mma_fp8_d32, 32, true, true)
ATTD_KERNEL(attn_mma_fp8_d64, 64, true, true)
ATTD_KERNEL(attn_mma_fp8_d128, 128, true, true)
ATTD_KERNEL(attn_mma_bf16_d32_bq, 32, false, false)
ATTD_KERNEL(attn_mma_bf16_d64_bq, 64, false, false)
ATTD_KERNEL(attn_mma_bf16_d128_bq, 128, false, false)
ATTD_KERNEL(attn_mma_bf16_d256_bq, 256, false, false)
ATTD_KERNEL(attn_mma_fp8_d32_bq, 32, true, false)
ATTD_KERNEL(attn_mma_fp8_d64_bq, 64, true, false)
ATTD_KERNEL(attn_mma_fp8_d128_bq, 128, true, false)
ATTD_KERNEL(attn_mma_fp8_d256_bq, 256, true, false)

// hi + lo at head dim 256 needs ~186 registers: sm_90+ only (kernels.attention_mma picks _bq below)
#define ATTD_KERNEL_SM90(NAME, HD, FP8)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * ATTD_MAX_WARPS)                                          \
        NAME(const float* q, int ldq, const unsigned char* kc, const unsigned char* vc, int max_pos, int nq,   \
             int nkv, float scale, const int* pos0_dev, int span, int nsplit, int nlanes, float* part,          \
             const signed char* kx, const signed char* vx) {                                                    \
        pdl_entry();                                                                                            \
        if constexpr (ATTD_SM90_BUILD)                                                                          \
            attn_mma_body<HD, FP8, true>(q, ldq, kc, vc, max_pos, nq, nkv, scale, pos0_dev, span, nsplit,       \
                                         nlanes, part, kx, vx);                                                 \
        else                                                                                                    \
            __trap();                                                                                           \
    }
ATTD_KERNEL_SM90(attn_mma_bf16_d256, 256, false)
ATTD_KERNEL_SM90(attn_mma_fp8_d256, 256, true)

// decode_batch (common.cuh lane table): grid (nkv, nsplit, lanes), each lane b its own sequence's
// one-token decode -- the body exactly as a one-lane launch of that sequence runs it (nlanes 1, pos0
// its position, the same block size), on its state's K / V (+ kv_off bytes: this layer; fp8
// exponents + x_off), its q row and its partials (nq x nsplit slots per lane, as attn_mma_combine
// reads them). BUILD: false where the variant traps (the d256 hi + lo pair below sm_90).
#define ATTD_LANES_KERNEL(NAME, HD, FP8, QS, BUILD)                                                              \
    extern "C" __global__ void __launch_bounds__(32 * ATTD_MAX_WARPS)                                          \
        NAME(const float* q, int ldq, const i64* lanes, i64 kv_off, i64 x_off, int max_pos, int nq, int nkv,    \
             float scale, int span, int nsplit, float* part) {                                                  \
        pdl_entry();                                                                                            \
        const int b = blockIdx.z;                                                                               \
        if constexpr (BUILD)                                                                                    \
            attn_mma_body<HD, FP8, QS>(q + (i64)b * ldq, ldq, lane_ptr<const unsigned char>(lanes, b, LT_K, kv_off), \
                                       lane_ptr<const unsigned char>(lanes, b, LT_V, kv_off), max_pos, nq, nkv,  \
                                       scale, lane_positions(lanes) + b, span, nsplit, 1,                        \
                                       part + (i64)b * nq * nsplit * (HD + 2),                                   \
                                       FP8 ? lane_ptr<const signed char>(lanes, b, LT_KX, x_off) : nullptr,     \
                                       FP8 ? lane_ptr<const signed char>(lanes, b, LT_VX, x_off) : nullptr);    \
        else                                                                                                    \
            __trap();                                                                                           \
    }
ATTD_LANES_KERNEL(attn_mma_lanes_bf16_d32, 32, false, true, true)
ATTD_LANES_KERNEL(attn_mma_lanes_bf16_d64, 64, false, true, true)
ATTD_LANES_KERNEL(attn_mma_lanes_bf16_d128, 128, false, true, true)
ATTD_LANES_KERNEL(attn_mma_lanes_bf16_d256, 256, false, true, ATTD_SM90_BUILD)
ATTD_LANES_KERNEL(attn_mma_lanes_fp8_d32, 32, true, true, true)
ATTD_LANES_KERNEL(attn_mma_lanes_fp8_d64, 64, true, true, true)
ATTD_LANES_KERNEL(attn_mma_lanes_fp8_d128, 128, true, true, true)
ATTD_LANES_KERNEL(attn_mma_lanes_fp8_d256, 256, true, true, ATTD_SM90_BUILD)
ATTD_LANES_KERNEL(attn_mma_lanes_bf16_d32_bq, 32, false, false, true)
ATTD_LANES_KERNEL(attn_mma_lanes_bf16_d64_bq, 64, false, false, true)
ATTD_LANES_KERNEL(attn_mma_lanes_bf16_d128_bq, 128, false, false, true)
ATTD_LANES_KERNEL(attn_mma_lanes_bf16_d256_bq, 256, false, false, true)
ATTD_LANES_KERNEL(attn_mma_lanes_fp8_d32_bq, 32, true, false, true)
ATTD_LANES_KERNEL(attn_mma_lanes_fp8_d64_bq, 64, true, false, true)
ATTD_LANES_KERNEL(attn_mma_lanes_fp8_d128_bq, 128, true, false, true)
ATTD_LANES_KERNEL(attn_mma_lanes_fp8_d256_bq, 256, true, false, true)

// verify_batch (common.cuh group table): grid (nkv, nsplit, groups), group g = one sequence's verify round
// exactly as its one-sequence launch runs it: nlanes GT_COUNT[g], pos0 its first row r0's position, its
// state's K / V (+ kv_off; fp8 exponents + x_off), its q rows r0 .. and partials (rows r0 .. of the
// buffer, as attn_mma_combine_groups reads them). The block is sized for the widest group of the launch:
// the extra warps only stage tiles (kernels.attention_mma_warps), no row's math changes.
#define ATTD_GROUPS_KERNEL(NAME, HD, FP8, QS, BUILD)                                                             \
    extern "C" __global__ void __launch_bounds__(32 * ATTD_MAX_WARPS)                                          \
        NAME(const float* q, int ldq, const i64* lanes, const int* groups, i64 kv_off, i64 x_off, int max_pos,  \
             int nq, int nkv, float scale, int span, int nsplit, float* part) {                                 \
        pdl_entry();                                                                                            \
        const int g = blockIdx.z, r0 = group_field(groups, GT_FIRST, g);                                        \
        if constexpr (BUILD)                                                                                    \
            attn_mma_body<HD, FP8, QS>(q + (i64)r0 * ldq, ldq,                                                  \
                                       lane_ptr<const unsigned char>(lanes, r0, LT_K, kv_off),                  \
                                       lane_ptr<const unsigned char>(lanes, r0, LT_V, kv_off), max_pos, nq, nkv, \
                                       scale, lane_positions(lanes) + r0, span, nsplit,                         \
                                       group_field(groups, GT_COUNT, g), part + (i64)r0 * nq * nsplit * (HD + 2), \
                                       FP8 ? lane_ptr<const signed char>(lanes, r0, LT_KX, x_off) : nullptr,    \
                                       FP8 ? lane_ptr<const signed char>(lanes, r0, LT_VX, x_off) : nullptr);   \
        else                                                                                                    \
            __trap();                                                                                           \
    }
ATTD_GROUPS_KERNEL(attn_mma_groups_bf16_d32, 32, false, true, true)
ATTD_GROUPS_KERNEL(attn_mma_groups_bf16_d64, 64, false, true, true)
ATTD_GROUPS_KERNEL(attn_mma_groups_bf16_d128, 128, false, true, true)
ATTD_GROUPS_KERNEL(attn_mma_groups_bf16_d256, 256, false, true, ATTD_SM90_BUILD)
ATTD_GROUPS_KERNEL(attn_mma_groups_fp8_d32, 32, true, true, true)
ATTD_GROUPS_KERNEL(attn_mma_groups_fp8_d64, 64, true, true, true)
ATTD_GROUPS_KERNEL(attn_mma_groups_fp8_d128, 128, true, true, true)
ATTD_GROUPS_KERNEL(attn_mma_groups_fp8_d256, 256, true, true, ATTD_SM90_BUILD)
ATTD_GROUPS_KERNEL(attn_mma_groups_bf16_d32_bq, 32, false, false, true)
ATTD_GROUPS_KERNEL(attn_mma_groups_bf16_d64_bq, 64, false, false, true)
ATTD_GROUPS_KERNEL(attn_mma_groups_bf16_d128_bq, 128, false, false, true)
ATTD_GROUPS_KERNEL(attn_mma_groups_bf16_d256_bq, 256, false, false, true)
ATTD_GROUPS_KERNEL(attn_mma_groups_fp8_d32_bq, 32, true, false, true)
ATTD_GROUPS_KERNEL(attn_mma_groups_fp8_d64_bq, 64, true, false, true)
ATTD_GROUPS_KERNEL(attn_mma_groups_fp8_d128_bq, 128, true, false, true)
ATTD_GROUPS_KERNEL(attn_mma_groups_fp8_d256_bq, 256, true, false, true)

// grid (nlanes, nq), block hd: the tensor-core kernel's partials (nsplit per lane and head).
extern "C" __global__ void attn_mma_combine(const float* __restrict__ part, int nq, int hd,
                                            const int* __restrict__ pos0_dev, int span, int nsplit,
                                            const float* __restrict__ qg, int ldq, float* __restrict__ out, int ldo, u8* __restrict__ xq, int ldxq,
    float* __restrict__ xs) {
    pdl_entry();
    const int pos0 = *pos0_dev;
    combine_body(part, nq, hd, pos0, blockIdx.x, blockIdx.x, attd_split_size(pos0, span, nsplit), nsplit, qg, ldq, out,
                 ldo, xq, ldxq, xs);
}

// decode_batch: grid (lanes, nq), lane b at its own position (attn_mma_lanes_*' partials).
extern "C" __global__ void attn_mma_combine_lanes(const float* __restrict__ part, int nq, int hd,
                                                  const i64* __restrict__ lanes, int span, int nsplit,
                                                  const float* __restrict__ qg, int ldq, float* __restrict__ out,
                                                  int ldo, u8* __restrict__ xq, int ldxq,
    float* __restrict__ xs) {
    pdl_entry();
    const int pos0 = lane_positions(lanes)[blockIdx.x];
    combine_body(part, nq, hd, pos0, 0, blockIdx.x, attd_split_size(pos0, span, nsplit), nsplit, qg, ldq, out, ldo, xq, ldxq, xs);
}

// verify_batch: grid (lanes, nq), lane b = lane b - r0 of its group's round at pos0 = row r0's position
// (attn_mma_groups_*' partials).
extern "C" __global__ void attn_mma_combine_groups(const float* __restrict__ part, int nq, int hd,
                                                   const i64* __restrict__ lanes, const int* __restrict__ groups,
                                                   int span, int nsplit, const float* __restrict__ qg, int ldq,
                                                   float* __restrict__ out, int ldo, u8* __restrict__ xq, int ldxq,
    float* __restrict__ xs) {
    pdl_entry();
    const int b = blockIdx.x, r0 = group_first_of_lane(groups, b);
    const int pos0 = lane_positions(lanes)[r0];
    combine_body(part, nq, hd, pos0, b - r0, b, attd_split_size(pos0, span, nsplit), nsplit, qg, ldq, out, ldo, xq, ldxq, xs);
}
