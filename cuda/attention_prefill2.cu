// Causal prefill attention v2: FA2-class flash attention on mma.sync (EngineConfig.attn_prefill "v2").
//
// Same contract as attention_prefill.cu (v1): a CTA owns ROWS (lane, q head) rows of one kv head,
// flattened lane-major (row = lane * rep + j, so GQA tiles are full), and streams the visible keys
// through shared memory; the sigmoid output gate is fused into the epilogue. What changes:
//   * numerics: Q and P enter the tensor cores as one bf16 each (one mma per product, like every
//     production flash attention), fp32 accumulation and an fp32 online softmax. The row sum l
//     adds the bf16-rounded P the PV mma consumed, so the output is an exact convex combination
//     of V rows with weights within 2^-9 of the fp32 softmax. Error class: docs/PERF.md
//     "attention prefill v2" and tests/gpu/test_attention_prefill2.py (numpy emulation there).
//   * tiles: ROWS = 16 x WARPS (8 warps x 16 rows on 227 KB / 163 KB parts, 4 warps on 99 KB
//     parts), NK keys per tile, K/V double-buffered through cp.async (K/V tile kt+1 lands while
//     tile kt is computed), fragments read with ldmatrix (.trans for V: no transposed staging),
//     every tile row-major with its 16-byte chunks XOR-swizzled by row so the 8 row addresses of
//     an ldmatrix phase fall in distinct banks.
//   * causal: tiles past the CTA's last row are never loaded, a warp skips tiles past its own
//     last row, and only tiles that cross a warp's first row position pay the mask select.
//   * fp8 KV (e4m3 codes + int8 row exponents): the codes stream through cp.async stages and are
//     converted once per tile into a bf16 K/V tile (exact, as in v1's pf_load8_fp8).
//   * key blocks: keys are cut into blocks of PF2_SPLIT_KEYS at absolute positions (multiples of
//     it), one CTA per (row tile, block). A row whose keys lie in block 0 (position < the block
//     size) is written directly; any other row writes one partial (O, m, l) per block it sees and
//     attn_prefill2_combine merges them in block order. Which rows split, and where, depends on
//     the row's own position only, never on the launch's width, pos0 or tiling: a lane's bits are
//     the same however the prefill was chunked (and warm turns -- T ~ 512 queries over 25K keys,
//     96 row tiles at the 27B shapes -- still fill every SM).
#include "common.cuh"

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// Tile geometry: rows of HD bf16 = C chunks of 16 bytes; chunk c of row r lives at c ^ swz(r).
// With >= 8 chunks per row swz = r & 7 (8 consecutive rows at one logical chunk hit 8 distinct
// 128-byte bank groups); narrower rows (HD 32: 4 chunks) use (r >> 1) & 3, which gives the same.
template <int HD>
struct Pf2Swz {
    static constexpr int C = HD / 8;
    static constexpr int SH = C >= 8 ? 0 : (C == 4 ? 1 : 2);
    static constexpr int MASK = (C >= 8 ? 8 : C) - 1;
    // element offset (u16) of chunk c of row r
    static __device__ __forceinline__ int off(int r, int c) { return r * HD + ((c ^ ((r >> SH) & MASK)) << 3); }
};

template <int HD, int WARPS, int NK, bool FP8>
struct Pf2Layout {
    static constexpr int ROWS = 16 * WARPS;
    static constexpr int Q_BYTES = ROWS * HD * 2;
    static constexpr int KV_BYTES = NK * HD * (FP8 ? 1 : 2);  // one K (or V) tile as it streams in
    static constexpr int STAGE_BYTES = 2 * KV_BYTES;          // K + V
    static constexpr int CVT_BYTES = FP8 ? 2 * NK * HD * 2 : 0;  // fp8: the bf16 K + V tile computed from
    static constexpr int BYTES = Q_BYTES + PF2_STAGES * STAGE_BYTES + CVT_BYTES;
};

