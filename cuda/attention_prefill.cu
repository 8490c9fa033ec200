// Causal attention for prefill lanes on tensor cores (flash-attention style).
//
// The decode kernel (attention.cu) gives every lane its own CTAs, so a prefill of T lanes
// reads the KV cache T times. Here a CTA owns 64 query rows of one kv head -- the rows are
// the (lane, q head) pairs of that kv head, flattened lane-major (row = lane * rep + j), so
// a tile is full for any GQA ratio -- and streams the visible keys through shared memory in
// tiles of NK, each tile read once for all 64 rows. Four warps own 16 rows each:
// S = Q K^T and O += P V run as mma.m16n8k16 (bf16 in, fp32 accumulate) with an online
// softmax in fp32 between them. Lane i sees keys 0..pos0+i; only the tiles past the CTA's
// last row position are skipped, and the per-element mask is a select (cheap next to the mma).
//
// fp8 KV (e4m3 codes + int8 row exponents) is staged into the same bf16 tiles (exact, see
// pf_load8_fp8). Rotated Lloyd-Max KV (k5v3 / k3v3: codes + fp16 norms, KBITS / VBITS > 0) is
// dequantized in the rotated basis (centroid * s / sqrt(d)) and staged as fp32 K/V are (hi + lo,
// pf_load8_rot), against a query already rotated by the store kernel; its epilogue writes the
// ungated output in the rotated basis and kv_rotated.cu's unrotate_gate finishes (R^T, gate).
//
// Numerics: fp32 inputs go in as bf16 hi + lo pairs (x = hi + lo to ~2^-17 relative), so
// the result keeps fp32-grade accuracy, like the GEMV's bf16 path: Q and P always split
// (2 mma per product), fp32 K/V split too (3 mma: hi*hi + lo*hi + hi*lo). bf16 K/V are exact.
// Not bitwise equal to the decode kernel (different summation order): tolerance-equal.
//
// Layout (u16 in shared memory, rows padded by 8 so the fragment loads are conflict-free):
//   qh, ql   [64][HD + 8]    Q hi / lo, row = CTA row
//   kh (kl)  [NK][HD + 8]    K tile, row = key
//   vh (vl)  [HD][NK + 8]    V tile transposed, row = dim (B fragments need key pairs adjacent)
#include "common.cuh"


template <int HD, int NK, bool F32KV>
struct PfLayout {
    static constexpr int QS = HD + 8;  // u16 per Q / K row
    static constexpr int VS = NK + 8;  // u16 per V^T row
    static constexpr int Q_ELEMS = PF_ROWS * QS;
    static constexpr int K_ELEMS = NK * QS;
    static constexpr int V_ELEMS = HD * VS;
    static constexpr int NP = F32KV ? 2 : 1;
    static constexpr int BYTES = 2 * (2 * Q_ELEMS + NP * (K_ELEMS + V_ELEMS));
};

__device__ __forceinline__ u32 pf_ld32(const u16* p) { return *reinterpret_cast<const u32*>(p); }

// (x0, x1) -> bf16x2 hi and the bf16x2 of the remainders (x - hi is exact in fp32)
__device__ __forceinline__ void pf_split2(float x0, float x1, u32& hi, u32& lo) {
    hi = pack_bf16x2(x0, x1);
    lo = pack_bf16x2(x0 - bf16x2_lo(hi), x1 - bf16x2_hi(hi));
}

// 8 consecutive values at p -> 8 bf16 (hi, and lo for fp32 sources); zeros when !ok
__device__ __forceinline__ void pf_load8(const float* p, bool ok, uint4& hi, uint4& lo) {
    hi = make_uint4(0u, 0u, 0u, 0u);
    lo = hi;
    if (!ok) return;
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    pf_split2(a.x, a.y, hi.x, lo.x);
    pf_split2(a.z, a.w, hi.y, lo.y);
    pf_split2(b.x, b.y, hi.z, lo.z);
    pf_split2(b.z, b.w, hi.w, lo.w);
}
__device__ __forceinline__ void pf_load8(const u16* p, bool ok, uint4& hi, uint4& lo) {
    hi = make_uint4(0u, 0u, 0u, 0u);
    lo = hi;
    if (ok) hi = *reinterpret_cast<const uint4*>(p);
}

