// Gated DeltaNet prefill in chunked (WY / UT) form on tensor cores: the same map as the
// sequential gdn_prefill_* kernels (cuda/gdn.cu), reorganised per chunk of C tokens so that
// almost all the work is C x C and C x d matrix products (mma.sync m16n8k8 tf32). The math
// and its derivation are in q27py/model/gdn_chunked.py (the numpy specification):
//   G = cumsum(g) in the chunk (log space: every exp below is of a difference <= 0)
//   A_im = b_i e^{G_i - G_m} k_i.k_m (m < i);  M_im = e^{G_i - G_m} (m <= i)
//   R = diag(b) (V - diag(e^G) K S0);  (I + A) U = R   (blockwise: 16 x 16 diagonal inverses)
//   O = diag(e^G) Q S0 + (M o Q K^T) U;  S = e^{G_last} S0 + K^T diag(e^{G_last - G}) U
// One CTA per (value head, 64-column tile of dv); chunks walk in order and the state tile
// [dk x 64] stays in shared memory in fp32 for the whole run, so only the final state goes
// back to global memory.
//
// Precision: every product uses 3xTF32 (a = a_hi + a_lo with both halves tf32; the product
// a_hi b_hi + a_hi b_lo + a_lo b_hi, fp32 accumulate), which is fp32-grade (~2^-22 per product
// instead of tf32's 2^-11). Why: the state is carried across hundreds of chunks and feeds
// every later output; single tf32 (or bf16) errors would enter the state every chunk and
// random-walk with the chunk count (1e-3 .. 1e-2 relative at 32K), whereas prefix snapshots
// and restores need the chunked state within rounding of the sequential one. Only the
// output-only products (Q K^T, Q S0, (M o QK^T) U) could drop to one pass (OUT_PASSES) --
// their error does not compound and the output is rounded to bf16 downstream; kept at 3 until
// measured.
//
// Chunk boundaries sit at absolute positions that are multiples of C (pos0 = position of the
// first lane), so a prefill split into pieces at multiples of C, or restored from a snapshot
// taken at one, computes the same chunks and the same bits as one cold run.
//
// mma.sync m16n8k8 .tf32 fragments (PTX ISA), g = lane >> 2, t = lane & 3:
//   A (16x8, row): a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4)
//   B (8x8, col):  b0 (k=t, n=g), b1 (k=t+4, n=g)
//   C/D (16x8):    d0 (g, 2t), d1 (g, 2t+1), d2 (g+8, 2t), d3 (g+8, 2t+1)
// tests/gpu/test_gdn_chunk.py emulates this layout in numpy (warp_mma below) on the CPU.
#include "common.cuh"

// passes of the output-only products (3 = 3xTF32, 1 = plain tf32); kernel-local, Python never sees it
constexpr int GDN_OUT_PASSES = 3;

__device__ __forceinline__ u32 to_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void mma_tf32_1688(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// x = hi + lo, both tf32 (lo carries the 13 bits tf32 drops, itself rounded to tf32)
__device__ __forceinline__ void split_tf32(float x, u32& hi, u32& lo) {
    hi = to_tf32(x);
    lo = to_tf32(x - __uint_as_float(hi));
}

// d[nt] += A[16 x kdim] * B[kdim x 8] for NT adjacent 8-column tiles, one warp. Strided views of
// shared memory: A(i, k) = A[i * ars + k * acs], B(k, n) = B[k * brs + n * bcs] (n counts from the
// first tile's column 0). kdim % 8 == 0. PASSES 3 = 3xTF32, 1 = plain tf32.
template <int NT, int PASSES>
__device__ __forceinline__ void warp_mma(float (&d)[NT][4], const float* A, int ars, int acs, const float* B, int brs,
                                         int bcs, int kdim) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int k0 = 0; k0 < kdim; k0 += 8) {
        const float* a = A + (k0 + t) * acs;
        u32 ah[4], al[4];
        split_tf32(a[g * ars], ah[0], al[0]);
        split_tf32(a[(g + 8) * ars], ah[1], al[1]);
        split_tf32(a[g * ars + 4 * acs], ah[2], al[2]);
        split_tf32(a[(g + 8) * ars + 4 * acs], ah[3], al[3]);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const float* b = B + (k0 + t) * brs + (nt * 8 + g) * bcs;
            u32 bh0, bl0, bh1, bl1;
            split_tf32(b[0], bh0, bl0);
            split_tf32(b[4 * brs], bh1, bl1);
            if (PASSES == 3) {  // small terms first, then the big one
                mma_tf32_1688(d[nt], al[0], al[1], al[2], al[3], bh0, bh1);
                mma_tf32_1688(d[nt], ah[0], ah[1], ah[2], ah[3], bl0, bl1);
            }
            mma_tf32_1688(d[nt], ah[0], ah[1], ah[2], ah[3], bh0, bh1);
        }
    }
}