// fp8 tile chunk: 16 codes of row `key` (dims 16 cc..16 cc+15) -> 16 bf16 at the swizzled place.
template <int HD>
__device__ __forceinline__ void pf2_cvt16(u16* dst, int key, int cc, uint4 c, float sc) {
    using S = Pf2Swz<HD>;
    const u32 w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float f[8];
        e4m3x2_to_float_div256(w[2 * h] & 0xffffu, f[0], f[1]);
        e4m3x2_to_float_div256(w[2 * h] >> 16, f[2], f[3]);
        e4m3x2_to_float_div256(w[2 * h + 1] & 0xffffu, f[4], f[5]);
        e4m3x2_to_float_div256(w[2 * h + 1] >> 16, f[6], f[7]);
        uint4 o;
        o.x = pack_bf16x2(f[0] * sc, f[1] * sc);
        o.y = pack_bf16x2(f[2] * sc, f[3] * sc);
        o.z = pack_bf16x2(f[4] * sc, f[5] * sc);
        o.w = pack_bf16x2(f[6] * sc, f[7] * sc);
        *reinterpret_cast<uint4*>(dst + S::off(key, 2 * cc + h)) = o;
    }
}

// grid (nkv, row tiles, key blocks), block 32 x WARPS, dynamic smem Pf2Layout::BYTES.
// q [t][ldq] fp32 (q head h at h*HD); kc, vc [nkv][max_pos][HD] (bf16 bits, or fp8 codes with row
// exponents kx, vx [nkv][max_pos]); qg [t][ldqg], gate of q head h at h*2*HD + HD; lanes are
// lane0.. of a prefill at *pos0_dev (this launch covers t of them).
// Direct rows: out[lane][h*HD + d] = softmax(q k^T * scale) v * sigmoid(gate).
// Split rows: part[((lane * nq + h) * nblk + b) * (HD + 4)] = {O[HD] unnormalized, m (log2 units), l}.
template <int HD, int WARPS, int NK, bool FP8>
__device__ __forceinline__ void prefill2_body(const float* __restrict__ q, int ldq, const void* __restrict__ kc_,
                                              const void* __restrict__ vc_, int max_pos, int nq, int nkv, int t,
                                              float scale_log2, const int* __restrict__ pos0_dev, int lane0,
                                              const float* __restrict__ qg, int ldqg, float* __restrict__ out, int ldo,
                                              float* __restrict__ part, const signed char* __restrict__ kx,
                                              const signed char* __restrict__ vx) {
    using LY = Pf2Layout<HD, WARPS, NK, FP8>;
    using S = Pf2Swz<HD>;
    constexpr int ROWS = LY::ROWS, THREADS = 32 * WARPS;
    constexpr int NT = NK / 8;   // key n-tiles of S
    constexpr int DT = HD / 8;   // dim n-tiles of O
    constexpr int C = HD / 8;    // 16-byte bf16 chunks per row
    constexpr int EB = FP8 ? 1 : 2;  // bytes per streamed K/V element
    constexpr int CR = HD * EB / 16;  // 16-byte chunks per streamed row
    constexpr int KU = NK >= 64 ? HD / 16 : 4;  // S-loop unroll (see there)
    static_assert(NT % 2 == 0 && DT % 2 == 0 && PF2_SPLIT_KEYS % NK == 0, "tile shape");
    extern __shared__ __align__(128) unsigned char pf2_sm[];
    u16* qs = reinterpret_cast<u16*>(pf2_sm);
    unsigned char* stage0 = pf2_sm + LY::Q_BYTES;
    u16* cvt = reinterpret_cast<u16*>(pf2_sm + LY::Q_BYTES + PF2_STAGES * LY::STAGE_BYTES);  // fp8 only

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
    const int g = blockIdx.x;
    const int tile = gridDim.y - 1 - blockIdx.y;  // the longest key ranges start first
    const int blk = blockIdx.z, nblk = gridDim.z;
    const int rep = nq / nkv;
    const int nrows = rep * t;
    const int r0 = tile * ROWS;
    const int pos0 = *pos0_dev + lane0;                          // position of this launch's lane 0
    const int pos_max = pos0 + (min(r0 + ROWS, nrows) - 1) / rep;  // last key any row of the CTA sees
    const int kb0 = blk * PF2_SPLIT_KEYS;
    if (kb0 > pos_max) return;  // no row of this tile reaches this block (uniform over the CTA)
    const int kend = min(kb0 + PF2_SPLIT_KEYS, pos_max + 1);  // this CTA's keys: kb0 .. kend-1
    const int ntk = (kend - kb0 + NK - 1) / NK;

    const unsigned char* kg = reinterpret_cast<const unsigned char*>(kc_) + (i64)g * max_pos * HD * EB;
    const unsigned char* vg = reinterpret_cast<const unsigned char*>(vc_) + (i64)g * max_pos * HD * EB;

    // K/V tile kt -> stage kt % PF2_STAGES: raw rows (bf16: swizzled chunks; fp8: codes, row-major)
    auto load_tile = [&](int kt) {
        unsigned char* st = stage0 + (kt % PF2_STAGES) * LY::STAGE_BYTES;
        const int k0 = kb0 + kt * NK;
#pragma unroll
        for (int u = tid; u < NK * CR; u += THREADS) {
            const int kr = u / CR, c = u - kr * CR;
            const int key = k0 + kr;
            const bool ok = key <= pos_max;
            const i64 src = (i64)(ok ? key : 0) * HD * EB + c * 16;
            const int dst = FP8 ? (kr * HD + c * 16) : 2 * S::off(kr, c);
            // src-size 0 zero-fills the 16 bytes: keys past the CTA's last row read as zeros, never
            // past max_pos and never stale data (0 x V would still be NaN on a NaN row).
            const int n = ok ? 16 : 0;
            cp_async_cg16_zfill(smem_u32(st + dst), kg + src, n);
            cp_async_cg16_zfill(smem_u32(st + LY::KV_BYTES + dst), vg + src, n);
        }
        cp_async_commit();
    };
    load_tile(0);

    // Q tile -> bf16 (rows past the launch stay zero and are never written out)
    for (int u = tid; u < ROWS * C; u += THREADS) {
        const int r = u / C, c = u - r * C;
        const int R = r0 + r;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (R < nrows) {
            const int ln = R / rep, j = R - ln * rep;
            const float* p = q + (i64)ln * ldq + (g * rep + j) * HD + c * 8;
            const float4 a = *reinterpret_cast<const float4*>(p);
            const float4 b = *reinterpret_cast<const float4*>(p + 4);
            v = make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y), pack_bf16x2(b.z, b.w));
        }
        *reinterpret_cast<uint4*>(qs + S::off(r, c)) = v;
    }

    // this thread's two rows of the warp's 16 (mma C fragment rows gq, gq + 8) and the warp's range
    int rpos[2];