// fp8 e4m3 rows (kvformat "fp8"): 8 codes * the row scale 2^e, staged as bf16. Exact: an e4m3
// value times a power of two in [2^-120, 2^120] is a bf16 value, so fp8 KV goes through the bf16
// tiles unchanged (one mma per product, like bf16 KV).
__device__ __forceinline__ void pf_load8_fp8(const u8* p, const signed char* ex, bool ok, uint4& hi) {
    hi = make_uint4(0u, 0u, 0u, 0u);
    if (!ok) return;
    const uint2 c = *reinterpret_cast<const uint2*>(p);
    const float sc = exp2_int((int)*ex + 8);
    float f[8];
    e4m3x2_to_float_div256(c.x & 0xffffu, f[0], f[1]);
    e4m3x2_to_float_div256(c.x >> 16, f[2], f[3]);
    e4m3x2_to_float_div256(c.y & 0xffffu, f[4], f[5]);
    e4m3x2_to_float_div256(c.y >> 16, f[6], f[7]);
    hi.x = pack_bf16x2(f[0] * sc, f[1] * sc);
    hi.y = pack_bf16x2(f[2] * sc, f[3] * sc);
    hi.z = pack_bf16x2(f[4] * sc, f[5] * sc);
    hi.w = pack_bf16x2(f[6] * sc, f[7] * sc);
}

// Rotated Lloyd-Max rows (kvformat "k5v3" / "k3v3"): dims dc*8 .. dc*8+7 of one row in the rotated
// basis, centroid * s / sqrt(d), as bf16 hi + lo (the fp32 path's split: ~2^-17 relative, so the
// tiles carry what the decode kernel multiplies in fp32).
template <int BITS, int HD>
__device__ __forceinline__ void pf_load8_rot(const u8* row, int dc, const u16* norm, const float* __restrict__ cb,
                                             float inv_sqrt_d, bool ok, uint4& hi, uint4& lo) {
    hi = make_uint4(0u, 0u, 0u, 0u);
    lo = hi;
    if (!ok) return;
    u32 c[8];
    lm_codes8(row, dc * 8, HD, BITS, c);
    const float sc = half_to_float(*norm) * inv_sqrt_d;
    pf_split2(cb[c[0]] * sc, cb[c[1]] * sc, hi.x, lo.x);
    pf_split2(cb[c[2]] * sc, cb[c[3]] * sc, hi.y, lo.y);
    pf_split2(cb[c[4]] * sc, cb[c[5]] * sc, hi.z, lo.z);
    pf_split2(cb[c[6]] * sc, cb[c[7]] * sc, hi.w, lo.w);
}

// Two key rows (8 dims each, packed bf16 pairs) -> 8 words {row a dim e, row b dim e}
__device__ __forceinline__ void pf_store_vt(u16* dst, int vs, uint4 a, uint4 b) {
    u32* d = reinterpret_cast<u32*>(dst);
    const int w = vs / 2;  // words per V^T row
    d[0 * w] = __byte_perm(a.x, b.x, 0x5410);
    d[1 * w] = __byte_perm(a.x, b.x, 0x7632);
    d[2 * w] = __byte_perm(a.y, b.y, 0x5410);
    d[3 * w] = __byte_perm(a.y, b.y, 0x7632);
    d[4 * w] = __byte_perm(a.z, b.z, 0x5410);
    d[5 * w] = __byte_perm(a.z, b.z, 0x7632);
    d[6 * w] = __byte_perm(a.w, b.w, 0x5410);
    d[7 * w] = __byte_perm(a.w, b.w, 0x7632);
}

__device__ __forceinline__ void pf_mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    mma_bf16_16816(c[0], c[1], c[2], c[3], a0, a1, a2, a3, b0, b1);
}