// Shared-memory row strides (floats): rows read as the A operand (or as B through a transpose,
// index n * ld + k) want ld = 4 mod 32, rows read as a row-major B (index k * ld + n) want
// ld = 8 mod 32; both make the 32 lanes' fragment loads hit 32 different banks.
template <int DK, int C, int BV>
struct ChunkSmem {
    static constexpr int LDK = DK + 4, LDC = C + 4, LDV = BV + 8, LDT = 16 + 4;
    static constexpr int K = 0, Q = K + C * LDK, S = Q + C * LDK, A = S + DK * LDV, M = A + C * LDC,
                         U = M + C * LDC, G = U + C * LDV, B = G + C, T = B + C, FLOATS = T + C * LDT;
};

template <int DK, int C, int BV, int NW>
__device__ __forceinline__ void gdn_chunk_body(float* __restrict__ state, const float* __restrict__ qkvn,
                                               const float* __restrict__ gb, float* __restrict__ out, int ldo, int H,
                                               int HV, int dv, int nlanes, int pos0) {
    using L = ChunkSmem<DK, C, BV>;
    constexpr int LDK = L::LDK, LDC = L::LDC, LDV = L::LDV, LDT = L::LDT;
    constexpr int MT = C / 16;                // 16-row tiles of a chunk
    constexpr int NPW = BV * MT / (8 * NW);   // 8-column tiles per warp in the [C x BV] products
    constexpr int MTS = DK / 16;              // 16-row tiles of the state
    constexpr int NPS = BV * MTS / (8 * NW);  // 8-column tiles per warp in the state update
    static_assert(NW % MT == 0 && NPW >= 1 && NPW * 8 * (NW / MT) == BV, "chunk tiles must split over the warps");
    static_assert(NW % MTS == 0 && NPS >= 1 && NPS * 8 * (NW / MTS) == BV, "state tiles must split over the warps");
    static_assert(NW * 8 == BV, "blocked solve: one 8-column tile per warp");
    static_assert(C <= 64 && C % 16 == 0 && DK % 16 == 0, "chunk / head shape");
    static_assert(L::Q % 4 == 0 && L::U % 4 == 0 && LDK % 4 == 0 && LDV % 4 == 0, "float4 shared rows");

    extern __shared__ float smem[];
    float* sK = smem + L::K;  // [C][LDK] keys of the chunk (later scaled by e^{G_last - G_i})
    float* sQ = smem + L::Q;  // [C][LDK] queries
    float* sS = smem + L::S;  // [DK][LDV] state tile S[kk][j], fp32, carried over chunks
    float* sA = smem + L::A;  // [C][LDC] strictly lower A
    float* sM = smem + L::M;  // [C][LDC] M o (Q K^T), lower incl. the diagonal
    float* sU = smem + L::U;  // [C][LDV] V, then R, then U
    float* sG = smem + L::G;  // [C] g, then its in-chunk cumulative sum G
    float* sB = smem + L::B;  // [C] beta
    float* sT = smem + L::T;  // [C][LDT] the inverses of A's 16 x 16 diagonal blocks (block b: rows 16b..)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int h = blockIdx.y, j0 = blockIdx.x * BV, kh = h / (HV / H);
    const int dk = DK;
    const i64 ldq = 2 * H * dk + HV * dv;
    const float* qbase = qkvn + kh * dk;
    const float* kbase = qkvn + H * dk + kh * dk;
    const float* vbase = qkvn + 2 * H * dk + h * dv + j0;

    // state tile in: global is K-last [HV][dv][dk] (column j of S contiguous over kk)
    for (int idx = tid; idx < BV * DK; idx += NW * 32) {
        const int j = idx / DK, kk = idx - j * DK;
        sS[kk * LDV + j] = state[(i64)(h * dv + j0 + j) * dk + kk];
    }

    // this warp's tiles of the [C x BV] products (X = K S0, Y = Q S0, O) and of the state update
    const int mt = warp % MT, nb = (warp / MT) * NPW * 8;
    const int mts = warp % MTS, nbs = (warp / MTS) * NPS * 8;

    for (int c0 = 0; c0 < nlanes;) {
        const int n = min(C - (pos0 + c0) % C, nlanes - c0);  // ragged first / last chunk
        __syncthreads();  // the previous chunk (or the state load) is done with every buffer
        // ---- load the chunk; rows n..C-1 are zero (beta = g = 0 there too), so they add nothing.
        // float4 loads: every row start, head offset and shared row stride is a multiple of 4 floats
        // and the host checks the base pointers are 16-byte aligned (kernels.gdn_prefill_chunked).
        for (int idx = tid; idx < C * DK / 4; idx += NW * 32) {
            const int i = idx / (DK / 4), kk = (idx - i * (DK / 4)) * 4;
            float4 kv = make_float4(0.f, 0.f, 0.f, 0.f), qv = kv;
            if (i < n) {
                const i64 row = (i64)(c0 + i) * ldq;
                kv = *reinterpret_cast<const float4*>(kbase + row + kk);
                qv = *reinterpret_cast<const float4*>(qbase + row + kk);
            }
            *reinterpret_cast<float4*>(sK + i * LDK + kk) = kv;
            *reinterpret_cast<float4*>(sQ + i * LDK + kk) = qv;
        }
        for (int idx = tid; idx < C * BV / 4; idx += NW * 32) {
            const int i = idx / (BV / 4), j = (idx - i * (BV / 4)) * 4;
            float4 vv = make_float4(0.f, 0.f, 0.f, 0.f);
            if (i < n) vv = *reinterpret_cast<const float4*>(vbase + (i64)(c0 + i) * ldq + j);
            *reinterpret_cast<float4*>(sU + i * LDV + j) = vv;
        }
        if (tid < C) {
            const bool ok = tid < n;
            sG[tid] = ok ? __ldg(gb + (i64)(c0 + tid) * 2 * HV + h) : 0.f;
            sB[tid] = ok ? __ldg(gb + (i64)(c0 + tid) * 2 * HV + HV + h) : 0.f;
        }
        __syncthreads();
        // ---- ask L2 for the next chunk's rows (k, q, this block's v columns) while this one computes:
        // a chunk's loads are otherwise a full memory latency on the sequential chain.
        {
            constexpr int LQK = DK * 4 / 128, LV = BV * 4 / 128, PER = 2 * LQK + LV;  // 128-byte lines per row
            const int c1 = c0 + n, n1 = min(C, nlanes - c1);
            for (int idx = tid; idx < n1 * PER; idx += NW * 32) {
                const int i = idx / PER, l = idx - i * PER;
                const i64 row = (i64)(c1 + i) * ldq;
                const float* p = l < LQK       ? kbase + row + l * 32
                                 : l < 2 * LQK ? qbase + row + (l - LQK) * 32
                                               : vbase + row + (l - 2 * LQK) * 32;
                asm volatile("prefetch.L2 [%0];" ::"l"(p));
            }
        }
        // ---- G = inclusive cumsum of g over the chunk (warp 0; two halves of 32 for C = 64)
        if (warp == 0) {
            float x0 = sG[lane], x1 = C > 32 ? sG[(lane + 32) % C] : 0.f;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const float y0 = __shfl_up_sync(FULL_MASK, x0, o), y1 = __shfl_up_sync(FULL_MASK, x1, o);
                if (lane >= o) { x0 += y0; x1 += y1; }
            }
            const float half = __shfl_sync(FULL_MASK, x0, 31);
            if (lane < C) sG[lane] = x0;
            if (C > 32) sG[lane + 32] = x1 + half;
        }
        __syncthreads();
        // ---- A = b_i e^{G_i-G_m} K K^T (m < i) and M o Q K^T (m <= i); tiles above the diagonal are zero.
        // The 20 (C = 64) tiles that touch the lower triangle are dealt round-robin over the warps
        // (at most 3 each), the rest (zeros only) by tile index.
        for (int tile = 0, lower_seen = 0; tile < MT * (C / 8); tile++) {
            const int tm = tile / (C / 8), tn = tile - tm * (C / 8);
            const bool lower = tn * 8 <= tm * 16 + 15;
            const int owner = lower ? lower_seen++ % NW : tile % NW;  // the same count in every warp
            if (owner != warp) continue;
            float kk[1][4] = {{0.f, 0.f, 0.f, 0.f}}, qk[1][4] = {{0.f, 0.f, 0.f, 0.f}};
            if (lower) {  // warp-uniform
                warp_mma<1, 3>(kk, sK + tm * 16 * LDK, LDK, 1, sK + tn * 8 * LDK, 1, LDK, DK);
                warp_mma<1, GDN_OUT_PASSES>(qk, sQ + tm * 16 * LDK, LDK, 1, sK + tn * 8 * LDK, 1, LDK, DK);
            }
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = tm * 16 + g + (e >> 1) * 8, m = tn * 8 + 2 * t4 + (e & 1);
                const float dec = m <= i ? expf(sG[i] - sG[m]) : 0.f;
                sA[i * LDC + m] = m < i ? sB[i] * dec * kk[0][e] : 0.f;
                sM[i * LDC + m] = dec * qk[0][e];
            }
        }
        // ---- X = K S0, Y = Q S0 on this warp's [16 x 8*NPW] tile; R = b (V - e^G X) in place of V
        float x[NPW][4], y[NPW][4];