#pragma unroll
    for (int i = 0; i < 2; i++) rpos[i] = pos0 + min(r0 + warp * 16 + gq + 8 * i, nrows - 1) / rep;
    const int wpos_lo = pos0 + min(r0 + warp * 16, nrows - 1) / rep;
    const int wpos_hi = pos0 + min(r0 + warp * 16 + 15, nrows - 1) / rep;

    float o[DT][4];
#pragma unroll
    for (int d = 0; d < DT; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    // ldmatrix lane addresses (bytes, before the per-step offsets)
    const u32 q_base = smem_u32(qs);
    const int a_row = warp * 16 + (lane & 15), a_hi = lane >> 4;           // A: rows, k half
    const int b_key = (lane & 7) + ((lane >> 4) << 3), b_hi = (lane >> 3) & 1;  // K as B: keys, k half
    const int v_key = (lane & 7) + (((lane >> 3) & 1) << 3), v_hi = lane >> 4;  // V as B (.trans)

    for (int kt = 0; kt < ntk; kt++) {
        if (kt + 1 < ntk) {
            load_tile(kt + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // tile kt (and, first pass, the Q stores) visible to every warp
        const int k0 = kb0 + kt * NK;
        const unsigned char* st = stage0 + (kt % PF2_STAGES) * LY::STAGE_BYTES;
        const u16* ks;
        const u16* vs;
        if constexpr (FP8) {
            // codes -> bf16 tile: e4m3 x 2^(e+8) is a bf16 value (exact); zero past pos_max
            for (int u = tid; u < 2 * NK * (HD / 16); u += THREADS) {
                const int which = u / (NK * (HD / 16));
                const int w = u - which * NK * (HD / 16);
                const int kr = w / (HD / 16), cc = w - kr * (HD / 16);
                const int key = k0 + kr;
                const signed char* ex = which ? vx : kx;
                const float sc = key <= pos_max ? exp2_int((int)ex[(i64)g * max_pos + key] + 8) : 0.f;
                const uint4 c = *reinterpret_cast<const uint4*>(st + which * LY::KV_BYTES + kr * HD + cc * 16);
                pf2_cvt16<HD>(cvt + which * NK * HD, kr, cc, c, sc);
            }
            __syncthreads();
            ks = cvt;
            vs = cvt + NK * HD;
        } else {
            ks = reinterpret_cast<const u16*>(st);
            vs = reinterpret_cast<const u16*>(st + LY::KV_BYTES);
        }
        if (k0 <= wpos_hi) {  // warp-uniform: a tile past every row of this warp changes nothing
            const u32 k_base = smem_u32(ks), v_base = smem_u32(vs);
            // S = Q K^T for this warp's 16 rows x NK keys
            float s[NT][4];
#pragma unroll
            for (int n = 0; n < NT; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
            // 32-key variants (sm_80 / 99 KB parts) unroll the dims by 4: fully unrolled, ptxas for
            // sm_120 spills at 255 registers; the 64-key variant (sm_90) keeps the full unroll
#pragma unroll(KU)
            for (int kk = 0; kk < HD / 16; kk++) {
                u32 a0, a1, a2, a3;
                ldsm_x4(q_base + 2 * S::off(a_row, 2 * kk + a_hi), a0, a1, a2, a3);
#pragma unroll
                for (int np = 0; np < NT / 2; np++) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4(k_base + 2 * S::off(np * 16 + b_key, 2 * kk + b_hi), b0, b1, b2, b3);
                    mma_bf16_16816(s[2 * np][0], s[2 * np][1], s[2 * np][2], s[2 * np][3], a0, a1, a2, a3, b0, b1);
                    mma_bf16_16816(s[2 * np + 1][0], s[2 * np + 1][1], s[2 * np + 1][2], s[2 * np + 1][3], a0, a1,
                                   a2, a3, b2, b3);
                }
            }
            // scale (log2 units), causal mask where the tile crosses this warp's first row position
            float mx[2] = {-INFINITY, -INFINITY};
            const bool diag = k0 + NK - 1 > wpos_lo;
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    float x = s[n][c] * scale_log2;
                    if (diag && k0 + n * 8 + 2 * tq + (c & 1) > rpos[c >> 1]) x = -INFINITY;
                    s[n][c] = x;
                    mx[c >> 1] = fmaxf(mx[c >> 1], x);
                }
            float corr[2], mu[2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 1));
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 2));
                const float mn = fmaxf(m[i], mx[i]);
                // a row with no visible key yet (a row of another block in this tile) keeps m = -inf:
                // exponentiate against 0 there so nothing becomes NaN (its p are all exp2(-inf) = 0)
                mu[i] = mn == -INFINITY ? 0.f : mn;
                corr[i] = exp2f(m[i] - mu[i]);  // first visible tile: exp2(-inf) = 0; no new max: 1
                m[i] = mn;
                l[i] *= corr[i];
            }