// grid (nkv, ceil(rep * t / 64)), block 128, dynamic smem PfLayout::BYTES.
// q [t][ldq] fp32 (q head h at h*HD); kc, vc [nkv][max_pos][HD]; qg [t][ldqg] with the gate of
// q head h at h*2*HD + HD; out[lane][h*HD + d] = softmax(q k^T * scale) v * sigmoid(gate).
// Rotated KV (KBITS > 0): kc / vc rows of HD * bits / 8 code bytes, kn / vn fp16 norms [nkv][max_pos],
// ck / cvb the codebooks; out gets the ungated output in the rotated basis (qg unused).
template <int HD, int NK, typename KVT, int KBITS = 0, int VBITS = 0>
__device__ __forceinline__ void prefill_body(const float* __restrict__ q, int ldq, const KVT* __restrict__ kc,
                                             const KVT* __restrict__ vc, int max_pos, int nq, int nkv, int t,
                                             float scale, const int* __restrict__ pos0_dev,
                                             const float* __restrict__ qg, int ldqg, float* __restrict__ out, int ldo,
                                             const signed char* __restrict__ kx = nullptr,
                                             const signed char* __restrict__ vx = nullptr,
                                             const u16* __restrict__ kn = nullptr, const u16* __restrict__ vn = nullptr,
                                             const float* __restrict__ ck = nullptr,
                                             const float* __restrict__ cvb = nullptr, float inv_sqrt_d = 0.f) {
    constexpr bool ROT = KBITS > 0;
    constexpr bool F32KV = sizeof(KVT) == 4 || ROT;  // hi + lo tiles
    constexpr bool FP8 = sizeof(KVT) == 1 && !ROT;  // kx / vx: row exponents [nkv][max_pos]
    constexpr int KRS = ROT ? HD * KBITS / 8 : HD;  // K / V row strides (elements of KVT)
    constexpr int VRS = ROT ? HD * VBITS / 8 : HD;
    using LY = PfLayout<HD, NK, F32KV>;
    constexpr int QS = LY::QS, VS = LY::VS;
    constexpr int NT = NK / 8;   // key n-tiles of S
    constexpr int DT = HD / 8;   // dim n-tiles of O
    constexpr int DC = HD / 8;   // 8-dim chunks per row (staging unit)
    extern __shared__ __align__(16) u16 pf_sm[];
    u16* qh = pf_sm;
    u16* ql = qh + LY::Q_ELEMS;
    u16* kh = ql + LY::Q_ELEMS;
    u16* vh = kh + LY::K_ELEMS;
    u16* kl = vh + LY::V_ELEMS;  // fp32 K/V only
    u16* vl = kl + LY::K_ELEMS;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
    const int g = blockIdx.x;
    const int tile = gridDim.y - 1 - blockIdx.y;  // the longest key ranges start first
    const int rep = nq / nkv;
    const int nrows = rep * t;
    const int r0 = tile * PF_ROWS;
    const int pos0 = *pos0_dev;
    const int pos_max = pos0 + (min(r0 + PF_ROWS, nrows) - 1) / rep;  // last key any row of the CTA sees

    // Q tile -> bf16 hi / lo (rows past the lanes stay zero and are never written out)
    for (int u = tid; u < PF_ROWS * DC; u += PF_THREADS) {
        const int r = u / DC, dc = u - r * DC;
        const int R = r0 + r;
        const int ln = R / rep, j = R - ln * rep;
        uint4 hi, lo;
        pf_load8(q + (i64)ln * ldq + (g * rep + j) * HD + dc * 8, R < nrows, hi, lo);
        *reinterpret_cast<uint4*>(qh + r * QS + dc * 8) = hi;
        *reinterpret_cast<uint4*>(ql + r * QS + dc * 8) = lo;
    }

    // this thread's two rows of the warp's 16: gq and gq + 8 (mma C fragment rows)
    int rpos[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int R = min(r0 + warp * 16 + gq + 8 * i, nrows - 1);
        rpos[i] = pos0 + R / rep;
    }

    float o[DT][4];
#pragma unroll
    for (int d = 0; d < DT; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    const KVT* kg = kc + (i64)g * max_pos * KRS;
    const KVT* vg = vc + (i64)g * max_pos * VRS;
    const u16* qa_h = qh + (warp * 16 + gq) * QS + 2 * tq;
    const u16* qa_l = ql + (warp * 16 + gq) * QS + 2 * tq;
    const int ntk = pos_max / NK + 1;

    for (int kt = 0; kt < ntk; kt++) {
        const int k0 = kt * NK;
        __syncthreads();  // the previous tile's reads are done (first pass: orders the Q stores)
        // K tile, row-major; keys past pos_max are zeros (never past max_pos, never stale data)
        for (int u = tid; u < NK * DC; u += PF_THREADS) {
            const int kr = u / DC, dc = u - kr * DC;
            const int key = k0 + kr;
            uint4 hi, lo;
            if constexpr (ROT) {
                pf_load8_rot<KBITS, HD>(kg + (i64)key * KRS, dc, kn + (i64)g * max_pos + key, ck, inv_sqrt_d,
                                        key <= pos_max, hi, lo);
            } else if constexpr (FP8) {
                pf_load8_fp8(kg + (i64)key * HD + dc * 8, kx + (i64)g * max_pos + key, key <= pos_max, hi);
            } else {
                pf_load8(kg + (i64)key * HD + dc * 8, key <= pos_max, hi, lo);
            }
            *reinterpret_cast<uint4*>(kh + kr * QS + dc * 8) = hi;
            if constexpr (F32KV) *reinterpret_cast<uint4*>(kl + kr * QS + dc * 8) = lo;
        }
        // V tile, transposed: a thread takes two adjacent keys x 8 dims
        for (int u = tid; u < (NK / 2) * DC; u += PF_THREADS) {
            const int kp = u % (NK / 2), dc = u / (NK / 2);
            const int key = k0 + 2 * kp;
            uint4 h0, l0, h1, l1;
            if constexpr (ROT) {
                const u16* vr = vn + (i64)g * max_pos + key;
                pf_load8_rot<VBITS, HD>(vg + (i64)key * VRS, dc, vr, cvb, inv_sqrt_d, key <= pos_max, h0, l0);
                pf_load8_rot<VBITS, HD>(vg + (i64)(key + 1) * VRS, dc, vr + 1, cvb, inv_sqrt_d, key + 1 <= pos_max, h1,
                                        l1);
            } else if constexpr (FP8) {
                const signed char* ve = vx + (i64)g * max_pos + key;
                pf_load8_fp8(vg + (i64)key * HD + dc * 8, ve, key <= pos_max, h0);
                pf_load8_fp8(vg + (i64)(key + 1) * HD + dc * 8, ve + 1, key + 1 <= pos_max, h1);
            } else {
                pf_load8(vg + (i64)key * HD + dc * 8, key <= pos_max, h0, l0);
                pf_load8(vg + (i64)(key + 1) * HD + dc * 8, key + 1 <= pos_max, h1, l1);
            }
            pf_store_vt(vh + (dc * 8) * VS + 2 * kp, VS, h0, h1);
            if constexpr (F32KV) pf_store_vt(vl + (dc * 8) * VS + 2 * kp, VS, l0, l1);
        }
        __syncthreads();

        // S = Q K^T for this warp's 16 rows x NK keys
        float s[NT][4];
#pragma unroll
        for (int n = 0; n < NT; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < HD / 16; ks++) {
            const u16* ph = qa_h + ks * 16;
            const u16* pl = qa_l + ks * 16;
            const u32 ah0 = pf_ld32(ph), ah1 = pf_ld32(ph + 8 * QS);
            const u32 ah2 = pf_ld32(ph + 8), ah3 = pf_ld32(ph + 8 * QS + 8);
            const u32 al0 = pf_ld32(pl), al1 = pf_ld32(pl + 8 * QS);
            const u32 al2 = pf_ld32(pl + 8), al3 = pf_ld32(pl + 8 * QS + 8);
#pragma unroll
            for (int n = 0; n < NT; n++) {
                const int off = (n * 8 + gq) * QS + ks * 16 + 2 * tq;
                const u32 b0 = pf_ld32(kh + off), b1 = pf_ld32(kh + off + 8);
                pf_mma(s[n], al0, al1, al2, al3, b0, b1);  // small terms first
                if (F32KV) pf_mma(s[n], ah0, ah1, ah2, ah3, pf_ld32(kl + off), pf_ld32(kl + off + 8));
                pf_mma(s[n], ah0, ah1, ah2, ah3, b0, b1);
            }
        }

        // causal mask + online softmax; a row's 4 threads (same gq) share m through the quad
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int key = k0 + n * 8 + 2 * tq + (c & 1);
                const float x = key <= rpos[c >> 1] ? s[n][c] * scale : -INFINITY;
                s[n][c] = x;
                mx[c >> 1] = fmaxf(mx[c >> 1], x);
            }
        float corr[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 2));
            // key 0 is in the first tile and visible to every row, so m is finite from then on
            const float mn = fmaxf(m[i], mx[i]);
            corr[i] = expf(m[i] - mn);  // first tile: exp(-inf) = 0
            m[i] = mn;
            l[i] *= corr[i];
        }
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const float p = expf(s[n][c] - m[c >> 1]);  // masked: exp(-inf) = 0
                s[n][c] = p;
                l[c >> 1] += p;
            }