#pragma unroll
        for (int nt = 0; nt < NPW; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) x[nt][e] = y[nt][e] = 0.f;
        warp_mma<NPW, 3>(x, sK + mt * 16 * LDK, LDK, 1, sS + nb, LDV, 1, DK);
        warp_mma<NPW, GDN_OUT_PASSES>(y, sQ + mt * 16 * LDK, LDK, 1, sS + nb, LDV, 1, DK);
#pragma unroll
        for (int nt = 0; nt < NPW; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = mt * 16 + g + (e >> 1) * 8, j = nb + nt * 8 + 2 * t4 + (e & 1);
                const float eg = expf(sG[i]);
                float* r = sU + i * LDV + j;  // this lane alone reads V here and writes R
                *r = sB[i] * (*r - eg * x[nt][e]);
                y[nt][e] *= eg;  // diag(e^G) Q S0, kept in registers until the output
            }
        __syncthreads();
        // ---- T_b = (I + A_bb)^-1 for the 16 x 16 diagonal blocks (state-independent): one thread per
        // column of a block, T[i][j] = delta_ij - sum_{m<i} A[i][m] T[m][j], unrolled into registers
        if (tid < C) {
            const int b = tid >> 4, jj = tid & 15;
            const float* a = sA + b * 16 * LDC + b * 16;
            float tc[16];
#pragma unroll
            for (int i = 0; i < 16; i++) {
                float acc = i == jj ? 1.f : 0.f;
#pragma unroll
                for (int m = 0; m < i; m++) acc = fmaf(-a[i * LDC + m], tc[m], acc);
                tc[i] = acc;
            }
#pragma unroll
            for (int i = 0; i < 16; i++) sT[(b * 16 + i) * LDT + jj] = tc[i];
        }
        __syncthreads();
        // ---- (I + A) U = R blockwise: U_b = T_b (R_b - A_{b,<b} U_{<b}), b = 0..C/16-1, in place in sU.
        // Warp w owns value columns 8w..8w+7 for the whole solve (reads and writes only those), so
        // the block steps need no block barrier. The chain is C/16 steps of tensor-core products
        // instead of C dependent rows.
        {
            const int nw = warp * 8;
            for (int b = 0; b < MT; b++) {
                float z[1][4] = {{0.f, 0.f, 0.f, 0.f}};
                if (b) warp_mma<1, 3>(z, sA + b * 16 * LDC, LDC, 1, sU + nw, LDV, 1, b * 16);
#pragma unroll
                for (int e = 0; e < 4; e++) {  // Z_b = R_b - A_{b,<b} U_{<b}, over R_b
                    float* r = sU + (b * 16 + g + (e >> 1) * 8) * LDV + nw + 2 * t4 + (e & 1);
                    *r -= z[0][e];
                }
                __syncwarp();
                float u[1][4] = {{0.f, 0.f, 0.f, 0.f}};
                warp_mma<1, 3>(u, sT + b * 16 * LDT, LDT, 1, sU + b * 16 * LDV + nw, LDV, 1, 16);
                __syncwarp();  // every lane has read Z_b before U_b overwrites it
#pragma unroll
                for (int e = 0; e < 4; e++) sU[(b * 16 + g + (e >> 1) * 8) * LDV + nw + 2 * t4 + (e & 1)] = u[0][e];
                __syncwarp();
            }
        }
        __syncthreads();
        // ---- O = diag(e^G) Q S0 + (M o Q K^T) U: M is lower triangular, so k stops at this tile's rows
        warp_mma<NPW, GDN_OUT_PASSES>(y, sM + mt * 16 * LDC, LDC, 1, sU + nb, LDV, 1, (mt + 1) * 16);