#pragma unroll
            for (int d = 0; d < DT; d++) {
                o[d][0] *= corr[0];
                o[d][1] *= corr[0];
                o[d][2] *= corr[1];
                o[d][3] *= corr[1];
            }
            // O += P V, P as bf16 (the S accumulators of n-tiles 2kk, 2kk+1 are the A fragment of k-step kk);
            // l sums the rounded P the mma consumes
#pragma unroll
            for (int kk = 0; kk < NK / 16; kk++) {
                u32 p[4];
#pragma unroll
                for (int h = 0; h < 2; h++)
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        const float* sv = s[2 * kk + h];
                        const u32 pk = pack_bf16x2(exp2f(sv[2 * i] - mu[i]), exp2f(sv[2 * i + 1] - mu[i]));
                        p[2 * h + i] = pk;
                        l[i] += bf16x2_lo(pk) + bf16x2_hi(pk);
                    }
#pragma unroll
                for (int dp = 0; dp < DT / 2; dp++) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4_t(v_base + 2 * S::off(kk * 16 + v_key, 2 * dp + v_hi), b0, b1, b2, b3);
                    mma_bf16_16816(o[2 * dp][0], o[2 * dp][1], o[2 * dp][2], o[2 * dp][3], p[0], p[1], p[2], p[3], b0,
                                   b1);
                    mma_bf16_16816(o[2 * dp + 1][0], o[2 * dp + 1][1], o[2 * dp + 1][2], o[2 * dp + 1][3], p[0], p[1],
                                   p[2], p[3], b2, b3);
                }
            }
        }
        __syncthreads();  // every warp is done with this stage (and the fp8 bf16 tile) before refills
    }

    // epilogue: full row sums over the quad; direct rows normalize + gate, split rows write partials