#pragma unroll
        for (int d = 0; d < DT; d++) {
            o[d][0] *= corr[0];
            o[d][1] *= corr[0];
            o[d][2] *= corr[1];
            o[d][3] *= corr[1];
        }

        // O += P V: the S accumulators of key n-tiles 2kk, 2kk+1 are the A fragment of k-step kk
#pragma unroll
        for (int kk = 0; kk < NK / 16; kk++) {
            u32 ph0, ph1, ph2, ph3, pl0, pl1, pl2, pl3;
            pf_split2(s[2 * kk][0], s[2 * kk][1], ph0, pl0);
            pf_split2(s[2 * kk][2], s[2 * kk][3], ph1, pl1);
            pf_split2(s[2 * kk + 1][0], s[2 * kk + 1][1], ph2, pl2);
            pf_split2(s[2 * kk + 1][2], s[2 * kk + 1][3], ph3, pl3);
#pragma unroll
            for (int d = 0; d < DT; d++) {
                const int off = (d * 8 + gq) * VS + kk * 16 + 2 * tq;
                const u32 b0 = pf_ld32(vh + off), b1 = pf_ld32(vh + off + 8);
                pf_mma(o[d], pl0, pl1, pl2, pl3, b0, b1);
                if (F32KV) pf_mma(o[d], ph0, ph1, ph2, ph3, pf_ld32(vl + off), pf_ld32(vl + off + 8));
                pf_mma(o[d], ph0, ph1, ph2, ph3, b0, b1);
            }
        }
    }

    // epilogue: full row sums over the quad, normalize, gate, store
