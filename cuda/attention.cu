// Attention over the KV cache for decode / verify lanes (flash-decoding, split over
// positions), GQA-packed: one CTA per (kv head, position split, lane) computes all the q
// heads that share the kv head. Lane t attends to positions 0..pos0+t (causal per lane).
// The split size depends only on (pos0, span) -- span is the launch's lane capacity (16 for
// verify graphs), never the live width -- so lane t's bits do not depend on how many lanes
// run with it. Partials {m, l, acc[hd]} are merged in split order by attn_combine, which also
// applies the sigmoid output gate.
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
template <typename KVT, int DPL>
__device__ __forceinline__ void attn_split_body(const float* __restrict__ q, int ldq, const KVT* __restrict__ kc,
                                                const KVT* __restrict__ vc, int max_pos, int nq, int nkv, float scale,
                                                const int* __restrict__ pos0_dev, int span, float* __restrict__ part,
                                                const signed char* __restrict__ kx = nullptr,
                                                const signed char* __restrict__ vx = nullptr) {
    constexpr bool FP8 = sizeof(KVT) == 1;
    extern __shared__ float sm[];
    constexpr int HD = 32 * DPL;
    const int g = blockIdx.x, sp = blockIdx.y, t = blockIdx.z;
    const int pos0 = *pos0_dev, len = pos0 + t + 1;
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
            qv[j][i] = j < rep ? q[(i64)t * ldq + (g * rep + j) * HD + lane * DPL + i] : 0.f;
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
        float* dst = part + ((i64)(t * nq + g * rep + j) * NSPLIT + sp) * (HD + 2);
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
        attn_split_body<KVT, DPL>(q, ldq, kc, vc, max_pos, nq, nkv, scale, pos0_dev, span, part);                       \
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
        attn_split_body<u8, DPL>(q, ldq, kc, vc, max_pos, nq, nkv, scale, pos0_dev, span, part, kx, vx);               \
    }

ATT_KERNEL_FP8(attn_split_fp8_d1, 1)
ATT_KERNEL_FP8(attn_split_fp8_d2, 2)
ATT_KERNEL_FP8(attn_split_fp8_d4, 4)
ATT_KERNEL_FP8(attn_split_fp8_d8, 8)

// grid (nlanes, nq), block hd. out[t][h*hd + d] = (sum_s acc e^(m_s-M)) / (sum_s l e^(m_s-M)) * sigmoid(gate)
extern "C" __global__ void attn_combine(const float* __restrict__ part, int nq, int hd, const int* __restrict__ pos0_dev,
                                        int span, const float* __restrict__ qg, int ldq, float* __restrict__ out, int ldo) {
    const int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    const int pos0 = *pos0_dev, len = pos0 + t + 1;
    const int ssz = split_size(pos0, span);
    const int ns = (len + ssz - 1) / ssz;
    const float* base = part + (i64)(t * nq + h) * NSPLIT * (hd + 2);
    float M = -INFINITY;
    for (int s = 0; s < ns; s++) M = fmaxf(M, base[(i64)s * (hd + 2)]);
    float L = 0.f, A = 0.f;
    for (int s = 0; s < ns; s++) {
        const float* b = base + (i64)s * (hd + 2);
        const float e = expf(b[0] - M);
        L = fmaf(b[1], e, L);
        A = fmaf(b[2 + d], e, A);
    }
    const float gate = qg[(i64)t * ldq + h * 2 * hd + hd + d];
    out[(i64)t * ldo + h * hd + d] = (A / L) * sigmoid_f(gate);
}