#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] += __shfl_xor_sync(FULL_MASK, l[i], 1);
        l[i] += __shfl_xor_sync(FULL_MASK, l[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; i++)
        prefill_attn_row_out<HD>([&](int d, int e) { return o[d][e]; }, i, r0 + warp * 16 + gq + 8 * i, nrows, rep, g,
                                 nq, pos0, kb0, blk, nblk, tq, m, l, qg, ldqg, out, ldo, part);
}

// Merge the block partials of split rows (position >= PF2_SPLIT_KEYS) in block order; the
// arithmetic depends on the row's position only. grid (t, nq), block HD.
extern "C" __global__ void attn_prefill2_combine(const float* __restrict__ part, int nq, int hd, int nblk,
                                                 const int* __restrict__ pos0_dev, int lane0,
                                                 const float* __restrict__ qg, int ldqg, float* __restrict__ out,
                                                 int ldo) {
    const int ln = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    const int pos = *pos0_dev + lane0 + ln;
    if (pos < PF2_SPLIT_KEYS) return;  // written directly by the attention kernel
    const int nb = pos / PF2_SPLIT_KEYS + 1;
    const float* p = part + (i64)(ln * nq + h) * nblk * (hd + 4);
    float M = p[hd], L = p[hd + 1], A = p[d];
    for (int b = 1; b < nb; b++) {
        const float* pb = p + (i64)b * (hd + 4);
        const float mb = pb[hd], lb = pb[hd + 1];
        const float mn = fmaxf(M, mb);
        const float ca = exp2f(M - mn), cb = exp2f(mb - mn);
        A = A * ca + pb[d] * cb;
        L = L * ca + lb * cb;
        M = mn;
    }
    const float gate = qg[(i64)ln * ldqg + h * 2 * hd + hd + d];
    out[(i64)ln * ldo + h * hd + d] = (A / L) * sigmoid_f(gate);
}

#define PF2_KERNEL(NAME, HD, WARPS, NK, FP8)                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, 1)                                                \
        NAME(const float* q, int ldq, const void* kc, const void* vc, int max_pos, int nq, int nkv, int t,     \
             float scale_log2, const int* pos0_dev, int lane0, const float* qg, int ldqg, float* out, int ldo, \
             float* part, const signed char* kx, const signed char* vx) {                                     \
        prefill2_body<HD, WARPS, NK, FP8>(q, ldq, kc, vc, max_pos, nq, nkv, t, scale_log2, pos0_dev, lane0, qg, \
                                          ldqg, out, ldo, part, kx, vx);                                       \
    }

// Variants (kernels.attention_prefill2_variant picks the first whose shared memory the card grants):
// a: 8 warps x NK PF2_NK_A (sm_90 227 KB), b: 8 warps x PF2_NK_B (sm_80 163 KB), c: 4 warps x
// PF2_NK_C (sm_86 / 89 / 120, 99 KB). Head dims <= 128 fit variant a everywhere.
#define PF2_FAMILY(KV, FP8)                                                    \
    PF2_KERNEL(attn_prefill2_##KV##_d32_a, 32, PF2_WARPS_A, PF2_NK_A, FP8)     \
    PF2_KERNEL(attn_prefill2_##KV##_d64_a, 64, PF2_WARPS_A, PF2_NK_A, FP8)     \
    PF2_KERNEL(attn_prefill2_##KV##_d128_a, 128, PF2_WARPS_A, PF2_NK_A, FP8)   \
    PF2_KERNEL(attn_prefill2_##KV##_d256_a, 256, PF2_WARPS_A, PF2_NK_A, FP8)   \
    PF2_KERNEL(attn_prefill2_##KV##_d256_b, 256, PF2_WARPS_B, PF2_NK_B, FP8)   \
    PF2_KERNEL(attn_prefill2_##KV##_d256_c, 256, PF2_WARPS_C, PF2_NK_C, FP8)

PF2_FAMILY(bf16, false)
PF2_FAMILY(fp8, true)