#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] += __shfl_xor_sync(FULL_MASK, l[i], 1);
        l[i] += __shfl_xor_sync(FULL_MASK, l[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int R = r0 + warp * 16 + gq + 8 * i;
        if (R >= nrows) continue;
        const int ln = R / rep, h = g * rep + (R - ln * rep);
        const float* gate = qg + (i64)ln * ldqg + h * 2 * HD + HD;
        float* dst = out + (i64)ln * ldo + h * HD;
#pragma unroll
        for (int d = 0; d < DT; d++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int dd = d * 8 + 2 * tq + c;
                if constexpr (ROT) {
                    dst[dd] = o[d][2 * i + c] / l[i];  // rotated basis, ungated: unrotate_gate finishes
                } else {
                    dst[dd] = (o[d][2 * i + c] / l[i]) * sigmoid_f(gate[dd]);
                }
            }
    }
}

#define PF_KERNEL(NAME, KVT, HD, NK)                                                                             \
    extern "C" __global__ void __launch_bounds__(PF_THREADS)                                                    \
        NAME(const float* q, int ldq, const KVT* kc, const KVT* vc, int max_pos, int nq, int nkv, int t,         \
             float scale, const int* pos0_dev, const float* qg, int ldqg, float* out, int ldo) {                \
        prefill_body<HD, NK, KVT>(q, ldq, kc, vc, max_pos, nq, nkv, t, scale, pos0_dev, qg, ldqg, out, ldo);    \
    }