#pragma unroll
        for (int nt = 0; nt < NPW; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = mt * 16 + g + (e >> 1) * 8, j = nb + nt * 8 + 2 * t4 + (e & 1);
                if (i < n) out[(i64)(c0 + i) * ldo + h * dv + j0 + j] = y[nt][e];
            }
        // K rows scaled by e^{G_last - G_i} for the state update (no one reads sK after the barrier above)
        const float glast = sG[n - 1];
        for (int idx = tid; idx < C * DK; idx += NW * 32) {
            const int i = idx / DK, kk = idx - i * DK;
            sK[i * LDK + kk] *= expf(glast - sG[i]);
        }
        __syncthreads();
        // ---- S = e^{G_last} S0 + (scaled K)^T U on this warp's [16 x 8*NPS] state tile
        {
            const float eg = expf(glast);
            float s[NPS][4];
#pragma unroll
            for (int nt = 0; nt < NPS; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int kk = mts * 16 + g + (e >> 1) * 8, j = nbs + nt * 8 + 2 * t4 + (e & 1);
                    s[nt][e] = eg * sS[kk * LDV + j];
                }
            // A(i = key dim, k = token) = sK[token][key dim]; B(k = token, n) = U[token][n]
            warp_mma<NPS, 3>(s, sK + mts * 16, 1, LDK, sU + nbs, LDV, 1, (n + 7) & ~7);
#pragma unroll
            for (int nt = 0; nt < NPS; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int kk = mts * 16 + g + (e >> 1) * 8, j = nbs + nt * 8 + 2 * t4 + (e & 1);
                    sS[kk * LDV + j] = s[nt][e];  // only this lane read this element (above)
                }
        }
        c0 += n;
    }
    __syncthreads();
    for (int idx = tid; idx < BV * DK; idx += NW * 32) {
        const int j = idx / DK, kk = idx - j * DK;
        state[(i64)(h * dv + j0 + j) * dk + kk] = sS[kk * LDV + j];
    }
}

// grid (dv / 64, HV), block 256, dynamic shared memory ChunkSmem<DK, C, 64>::FLOATS * 4 bytes.
// Same contract as gdn_prefill_*: emits o for every lane, writes the final state.
#define GDN_CHUNK_KERNEL(NAME, DK, C)                                                                              \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                          \
        NAME(float* state, const float* qkvn, const float* gb, float* out, int ldo, int H, int HV, int dv,         \
             int nlanes, int pos0) {                                                                              \
        gdn_chunk_body<DK, C, 64, 8>(state, qkvn, gb, out, ldo, H, HV, dv, nlanes, pos0);                         \
    }

GDN_CHUNK_KERNEL(gdn_chunk_d128_c64, 128, 64)
GDN_CHUNK_KERNEL(gdn_chunk_d128_c32, 128, 32)
GDN_CHUNK_KERNEL(gdn_chunk_d64_c64, 64, 64)
GDN_CHUNK_KERNEL(gdn_chunk_d64_c32, 64, 32)