#define PF_KERNEL_FP8(NAME, HD)                                                                                  \
    extern "C" __global__ void __launch_bounds__(PF_THREADS)                                                    \
        NAME(const float* q, int ldq, const u8* kc, const u8* vc, int max_pos, int nq, int nkv, int t,          \
             float scale, const int* pos0_dev, const float* qg, int ldqg, float* out, int ldo,                  \
             const signed char* kx, const signed char* vx) {                                                    \
        prefill_body<HD, 32, u8>(q, ldq, kc, vc, max_pos, nq, nkv, t, scale, pos0_dev, qg, ldqg, out, ldo, kx,  \
                                 vx);                                                                           \
    }

// Rotated KV: fp32-style hi + lo tiles (same shared memory and key tile as the f32 kernels).
#define PF_KERNEL_ROT(NAME, HD, NK, KB, VB)                                                                     \
    extern "C" __global__ void __launch_bounds__(PF_THREADS)                                                    \
        NAME(const float* q, int ldq, const u8* kc, const u8* vc, int max_pos, int nq, int nkv, int t,          \
             float scale, const int* pos0_dev, float* out, int ldo, const u16* kn, const u16* vn,              \
             const float* ck, const float* cvb, float inv_sqrt_d) {                                             \
        prefill_body<HD, NK, u8, KB, VB>(q, ldq, kc, vc, max_pos, nq, nkv, t, scale, pos0_dev, nullptr, 0, out, \
                                         ldo, nullptr, nullptr, kn, vn, ck, cvb, inv_sqrt_d);                   \
    }

// key tile NK: 32, except fp32 K/V at head dim 256 (16 keys keep the CTA near 100 KB of smem)
PF_KERNEL(attn_prefill_bf16_d32, u16, 32, 32)
PF_KERNEL(attn_prefill_bf16_d64, u16, 64, 32)
PF_KERNEL(attn_prefill_bf16_d128, u16, 128, 32)
PF_KERNEL(attn_prefill_bf16_d256, u16, 256, 32)
PF_KERNEL(attn_prefill_f32_d32, float, 32, 32)
PF_KERNEL(attn_prefill_f32_d64, float, 64, 32)
PF_KERNEL(attn_prefill_f32_d128, float, 128, 32)
PF_KERNEL(attn_prefill_f32_d256, float, 256, 16)
PF_KERNEL_FP8(attn_prefill_fp8_d32, 32)
PF_KERNEL_FP8(attn_prefill_fp8_d64, 64)
PF_KERNEL_FP8(attn_prefill_fp8_d128, 128)
PF_KERNEL_FP8(attn_prefill_fp8_d256, 256)
PF_KERNEL_ROT(attn_prefill_k5v3_d32, 32, 32, 5, 3)
PF_KERNEL_ROT(attn_prefill_k5v3_d64, 64, 32, 5, 3)
PF_KERNEL_ROT(attn_prefill_k5v3_d128, 128, 32, 5, 3)
PF_KERNEL_ROT(attn_prefill_k5v3_d256, 256, 16, 5, 3)
PF_KERNEL_ROT(attn_prefill_k3v3_d32, 32, 32, 3, 3)
PF_KERNEL_ROT(attn_prefill_k3v3_d64, 64, 32, 3, 3)
PF_KERNEL_ROT(attn_prefill_k3v3_d128, 128, 32, 3, 3)
PF_KERNEL_ROT(attn_prefill_k3v3_d256, 256, 16, 3, 3)
