// Gated DeltaNet prefill as a three-kernel pipeline (route "chunked2"; the one-kernel form is
// cuda/gdn_chunk.cu). Same map, same chunk alignment and the same fp32-grade products (3xTF32
// mma.sync m16n8k8) as gdn_chunk.cu, but only the state recurrence runs chunk after chunk:
//   1. gdn2_prep  (grid chunks x value heads, all parallel): G = cumsum g, A = strict-lower
//      b_i e^{G_i-G_m} k_i.k_m, (I+A) [W | U] = [diag(b e^G) K | diag(b) V] by blockwise
//      substitution (16 x 16 diagonal inverses, then tensor-core block steps), written to scratch
//      with G and ED_i = e^{G_last - G_i}.
//   2. gdn2_state (grid dv/64 x value heads, sequential over chunks): per chunk
//      V_new = U - W S_c, S_{c+1} = e^{G_last} S_c + K^T diag(ED) V_new; S_c and V_new go to
//      scratch; the next chunk's W, K, U, gates stream in by cp.async (double buffer where the
//      shared memory holds two stages: sm_80 / sm_90).
//   3. gdn2_out   (grid chunks x value heads, all parallel): O = diag(e^G) Q S_c + (M o Q K^T) V_new.
// Spec: q27py/model/gdn_chunked.py (gdn_chunked_wy); lane-level CPU emulation:
// tests/gpu/gdn_chunk2_emu.py.
//
// Why the state is kept transposed in registers: gdn2_state holds S^T (rows = value columns j,
// cols = key dims) in mma C-fragment registers for the whole run, 16 value rows per warp. A C
// fragment (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1) is a valid A fragment of the next product
// once the k index is permuted (logical k = t <-> physical column 2t, t + 4 <-> 2t + 1): the sum
// over k does not care about its order as long as the B operand uses the same permutation. So
// S^T feeds V_new^T = U^T - S^T W^T straight from registers, V_new^T (a C fragment too) feeds
// S^T += V_new^T diag(ED) K, and no state byte touches shared memory inside the loop. The
// per-chunk scratch (U / V_new, S_c) is stored in that "fragment-native" order
// ([row block of 16][col block of 8][32 lanes][4]) so every warp reads and writes it with
// coalesced 16-byte accesses.
//
// Precision: every product is 3xTF32 (a_hi b_hi + a_hi b_lo + a_lo b_hi, fp32 accumulate,
// ~2^-22 per product): the state path (W S_c, K^T V_new, and W / U through the solve) compounds
// over hundreds of chunks, and the output products are held to the same 2e-5 class as the
// sequential kernel (single-pass tf32 would be ~5e-4 relative there). Two opt-in classes run P = 1 (one TF32
// product a mma, mma_p): the output pass alone (gdn2_out1_*, "tf32 out": the state bitwise the 3xTF32 run's), and
// the pre-pass and the state recurrence (gdn2_prep1_* / gdn2_state1_*_w8, "tf32 state": W, U, V_new, every S_c
// and the final state within ~5e-4 relative of the fp32-grade run, no growth with the chunk count in the spec's
// study: docs/QUANT.md). Spec of both: gdn_chunked_wy(tf32=...).
//
// Chunk boundaries sit at absolute positions that are multiples of GDN2_C (pos0 = position of the
// first lane): a prefill split into pieces at multiples of GDN2_C gives the same bits as one run.
// Scratch is chunk-padded: chunk ci owns rows ci * GDN2_C .. + GDN2_C - 1 of W, U, gates (rows
// past the chunk's n tokens hold zeros / flat gates and contribute nothing).
//
// mma.sync m16n8k8 .tf32 fragments (PTX ISA), g = lane >> 2, t = lane & 3:
//   A (16x8, row): a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4)
//   B (8x8, col):  b0 (k=t, n=g), b1 (k=t+4, n=g)
//   C/D (16x8):    d0 (g, 2t), d1 (g, 2t+1), d2 (g+8, 2t), d3 (g+8, 2t+1)
#include "common.cuh"

// cvt.rna.tf32.f32 (nearest, ties away from zero) for finite x as two integer ops: adding half a
// tf32 ulp to the magnitude bits and masking is exactly rna. Why not the PTX cvt: on sm_80+ it
// lowers to four instructions (an |x| >= inf test and a select around the same add and mask),
// and the splits below are most of the state pass's instruction issue (768 mma vs ~5,000 other
// instructions per chunk and warp before this).
__device__ __forceinline__ u32 to_tf32(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }

__device__ __forceinline__ void split_tf32(float x, u32& hi, u32& lo) {
    hi = to_tf32(x);
    lo = to_tf32(x - __uint_as_float(hi));
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a b in 3xTF32 from split operands: small terms first, then the big one
__device__ __forceinline__ void mma3(float (&d)[4], const u32 (&ah)[4], const u32 (&al)[4], float b0, float b1) {
    u32 bh0, bl0, bh1, bl1;
    split_tf32(b0, bh0, bl0);
    split_tf32(b1, bh1, bl1);
    mma_tf32(d, al, bh0, bh1);
    mma_tf32(d, ah, bl0, bl1);
    mma_tf32(d, ah, bh0, bh1);
}

// mma3 with b already split (hi / lo as from split_tf32): the same three products in the same order
__device__ __forceinline__ void mma3_split_b(float (&d)[4], const u32 (&ah)[4], const u32 (&al)[4], u32 bh0, u32 bl0,
                                             u32 bh1, u32 bl1) {
    mma_tf32(d, al, bh0, bh1);
    mma_tf32(d, ah, bl0, bl1);
    mma_tf32(d, ah, bh0, bh1);
}

// d += a b in P passes: 3 = mma3 (the fp32-grade class), 1 = one TF32 product of the operands' hi halves (the
// output pass's "tf32" class, EngineConfig.prefill_gdn_out_tf32: O within ~1e-3 relative, under the bf16 rounding of
// the output projection's input that follows). With P = 1 the lo halves of a are never read, so they are not made.
template <int P>
__device__ __forceinline__ void mma_p(float (&d)[4], const u32 (&ah)[4], const u32 (&al)[4], float b0, float b1) {
    if constexpr (P == 1)
        mma_tf32(d, ah, to_tf32(b0), to_tf32(b1));
    else
        mma3(d, ah, al, b0, b1);
}

// A fragment (split) from four row-fragment values in a0..a3 order
__device__ __forceinline__ void split_a(float a0, float a1, float a2, float a3, u32 (&h)[4], u32 (&l)[4]) {
    split_tf32(a0, h[0], l[0]);
    split_tf32(a1, h[1], l[1]);
    split_tf32(a2, h[2], l[2]);
    split_tf32(a3, h[3], l[3]);
}

// A fragment from a C-fragment tile, k permuted (column 2t -> k t, column 2t + 1 -> k t + 4)
__device__ __forceinline__ void split_ctile(const float (&c)[4], u32 (&h)[4], u32 (&l)[4]) {
    split_a(c[0], c[2], c[1], c[3], h, l);
}

// Standard-layout product for the solve: d[nt] += A[16 x kdim] B[kdim x 8 NT], row strides ars / brs; P products a
// mma (mma_p).
template <int NT, int P = 3>
__device__ __forceinline__ void warp_mma_std(float (&d)[NT][4], const float* A, int ars, const float* B, int brs,
                                             int kdim) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int k0 = 0; k0 < kdim; k0 += 8) {
        const float* a = A + k0 + t;
        u32 ah[4], al[4];
        split_a(a[g * ars], a[(g + 8) * ars], a[g * ars + 4], a[(g + 8) * ars + 4], ah, al);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const float* b = B + (k0 + t) * brs + nt * 8 + g;
            mma_p<P>(d[nt], ah, al, b[0], b[4 * brs]);
        }
    }
}

// Swizzles of dense [C][D] fp32 tiles (D a multiple of 32) that make the fragment reads
// conflict-free without padding (both keep 4-float groups whole, so cp.async 16-byte copies work):
//   sw_row: float2 reads of (row base + g, col 8s + 2t): XOR bits 3-4 of the column with row & 3
//   sw_col: 4-byte reads of (row 8m + 2t (+1), col 8s + g): XOR with (row >> 1) & 3
__device__ __forceinline__ int sw_row(int row, int col) { return col ^ ((row & 3) << 3); }
__device__ __forceinline__ int sw_col(int row, int col) { return col ^ (((row >> 1) & 3) << 3); }

// The 20 16 x 8 tiles of a C x C (C = 64) product that touch its lower triangle, as 8 segments of
// one row block tm each (column tiles tn0 .. tn0 + nn - 1, 2-3 of them). Why segments: a warp that
// owns a whole segment splits each A fragment (rows of block tm) once for all its tiles, where a
// round-robin deal of single tiles split it once per tile (the A split was 2/3 of the product's
// instructions). Per-tile arithmetic and order are unchanged, so the bits are too.
__device__ __forceinline__ void lower_segment(int v, int& tm, int& tn0, int& nn) {
    tm = v < 3 ? 3 : v < 5 ? 2 : v < 7 ? 1 : 0;
    tn0 = v == 1 || v == 4 ? 3 : v == 2 ? 6 : v == 6 ? 2 : 0;
    nn = v == 2 || v >= 5 ? 2 : 3;
}

// d[j] += (rows 16 tm.. of X)(rows 8 (tn0 + j).. of Y)^T over kdim for j < nn, X and Y row-major
// [C][ld] tiles read as float2 along their rows (k permuted), columns through swz(row, col).
template <int KT, int P = 3, typename Swz>
__device__ __forceinline__ void segment_xyt(float (&d)[3][4], const float* X, const float* Y, int ld, int tm,
                                            int tn0, int nn, Swz swz) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < 3; j++) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.f;
#pragma unroll 4
    for (int s = 0; s < KT; s++) {
        const int ra = tm * 16 + g, col = 8 * s + 2 * t;
        const float2 a02 = *reinterpret_cast<const float2*>(X + ra * ld + swz(ra, col));
        const float2 a13 = *reinterpret_cast<const float2*>(X + (ra + 8) * ld + swz(ra + 8, col));
        u32 ah[4], al[4];
        split_a(a02.x, a13.x, a02.y, a13.y, ah, al);
#pragma unroll
        for (int j = 0; j < 3; j++) {
            if (j >= nn) continue;
            const int rb = (tn0 + j) * 8 + g;
            const float2 b = *reinterpret_cast<const float2*>(Y + rb * ld + swz(rb, col));
            mma_p<P>(d[j], ah, al, b.x, b.y);
        }
    }
}

// First lane and length of chunk ci of a run of nlanes lanes starting at absolute position pos0.
__device__ __forceinline__ void chunk_span(int ci, int nlanes, int pos0, int& c0, int& n) {
    const int first = GDN2_C - pos0 % GDN2_C;  // chunk 0 may be ragged
    c0 = ci == 0 ? 0 : first + (ci - 1) * GDN2_C;
    n = min(nlanes, ci == 0 ? first : c0 + GDN2_C) - c0;
}

// Inclusive prefix sum G of sG[0..C) by warp 0 (two halves of 32, the same order everywhere), in
// double, kept as two floats: sG = hi = fp32(G), sGl = lo = fp32(G - hi).
// Why: G reaches |G| ~ 1e3 within a chunk under strong decays, and an fp32 G_i - G_m then carries
// ~|G| 2^-24 ~ 1e-4 of absolute error into e^{G_i - G_m}: a relative error of 1e-5..1e-4 on every
// decay factor of the chunk (the 2e-5 failures of the strong-decay device tests, 50x the sequential
// kernel's error on those heads). gdiff() below recovers G_i - G_m to ~2^-24 of itself.
__device__ __forceinline__ void chunk_cumsum(float* sG, float* sGl) {
    const int lane = threadIdx.x & 31;
    double x0 = sG[lane], x1 = sG[lane + 32];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double y0 = __shfl_up_sync(FULL_MASK, x0, o), y1 = __shfl_up_sync(FULL_MASK, x1, o);
        if (lane >= o) {
            x0 += y0;
            x1 += y1;
        }
    }
    x1 += __shfl_sync(FULL_MASK, x0, 31);
    const float h0 = __double2float_rn(x0), h1 = __double2float_rn(x1);
    sG[lane] = h0;
    sG[lane + 32] = h1;
    sGl[lane] = __double2float_rn(x0 - h0);
    sGl[lane + 32] = __double2float_rn(x1 - h1);
}

// G_i - G_m from the two-float G: hi_i - hi_m is exact when the two lie within a factor 2 of each
// other (Sterbenz), i.e. whenever the difference is small against |G|; otherwise the difference is
// itself of the order of |G| and its own fp32 rounding is the only error.
__device__ __forceinline__ float gdiff(const float* hi, const float* lo, int i, int m) {
    return (hi[i] - hi[m]) + (lo[i] - lo[m]);
}

// ------------------------------------------------------------------------------------------------
// 1. Pre-pass: one CTA (8 warps) per (chunk, value head). P: products a mma (3: gdn2_prep_*, 1: gdn2_prep1_*, the
// "tf32 state" class).
template <int DK, int DV>
struct PrepSmem {
    static constexpr int C = GDN2_C, LDY = DK + DV + 8, LDA = C + 4, LDT = 16 + 4;
    static constexpr int Y = 0, A = Y + C * LDY, T = A + C * LDA, G = T + C * LDT, GL = G + C, B = GL + C,
                         RS = B + C, FLOATS = RS + C;
};

template <int DK, int DV, int P = 3>
__device__ __forceinline__ void prep_body(const float* __restrict__ qkvn, const float* __restrict__ gb,
                                          float* __restrict__ wsc, float* __restrict__ usc, float* __restrict__ gsc,
                                          int H, int HV, int nlanes, int pos0, int nchunks) {
    using L = PrepSmem<DK, DV>;
    constexpr int C = GDN2_C, LDY = L::LDY, LDA = L::LDA, LDT = L::LDT, NW = 8, MT = C / 16;
    constexpr int NT = (DK + DV) / (8 * NW);  // 8-column tiles of [W | U] per warp in the solve
    static_assert(C == 64 && NT * 8 * NW == DK + DV && DK % 32 == 0 && DV % 16 == 0, "prep shape");
    extern __shared__ float smem[];
    float* sY = smem + L::Y;  // [C][LDY]: K | V, then diag(b e^G) K | diag(b) V, then W | U
    float* sA = smem + L::A;  // [C][LDA] strictly lower A
    float* sT = smem + L::T;  // [C][LDT] inverses of A's 16 x 16 diagonal blocks
    float* sG = smem + L::G;    // G hi
    float* sGl = smem + L::GL;  // G lo
    float* sB = smem + L::B;
    float* sRS = smem + L::RS;  // b e^G: the K rows' right-hand-side scale
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int ci = blockIdx.x, h = blockIdx.y, kh = h / (HV / H);
    int c0, n;
    chunk_span(ci, nlanes, pos0, c0, n);
    const i64 ldq = 2 * H * DK + HV * DV;
    const float* kbase = qkvn + H * DK + kh * DK;
    const float* vbase = qkvn + 2 * H * DK + h * DV;
    for (int idx = tid; idx < C * (DK + DV) / 4; idx += NW * 32) {
        const int i = idx / ((DK + DV) / 4), c = (idx - i * ((DK + DV) / 4)) * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i < n) {
            const i64 row = (i64)(c0 + i) * ldq;
            v = *reinterpret_cast<const float4*>(c < DK ? kbase + row + c : vbase + row + (c - DK));
        }
        *reinterpret_cast<float4*>(sY + i * LDY + c) = v;
    }
    if (tid < C) {
        const bool ok = tid < n;
        sG[tid] = ok ? __ldg(gb + (i64)(c0 + tid) * 2 * HV + h) : 0.f;  // pad rows: g = 0 (gates stay flat)
        sB[tid] = ok ? __ldg(gb + (i64)(c0 + tid) * 2 * HV + HV + h) : 0.f;
    }
    __syncthreads();
    if (warp == 0) chunk_cumsum(sG, sGl);
    __syncthreads();
    // A from K K^T on the 20 16 x 8 tiles touching the lower triangle (segment `warp`: NW == 8); the
    // 12 tiles above it are never read, zeroed anyway (round-robin)
    static_assert(NW == 8, "one lower segment per warp");
    {
        int tm, tn0, nn;
        lower_segment(warp, tm, tn0, nn);
        float kk[3][4];
        segment_xyt<DK / 8, P>(kk, sY, sY, LDY, tm, tn0, nn, [](int, int c) { return c; });
#pragma unroll
        for (int j = 0; j < 3; j++) {
            if (j >= nn) continue;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = tm * 16 + g + (e >> 1) * 8, m = (tn0 + j) * 8 + 2 * t + (e & 1);
                sA[i * LDA + m] = m < i ? sB[i] * expf(gdiff(sG, sGl, i, m)) * kk[j][e] : 0.f;
            }
        }
        for (int tile = warp; tile < MT * (C / 8); tile += NW) {
            const int tm2 = tile / (C / 8), tn = tile - tm2 * (C / 8);
            if (tn * 8 <= tm2 * 16 + 15) continue;
#pragma unroll
            for (int e = 0; e < 4; e++) sA[(tm2 * 16 + g + (e >> 1) * 8) * LDA + tn * 8 + 2 * t + (e & 1)] = 0.f;
        }
    }
    if (tid < C) {  // gates for the other two kernels: G hi, G lo, ED = e^{G_last - G} (G_last = G[C-1]:
                    // pads are flat), EG = e^G
        float* gs = gsc + ((i64)h * nchunks + ci) * GDN2_GATES * C;
        const float eg = expf(sG[tid] + sGl[tid]);
        gs[tid] = sG[tid];
        gs[C + tid] = sGl[tid];
        gs[2 * C + tid] = expf(gdiff(sG, sGl, C - 1, tid));
        gs[3 * C + tid] = eg;
        sRS[tid] = sB[tid] * eg;
    }
    __syncthreads();
    if (tid < C) {  // T_b = (I + A_bb)^-1, one thread per column of a block
        const int b = tid >> 4, jj = tid & 15;
        const float* a = sA + b * 16 * LDA + b * 16;
        float tc[16];
#pragma unroll
        for (int i = 0; i < 16; i++) {
            float acc = i == jj ? 1.f : 0.f;
#pragma unroll
            for (int m = 0; m < i; m++) acc = fmaf(-a[i * LDA + m], tc[m], acc);
            tc[i] = acc;
        }
#pragma unroll
        for (int i = 0; i < 16; i++) sT[(b * 16 + i) * LDT + jj] = tc[i];
    }
    for (int idx = tid; idx < C * (DK + DV); idx += NW * 32) {  // right-hand sides, in place
        const int i = idx / (DK + DV), c = idx - i * (DK + DV);
        sY[i * LDY + c] *= c < DK ? sRS[i] : sB[i];
    }
    __syncthreads();
    // (I + A) Y = X blockwise: Y_b = T_b (X_b - A_{b,<b} Y_{<b}); warp w owns columns [8 NT w, 8 NT (w+1))
    {
        float* yw = sY + warp * NT * 8;
        for (int b = 0; b < MT; b++) {
            float z[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) z[nt][0] = z[nt][1] = z[nt][2] = z[nt][3] = 0.f;
            if (b) warp_mma_std<NT, P>(z, sA + b * 16 * LDA, LDA, yw, LDY, b * 16);
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    yw[(b * 16 + g + (e >> 1) * 8) * LDY + nt * 8 + 2 * t + (e & 1)] -= z[nt][e];
            __syncwarp();
            float u[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) u[nt][0] = u[nt][1] = u[nt][2] = u[nt][3] = 0.f;
            warp_mma_std<NT, P>(u, sT + b * 16 * LDT, LDT, yw + b * 16 * LDY, LDY, 16);
            __syncwarp();  // every lane has read Z_b before Y_b overwrites it
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) yw[(b * 16 + g + (e >> 1) * 8) * LDY + nt * 8 + 2 * t + (e & 1)] = u[nt][e];
            __syncwarp();
        }
    }
    __syncthreads();
    float* w = wsc + ((i64)h * nchunks + ci) * C * DK;  // W rows, dense [C][DK]
    for (int idx = tid; idx < C * DK / 4; idx += NW * 32) {
        const int i = idx / (DK / 4), c = (idx - i * (DK / 4)) * 4;
        *reinterpret_cast<float4*>(w + i * DK + c) = *reinterpret_cast<const float4*>(sY + i * LDY + c);
    }
    float* u = usc + ((i64)h * nchunks + ci) * C * DV;  // U^T, fragment-native [DV/16][C/8][32][4]
    for (int idx = tid; idx < C * DV; idx += NW * 32) {
        const int e = idx & 3, ln = (idx >> 2) & 31, cb = (idx >> 7) & (C / 8 - 1), rb = idx >> 10;
        const int j = rb * 16 + (ln >> 2) + (e >> 1) * 8, tok = cb * 8 + 2 * (ln & 3) + (e & 1);
        u[idx] = sY[tok * LDY + DK + j];
    }
}

// ------------------------------------------------------------------------------------------------
// 2. State recurrence: one CTA (GDN2_BV / 16 warps) per (64 value columns, value head).
// PRESPLIT (where shared memory holds one more 2 C DK-float buffer: sm_90 with two stages, sm_80 with
// one): after a chunk's stage lands, the CTA splits its W and K into tf32 hi (in place) and lo (the
// extra buffer) once, instead of every warp splitting every B operand at each use (4 warps x 2 splits
// per mma3: 512 splits per lane and chunk, most of the loop's non-mma instructions). The same
// split_tf32 of the same values feeding the same products in the same order: bitwise the plain form.
// K's hi / lo are stored as row pairs (K[r0][c], K[r0 + 1][c]) so the update reads each B fragment
// pair with one 8-byte load (see k_pair_slot).
template <int DK>
struct StateSmem {
    static constexpr int C = GDN2_C;
    static constexpr int W = 0, K = W + C * DK, U = K + C * DK, E = U + C * GDN2_BV, STAGE = E + 2 * C;
    static constexpr int LO = 2 * C * DK;  // the presplit lo buffer: W lo at W, K lo at K (offsets as a stage)
};

// K's presplit pair layout. Rows r0 (even) and r0 + 1, column octet o (logical columns 8o .. 8o + 7):
// their 16 floats live in 4 16-byte slots (row r0 / r0 + 1 x logical columns 8o / 8o + 4, each at its
// sw_col position); slot q holds the pairs of columns 8o + 2q and 8o + 2q + 1, as
// (K[r0][c], K[r0 + 1][c], K[r0][c + 1], K[r0 + 1][c + 1]). The float offset of column c's pair:
__device__ __forceinline__ int k_pair_at(int r0, int c, int dk) {
    const int q = (c & 7) >> 1;
    return (r0 + (q >> 1)) * dk + sw_col(r0, (c & ~7) + 4 * (q & 1)) + 2 * (c & 1);
}
// Why conflict-free: a half warp (g < 4 or g >= 4, t = 0..3) reads for each t the two slots of one row
// (8 consecutive banks after the swizzle), and the swizzle gives the 4 values of t 4 distinct 8-bank
// groups ((r0 >> 1) & 3 == t for r0 = 8m + 2t).

// Chunk ci's W (sw_row), K (sw_col, zero rows past the chunk), U^T (this CTA's rows, fragment-native) and gates
// (ED, EG) into the stage at `base`, by NT threads (thread tid), as one cp.async group.
template <int DK, int NT>
__device__ __forceinline__ void state_issue(float* base, const float* __restrict__ wsc, const float* __restrict__ usc,
                                            const float* __restrict__ gsc, const float* kbase, i64 ldq, int h, int j0,
                                            int dv, int ci, int nlanes, int pos0, int nchunks, int tid) {
    using L = StateSmem<DK>;
    constexpr int C = GDN2_C, BV = GDN2_BV;
    int c0, n;
    chunk_span(ci, nlanes, pos0, c0, n);
    const float* w = wsc + ((i64)h * nchunks + ci) * C * DK;
    for (int idx = tid; idx < C * DK / 4; idx += NT) {
        const int i = idx / (DK / 4), c = (idx - i * (DK / 4)) * 4;
        cp_async_cg16(base + L::W + i * DK + sw_row(i, c), w + i * DK + c);
        const bool ok = i < n;
        // 16 zero bytes past the chunk's last row (src still a valid address)
        cp_async_cg16_zfill(base + L::K + i * DK + sw_col(i, c), kbase + (ok ? (i64)(c0 + i) * ldq + c : 0), ok ? 16 : 0);
    }
    const float* u = usc + ((i64)h * nchunks + ci) * C * dv + (i64)j0 * C;
    for (int idx = tid; idx < C * BV / 4; idx += NT) cp_async_cg16(base + L::U + idx * 4, u + idx * 4);
    const float* e = gsc + ((i64)h * nchunks + ci) * GDN2_GATES * C + 2 * C;  // ED, EG
    for (int idx = tid; idx < 2 * C / 4; idx += NT) cp_async_cg16(base + L::E + idx * 4, e + idx * 4);
    cp_async_commit();
}

// The 8-warp state pass's presplit operands (state8_body), by NT threads (thread tid) of a landed, visible stage.
// W: tf32 hi in place, lo at wlo (same positions), elementwise, 16 bytes at a time.
template <int DK, int NT>
__device__ __forceinline__ void state_split_w(float* stage, float* wlo, int tid) {
    using L = StateSmem<DK>;
    constexpr int C = GDN2_C;
    u32* wh = reinterpret_cast<u32*>(stage + L::W);
    u32* wl = reinterpret_cast<u32*>(wlo);
    for (int idx = tid * 4; idx < C * DK; idx += NT * 4) {
        const float4 v = *reinterpret_cast<const float4*>(wh + idx);
        uint4 hi, lo;
        split_tf32(v.x, hi.x, lo.x);
        split_tf32(v.y, hi.y, lo.y);
        split_tf32(v.z, hi.z, lo.z);
        split_tf32(v.w, hi.w, lo.w);
        *reinterpret_cast<uint4*>(wh + idx) = hi;
        *reinterpret_cast<uint4*>(wl + idx) = lo;
    }
}

// K: hi in place and lo at klo, rewritten as row pairs (k_pair_at), one (row pair r0, column octet) unit at a time:
// the unit's 4 slots (rows r0 / r0 + 1 x octet halves 0 / 1) are read, then the same 4 written as pairs. Unlike
// state_body's loop (every lane on the same slot of its unit: the 8 lanes of a quarter warp hit only the 4 even
// 16-byte bank groups, 2-way conflicts on all 12 accesses), lanes 4-7 of each quarter warp take the two halves in
// the other order (sw = 1), so each 16-byte read and write covers all 32 banks; the slot contents are chosen by sw
// (16 selects per unit) and the values written are the same. LO = false (the one-TF32-product pass): the hi halves
// alone, in place (to_tf32, the value split_tf32's hi is), klo not written.
template <int DK, int NT, bool LO = true>
__device__ __forceinline__ void state_split_k(float* stage, float* klo, int tid) {
    using L = StateSmem<DK>;
    constexpr int C = GDN2_C;
    static_assert(DK / 8 >= 8 && NT % 8 == 0, "a quarter warp on 8 octets of one row pair");
    u32* kh = reinterpret_cast<u32*>(stage + L::K);
    u32* kl = reinterpret_cast<u32*>(klo);
    const bool sw = (tid >> 2) & 1;
    for (int u = tid; u < (C / 2) * (DK / 8); u += NT) {
        const int r0 = 2 * (u / (DK / 8)), c = 8 * (u - (u / (DK / 8)) * (DK / 8));
        // a0: this lane's first half (sw) of the octet in row r0, a1 the other; + DK: row r0 + 1
        const int a0 = r0 * DK + sw_col(r0, c + (sw ? 4 : 0)), a1 = r0 * DK + sw_col(r0, c + (sw ? 0 : 4));
        const float4 A = *reinterpret_cast<const float4*>(kh + a0), B = *reinterpret_cast<const float4*>(kh + a1);
        const float4 Cr = *reinterpret_cast<const float4*>(kh + a0 + DK);
        const float4 D = *reinterpret_cast<const float4*>(kh + a1 + DK);
        // slot contents (K[r0][c'], K[r0 + 1][c'], K[r0][c' + 1], K[r0 + 1][c' + 1]): from the first half's columns
        // 0-1 (P), 2-3 (X), the second half's 0-1 (Y), 2-3 (V)
        const float P[4] = {A.x, Cr.x, A.y, Cr.y}, X[4] = {A.z, Cr.z, A.w, Cr.w};
        const float Y[4] = {B.x, D.x, B.y, D.y}, V[4] = {B.z, D.z, B.w, D.w};
        // written to: row r0 half sw, row r0 half !sw, row r0 + 1 half sw, row r0 + 1 half !sw
        const int at[4] = {a0, a1, a0 + DK, a1 + DK};
#pragma unroll
        for (int q = 0; q < 4; q++) {
            float x[4];
#pragma unroll
            for (int e = 0; e < 4; e++)
                x[e] = q == 0   ? (sw ? V[e] : P[e])
                       : q == 1 ? (sw ? Y[e] : X[e])
                       : q == 2 ? (sw ? X[e] : Y[e])
                                : (sw ? P[e] : V[e]);
            if constexpr (LO) {
                uint4 hi, lo;
                split_tf32(x[0], hi.x, lo.x);
                split_tf32(x[1], hi.y, lo.y);
                split_tf32(x[2], hi.z, lo.z);
                split_tf32(x[3], hi.w, lo.w);
                *reinterpret_cast<uint4*>(kh + at[q]) = hi;
                *reinterpret_cast<uint4*>(kl + at[q]) = lo;
            } else {
                *reinterpret_cast<uint4*>(kh + at[q]) = make_uint4(to_tf32(x[0]), to_tf32(x[1]), to_tf32(x[2]),
                                                                   to_tf32(x[3]));
            }
        }
    }
}

// The state pass's two products, shared by state_body (4 warps) and state8_body (8 warps): the same split
// operands, the same k order, the same per-element ops in both.
// p[nt] += S^T W^T for NT token tiles whose W rows start at float offset w0 of the stage's W: k = key dims
// (permuted: W read as float2 along its row); W presplit (SPLIT: tf32 hi in sW, lo in sWl) or split per use.
// P: products a mma (mma_p; 1, the "tf32 state" class, only without the presplit: its lo halves would go unread).
template <int KT, int NT, int DK, bool SPLIT, int P = 3>
__device__ __forceinline__ void state_p_product(float (&p)[NT][4], const float (&S)[KT][4], const float* sW,
                                                const u32* sWl, int w0) {
    static_assert(P == 3 || !SPLIT, "one TF32 product reads no lo halves");
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int s = 0; s < KT; s++) {
        u32 ah[4], al[4];
        split_ctile(S[s], ah, al);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int row = nt * 8 + g, at = w0 + row * DK + sw_row(row, 8 * s + 2 * t);
            if constexpr (SPLIT) {
                const uint2 bh = *reinterpret_cast<const uint2*>(reinterpret_cast<const u32*>(sW) + at);
                const uint2 bl = *reinterpret_cast<const uint2*>(sWl + at);
                mma3_split_b(p[nt], ah, al, bh.x, bl.x, bh.y, bl.y);
            } else {
                const float2 b = *reinterpret_cast<const float2*>(sW + at);
                mma_p<P>(p[nt], ah, al, b.x, b.y);
            }
        }
    }
}

// T[s] += (the split A fragment of token tile m: ah / al) K for NS key-dim tiles from column kcol (a multiple of
// 32: sw_col / k_pair_at unchanged): K rows r0 = 8 m + 2 t and r0 + 1, presplit as row pairs (SPLIT) or split per use.
// P: products a mma; with SPLIT and P = 1 the row pairs hold the tf32 values alone (state_split_k<LO = false>).
template <int NS, int DK, bool SPLIT, int P = 3>
__device__ __forceinline__ void state_update_tile(float (&T)[NS][4], const u32 (&ah)[4], const u32 (&al)[4], int r0,
                                                  int kcol, const float* sK, const u32* sKl) {
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int s = 0; s < NS; s++) {
        if constexpr (SPLIT && P == 1) {
            const uint2 bh = *reinterpret_cast<const uint2*>(reinterpret_cast<const u32*>(sK) + k_pair_at(r0, 8 * s + g, DK) +
                                                             kcol);
            mma_tf32(T[s], ah, bh.x, bh.y);
        } else if constexpr (SPLIT) {
            const int at = k_pair_at(r0, 8 * s + g, DK) + kcol;
            const uint2 bh = *reinterpret_cast<const uint2*>(reinterpret_cast<const u32*>(sK) + at);
            const uint2 bl = *reinterpret_cast<const uint2*>(sKl + at);
            mma3_split_b(T[s], ah, al, bh.x, bl.x, bh.y, bl.y);
        } else {
            const int col = sw_col(r0, 8 * s + g) + kcol;  // rows r0 and r0 + 1 share the swizzle
            mma_p<P>(T[s], ah, al, sK[r0 * DK + col], sK[(r0 + 1) * DK + col]);
        }
    }
}

template <int DK, int STAGES, bool PRESPLIT>
__device__ __forceinline__ void state_body(float* __restrict__ state, const float* __restrict__ qkvn,
                                           const float* __restrict__ wsc, float* __restrict__ usc,
                                           float* __restrict__ ssc, const float* __restrict__ gsc, int H, int HV,
                                           int dv, int nlanes, int pos0, int nchunks) {
    using L = StateSmem<DK>;
    constexpr int C = GDN2_C, BV = GDN2_BV, NW = BV / 16, KT = DK / 8, CT = C / 8;
    static_assert(C == 64 && BV % 16 == 0 && DK % 32 == 0 && (STAGES == 1 || STAGES == 2), "state shape");
    extern __shared__ float smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, j0 = blockIdx.x * BV, kh = h / (HV / H);
    const i64 ldq = 2 * H * DK + HV * dv;
    const float* kbase = qkvn + H * DK + kh * DK;

    auto issue = [&](int ci, int st) {  // chunk ci's W, K, U^T (this CTA's rows) and gates into stage st
        state_issue<DK, NW * 32>(smem + st * L::STAGE, wsc, usc, gsc, kbase, ldq, h, j0, dv, ci, nlanes, pos0, nchunks,
                                 tid);
    };

    // S^T rows j0 + 16 warp + (g, g + 8), key dims 8s + 2t (+1): C fragments, fp32, for the whole run
    float S[KT][4];
    {
        const float* s0 = state + ((i64)h * dv + j0 + warp * 16 + g) * DK + 2 * t;
#pragma unroll
        for (int s = 0; s < KT; s++) {
            const float2 lo = *reinterpret_cast<const float2*>(s0 + 8 * s);
            const float2 hi = *reinterpret_cast<const float2*>(s0 + 8 * DK + 8 * s);
            S[s][0] = lo.x, S[s][1] = lo.y, S[s][2] = hi.x, S[s][3] = hi.y;
        }
    }
    issue(0, 0);
    for (int ci = 0; ci < nchunks; ci++) {
        const int st = STAGES == 2 ? ci & 1 : 0;
        if (STAGES == 2 && ci + 1 < nchunks) {
            issue(ci + 1, st ^ 1);  // its stage was last read in chunk ci - 1 (barrier at that chunk's end)
            cp_async_wait<1>();
        } else {
            // one stage: chunk ci goes in after chunk ci - 1's closing barrier (issued here rather than
            // at the end of the previous iteration: the same order, and ptxas keeps it spill-free)
            if (STAGES == 1 && ci > 0) issue(ci, 0);
            cp_async_wait<0>();
        }
        __syncthreads();
        const float* sW = smem + st * L::STAGE + L::W;
        const float* sK = smem + st * L::STAGE + L::K;
        const float* sU = smem + st * L::STAGE + L::U;
        const float* sE = smem + st * L::STAGE + L::E;
        const u32* sWl = reinterpret_cast<const u32*>(smem + STAGES * L::STAGE + L::W);
        const u32* sKl = reinterpret_cast<const u32*>(smem + STAGES * L::STAGE + L::K);
        if constexpr (PRESPLIT) {
            // W elementwise, 16 bytes at a time (the split keeps positions: sw_row reads are unchanged)
            state_split_w<DK, NW * 32>(smem + st * L::STAGE, smem + STAGES * L::STAGE + L::W, tid);
            // K by (row pair, column octet): 4 slots read, the same 4 written as pairs (k_pair_at)
            u32* kh = reinterpret_cast<u32*>(smem + st * L::STAGE + L::K);
            u32* kl = const_cast<u32*>(sKl);
            for (int u = tid; u < (C / 2) * (DK / 8); u += NW * 32) {
                const int r0 = 2 * (u / (DK / 8)), c = 8 * (u - (u / (DK / 8)) * (DK / 8));
                const int a0 = r0 * DK + sw_col(r0, c), a1 = r0 * DK + sw_col(r0, c + 4);
                const float4 x0 = *reinterpret_cast<const float4*>(kh + a0), x1 = *reinterpret_cast<const float4*>(kh + a1);
                const float4 y0 = *reinterpret_cast<const float4*>(kh + a0 + DK), y1 = *reinterpret_cast<const float4*>(kh + a1 + DK);
                const float pr[4][4] = {{x0.x, y0.x, x0.y, y0.y}, {x0.z, y0.z, x0.w, y0.w},
                                        {x1.x, y1.x, x1.y, y1.y}, {x1.z, y1.z, x1.w, y1.w}};
                const int at[4] = {a0, a1, a0 + DK, a1 + DK};  // slot q = (row r0 + q / 2, octet half q % 2)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    uint4 hi, lo;
                    split_tf32(pr[q][0], hi.x, lo.x);
                    split_tf32(pr[q][1], hi.y, lo.y);
                    split_tf32(pr[q][2], hi.z, lo.z);
                    split_tf32(pr[q][3], hi.w, lo.w);
                    *reinterpret_cast<uint4*>(kh + at[q]) = hi;
                    *reinterpret_cast<uint4*>(kl + at[q]) = lo;
                }
            }
            __syncthreads();
        }
        // the chunk's start state for the output pass, fragment-native [dv/16][KT][32][4]
        float* sc = ssc + (((i64)h * nchunks + ci) * (dv / 16) + j0 / 16 + warp) * KT * 128 + lane * 4;
#pragma unroll
        for (int s = 0; s < KT; s++)
            *reinterpret_cast<float4*>(sc + s * 128) = make_float4(S[s][0], S[s][1], S[s][2], S[s][3]);
        // P = S^T W^T: [16 j x C tokens], k = key dims (permuted: W read as float2 along its row)
        float p[CT][4];
#pragma unroll
        for (int nt = 0; nt < CT; nt++) p[nt][0] = p[nt][1] = p[nt][2] = p[nt][3] = 0.f;
        state_p_product<KT, CT, DK, PRESPLIT>(p, S, sW, sWl, 0);
        // V_new^T = U^T - P (to scratch over U, for the output pass), then scaled by ED per token
        float* vn = usc + ((i64)h * nchunks + ci) * C * dv + (i64)j0 * C + (warp * CT * 32 + lane) * 4;
#pragma unroll
        for (int nt = 0; nt < CT; nt++) {
            const float4 u = *reinterpret_cast<const float4*>(sU + ((warp * CT + nt) * 32 + lane) * 4);
            const float4 v = make_float4(u.x - p[nt][0], u.y - p[nt][1], u.z - p[nt][2], u.w - p[nt][3]);
            *reinterpret_cast<float4*>(vn + nt * 128) = v;
            const float e0 = sE[nt * 8 + 2 * t], e1 = sE[nt * 8 + 2 * t + 1];
            p[nt][0] = v.x * e0, p[nt][1] = v.y * e1, p[nt][2] = v.z * e0, p[nt][3] = v.w * e1;
        }
        // S^T = e^{G_last} S^T + (diag(ED) V_new)^T K: k = tokens (permuted: K rows 2t, 2t + 1)
        const float egl = sE[2 * C - 1];  // e^{G_last}
#pragma unroll
        for (int s = 0; s < KT; s++)
#pragma unroll
            for (int e = 0; e < 4; e++) S[s][e] *= egl;
#pragma unroll
        for (int m = 0; m < CT; m++) {
            u32 ah[4], al[4];
            split_ctile(p[m], ah, al);
            state_update_tile<KT, DK, PRESPLIT>(S, ah, al, m * 8 + 2 * t, 0, sK, sKl);
        }
        __syncthreads();  // every warp is done with this stage
    }
    float* s1 = state + ((i64)h * dv + j0 + warp * 16 + g) * DK + 2 * t;
#pragma unroll
    for (int s = 0; s < KT; s++) {
        *reinterpret_cast<float2*>(s1 + 8 * s) = make_float2(S[s][0], S[s][1]);
        *reinterpret_cast<float2*>(s1 + 8 * DK + 8 * s) = make_float2(S[s][2], S[s][3]);
    }
}

// ------------------------------------------------------------------------------------------------
// 2b. The state recurrence on 8 warps (gdn2_state_d*_s*[k|p]_w8): 4 pairs of warps; pair q holds the 16 S^T rows
// warp q of state_body holds (j0 + 16 q + (g, g + 8)), and half f = warp & 1 of the pair computes half of each
// product's columns:
//   P = S^T W^T       tokens 32 f .. 32 f + 31 (n-tiles CT/2 f ..), every tile over all KT key-dim k-steps in
//                     state_body's order, the A operand from the full S^T both warps of the pair hold;
//   V_new^T = U^T - P, its scratch write and the ED scaling: on those token tiles, as state_body; the scaled tiles
//                     go back over the stage's U tiles they came from (read by this lane only, just before);
//   S^T update        key dims (DK/2) f .. (DK/2)(f + 1) - 1 (n-tiles KT/2 f ..), each over all 8 token k-steps in
//                     order, the A operand = the pair's 8 scaled V_new^T tiles read back from the stage's U;
//   then each warp writes its updated half of S^T over the stage's W (free once every warp is past P) and both read
//   the pair's full S^T back for the next chunk.
// So every element of P, V_new and S is the same mma3 / mma3_split_b chain over the same split operands in the same
// order as state_body: bitwise the same state, S_c and V_new scratch. Each warp also keeps its own half in T (the
// S_c stores, the update's accumulators and the final store: each warp writes its half).
// SPLIT: the presplit operands (state_split_w / state_split_k): 0 none (B split at each use, as state_body without
// PRESPLIT), 1 K alone (lo buffer C DK floats), 2 W and K (as state_body's PRESPLIT, 2 C DK floats). K's split
// runs after the chunk's barriers, beside P (see below); W's needs one barrier of its own.
// Barriers per chunk (two stages): one CTA-wide at the end of chunk ci - 1 (its stage free for chunk ci + 1's
// copies, chunk ci's landed and visible: each thread waited for its own copies first), [SPLIT 2: one after W's
// split], one CTA-wide after V_new (the pair's scaled tiles visible; every warp past P, so W is free; K's split
// done), one per pair (bar.sync 1 + q, 64) after the S^T halves are written. One stage: one more CTA-wide (chunk
// ci's copies go in after chunk ci - 1's closing barrier and land before the next). Shared memory: StateSmem and
// the lo buffer, nothing added (the S^T exchange takes BV DK <= C DK floats of the stage's W).
// P: products a mma (3, or 1 for the "tf32 state" class: gdn2_state1_*_w8, SPLIT 0 or 1: K rounded to tf32 in place
// as row pairs, no lo halves).
template <int DK, int STAGES, int SPLIT, int P = 3>
__device__ __forceinline__ void state8_body(float* __restrict__ state, const float* __restrict__ qkvn,
                                            const float* __restrict__ wsc, float* __restrict__ usc,
                                            float* __restrict__ ssc, const float* __restrict__ gsc, int H, int HV,
                                            int dv, int nlanes, int pos0, int nchunks) {
    using L = StateSmem<DK>;
    constexpr int C = GDN2_C, BV = GDN2_BV, NQ = BV / 16, NW = 2 * NQ, KT = DK / 8, CT = C / 8, KH = KT / 2,
                  CH = CT / 2;
    static_assert(C == 64 && BV % 16 == 0 && BV <= C && DK % 32 == 0 && (STAGES == 1 || STAGES == 2) && SPLIT >= 0 &&
                  SPLIT <= 2 && (P == 3 || (P == 1 && SPLIT <= 1)), "state shape");
    constexpr bool SW = SPLIT == 2, SK = SPLIT >= 1;  // W presplit, K presplit
    extern __shared__ float smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int q = warp >> 1, f = warp & 1;
    const int h = blockIdx.y, j0 = blockIdx.x * BV, kh = h / (HV / H);
    const i64 ldq = 2 * H * DK + HV * dv;
    const float* kbase = qkvn + H * DK + kh * DK;
    auto issue = [&](int ci, int st) {
        state_issue<DK, NW * 32>(smem + st * L::STAGE, wsc, usc, gsc, kbase, ldq, h, j0, dv, ci, nlanes, pos0, nchunks,
                                 tid);
    };

    // S: the pair's S^T rows, all KT key-dim tiles (C fragments as state_body); T: this warp's half, tiles KH f ..
    float S[KT][4], T[KH][4];
    {
        const float* s0 = state + ((i64)h * dv + j0 + q * 16 + g) * DK + 2 * t;
#pragma unroll
        for (int s = 0; s < KT; s++) {
            const float2 lo = *reinterpret_cast<const float2*>(s0 + 8 * s);
            const float2 hi = *reinterpret_cast<const float2*>(s0 + 8 * DK + 8 * s);
            S[s][0] = lo.x, S[s][1] = lo.y, S[s][2] = hi.x, S[s][3] = hi.y;
        }
#pragma unroll
        for (int s = 0; s < KH; s++) {
            const float2 lo = *reinterpret_cast<const float2*>(s0 + 8 * (KH * f + s));
            const float2 hi = *reinterpret_cast<const float2*>(s0 + 8 * DK + 8 * (KH * f + s));
            T[s][0] = lo.x, T[s][1] = lo.y, T[s][2] = hi.x, T[s][3] = hi.y;
        }
    }
    issue(0, 0);
    if (STAGES == 2 && nchunks > 1) issue(1, 1);
    for (int ci = 0; ci < nchunks; ci++) {
        const int st = STAGES == 2 ? ci & 1 : 0;
        if (STAGES == 1 || ci == 0) {  // two stages, ci > 0: waited for and made visible at chunk ci - 1's end
            if (STAGES == 1 && ci > 0) issue(ci, 0);  // after chunk ci - 1's closing barrier
            if (STAGES == 2 && nchunks > 1)
                cp_async_wait<1>();
            else
                cp_async_wait<0>();
            __syncthreads();
        }
        float* stage = smem + st * L::STAGE;
        const float* sW = stage + L::W;
        const float* sK = stage + L::K;
        const float* sE = stage + L::E;
        float* wlo = smem + STAGES * L::STAGE;       // SPLIT 2: W lo, then K lo
        float* klo = wlo + (SW ? C * DK : 0);        // SPLIT 1: K lo alone
        const u32* sWl = reinterpret_cast<const u32*>(wlo);
        const u32* sKl = reinterpret_cast<const u32*>(klo);
        if constexpr (SW) {
            state_split_w<DK, NW * 32>(stage, wlo, tid);
            __syncthreads();
        }
        // K's split needs no barrier of its own: its lo buffer was last read in chunk ci - 1's update (before this
        // chunk's first barrier), and this chunk's update reads it after the CTA barrier past V_new
        if constexpr (SK) state_split_k<DK, NW * 32, P == 3>(stage, klo, tid);
        // the chunk's start state for the output pass, fragment-native [dv/16][KT][32][4]: this warp's half
        float* sc = ssc + ((((i64)h * nchunks + ci) * (dv / 16) + j0 / 16 + q) * KT + KH * f) * 128 + lane * 4;
#pragma unroll
        for (int s = 0; s < KH; s++)
            *reinterpret_cast<float4*>(sc + s * 128) = make_float4(T[s][0], T[s][1], T[s][2], T[s][3]);
        // P = S^T W^T on token tiles CH f + nt (W rows 8 (CH f + nt) + g: sw_row depends on g alone)
        float p[CH][4];
#pragma unroll
        for (int nt = 0; nt < CH; nt++) p[nt][0] = p[nt][1] = p[nt][2] = p[nt][3] = 0.f;
        state_p_product<KT, CH, DK, SW, P>(p, S, sW, sWl, 8 * CH * f * DK);
        // V_new^T = U^T - P (to scratch over U, for the output pass), scaled by ED per token, over the stage's U tile
        const int ut = (q * CT + CH * f) * 32 + lane;  // this lane's slot of the pair's first own U tile
        float* vn = usc + ((i64)h * nchunks + ci) * C * dv + (i64)j0 * C + ut * 4;
        float* sUo = stage + L::U + ut * 4;
#pragma unroll
        for (int nt = 0; nt < CH; nt++) {
            const float4 u = *reinterpret_cast<const float4*>(sUo + nt * 128);
            const float4 v = make_float4(u.x - p[nt][0], u.y - p[nt][1], u.z - p[nt][2], u.w - p[nt][3]);
            *reinterpret_cast<float4*>(vn + nt * 128) = v;
            const int tok = (CH * f + nt) * 8 + 2 * t;
            const float e0 = sE[tok], e1 = sE[tok + 1];
            *reinterpret_cast<float4*>(sUo + nt * 128) = make_float4(v.x * e0, v.y * e1, v.z * e0, v.w * e1);
        }
        __syncthreads();  // the pair's scaled V_new^T tiles visible; every warp is past P (the stage's W is free)
        // S^T = e^{G_last} S^T + (diag(ED) V_new)^T K on key-dim tiles KH f + s: k = tokens (K rows 2t, 2t + 1)
        const float egl = sE[2 * C - 1];  // e^{G_last}
#pragma unroll
        for (int s = 0; s < KH; s++)
#pragma unroll
            for (int e = 0; e < 4; e++) T[s][e] *= egl;
        const float* sUp = stage + L::U + (q * CT * 32 + lane) * 4;
        const int kcol = (DK / 2) * f;  // + a multiple of 32 to the column: sw_col / k_pair_at unchanged
#pragma unroll
        for (int m = 0; m < CT; m++) {
            const float4 a = *reinterpret_cast<const float4*>(sUp + m * 128);
            u32 ah[4], al[4];
            split_a(a.x, a.z, a.y, a.w, ah, al);  // split_ctile order
            state_update_tile<KH, DK, SK, P>(T, ah, al, m * 8 + 2 * t, kcol, sK, sKl);
        }
        if (ci + 1 < nchunks) {
            // the pair's S^T through the stage's W: [pair][KT][32][4], each warp its half, then both read all of it
            float* sx = stage + L::W + (q * KT * 32 + lane) * 4;
#pragma unroll
            for (int s = 0; s < KH; s++)
                *reinterpret_cast<float4*>(sx + (KH * f + s) * 128) = make_float4(T[s][0], T[s][1], T[s][2], T[s][3]);
            asm volatile("bar.sync %0, %1;" ::"r"(1 + q), "n"(64) : "memory");  // the pair's two warps
#pragma unroll
            for (int s = 0; s < KT; s++) {
                const float4 x = *reinterpret_cast<const float4*>(sx + s * 128);
                S[s][0] = x.x, S[s][1] = x.y, S[s][2] = x.z, S[s][3] = x.w;
            }
            if (STAGES == 2) cp_async_wait<0>();  // chunk ci + 1's copies (this thread's) have landed
            __syncthreads();  // every warp is done with this stage (two stages: and chunk ci + 1's is visible)
            if (STAGES == 2 && ci + 2 < nchunks) issue(ci + 2, st);
        }
    }
    float* s1 = state + ((i64)h * dv + j0 + q * 16 + g) * DK + 2 * t + 8 * KH * f;
#pragma unroll
    for (int s = 0; s < KH; s++) {
        *reinterpret_cast<float2*>(s1 + 8 * s) = make_float2(T[s][0], T[s][1]);
        *reinterpret_cast<float2*>(s1 + 8 * DK + 8 * s) = make_float2(T[s][2], T[s][3]);
    }
}

// ------------------------------------------------------------------------------------------------
// 3. Output: one CTA (DV / 16 warps) per (chunk, value head).
template <int DK, int DV>
struct OutSmem {
    static constexpr int C = GDN2_C, LDM = C + 8;
    static constexpr int Q = 0, K = Q + C * DK, M = K + C * DK, G = M + C * LDM, FLOATS = G + 3 * C;
};

// The gated output norm fused into the output pass (GATED): norm.cu gated_rmsnorm_rows' arguments.
struct GatedNorm {
    const float* z;  // the gate rows [t][ldz] (value head h at h * dv)
    int ldz;
    const float* w;  // [dv] norm weight
    float eps;
    float* y;        // fp32 rows [t][ldy] or null
    int ldy;
    u16* yb;         // bf16 rows [t][ldyb] or null
    int ldyb;
};

template <int DK, int DV, bool GATED = false, int P = 3>
__device__ __forceinline__ void out_body(const float* __restrict__ qkvn, const float* __restrict__ usc,
                                         const float* __restrict__ ssc, const float* __restrict__ gsc,
                                         float* __restrict__ out, int ldo, int H, int HV, int nlanes, int pos0,
                                         int nchunks, GatedNorm gn = {}) {
    using L = OutSmem<DK, DV>;
    constexpr int C = GDN2_C, LDM = L::LDM, NW = DV / 16, KT = DK / 8, CT = C / 8, MT = C / 16;
    static_assert(C == 64 && DK % 32 == 0 && DV % 16 == 0, "out shape");
    extern __shared__ float smem[];
    float* sQ = smem + L::Q;  // [C][DK] sw_row
    float* sK = smem + L::K;  // [C][DK] sw_row
    float* sM = smem + L::M;  // [C][LDM] M o Q K^T (lower, diagonal included)
    float* sG = smem + L::G;  // [3][C]: G hi, G lo, e^G
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int ci = blockIdx.x, h = blockIdx.y, kh = h / (HV / H);
    int c0, n;
    chunk_span(ci, nlanes, pos0, c0, n);
    const i64 ldq = 2 * H * DK + HV * DV;
    const float* qbase = qkvn + kh * DK;
    const float* kbase = qkvn + H * DK + kh * DK;
    for (int idx = tid; idx < C * DK / 4; idx += NW * 32) {
        const int i = idx / (DK / 4), c = (idx - i * (DK / 4)) * 4;
        float4 qv = make_float4(0.f, 0.f, 0.f, 0.f), kv = qv;
        if (i < n) {
            const i64 row = (i64)(c0 + i) * ldq;
            qv = *reinterpret_cast<const float4*>(qbase + row + c);
            kv = *reinterpret_cast<const float4*>(kbase + row + c);
        }
        *reinterpret_cast<float4*>(sQ + i * DK + sw_row(i, c)) = qv;
        *reinterpret_cast<float4*>(sK + i * DK + sw_row(i, c)) = kv;
    }
    if (tid < C) {
        const float* gs = gsc + ((i64)h * nchunks + ci) * GDN2_GATES * C;
        sG[tid] = gs[tid];
        sG[C + tid] = gs[C + tid];
        sG[2 * C + tid] = gs[3 * C + tid];
    }
    __syncthreads();
    // M o Q K^T on the 20 lower 16 x 8 tiles, lower segments v = warp, warp + NW, .. (Q and K read as
    // float2 along their rows, k permuted); the tiles above are never read by the product below
    static_assert(8 % NW == 0, "whole lower segments per warp");
    for (int v = warp; v < 8; v += NW) {
        int tm, tn0, nn;
        lower_segment(v, tm, tn0, nn);
        float qk[3][4];
        segment_xyt<KT, P>(qk, sQ, sK, DK, tm, tn0, nn, [](int r, int c) { return sw_row(r, c); });
#pragma unroll
        for (int j = 0; j < 3; j++) {
            if (j >= nn) continue;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = tm * 16 + g + (e >> 1) * 8, m = (tn0 + j) * 8 + 2 * t + (e & 1);
                sM[i * LDM + m] = m <= i ? expf(gdiff(sG, sG + C, i, m)) * qk[j][e] : 0.f;
            }
        }
    }
    __syncthreads();
    // O^T = S_c^T Q^T diag(e^G) + V_new^T (M o Q K^T)^T on [16 j x C tokens] per warp
    float o[CT][4];
#pragma unroll
    for (int nt = 0; nt < CT; nt++) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    const float* sc = ssc + (((i64)h * nchunks + ci) * NW + warp) * KT * 128 + lane * 4;
#pragma unroll 4
    for (int s = 0; s < KT; s++) {
        const float4 f = *reinterpret_cast<const float4*>(sc + s * 128);
        u32 ah[4], al[4];
        split_a(f.x, f.z, f.y, f.w, ah, al);  // split_ctile order
#pragma unroll
        for (int nt = 0; nt < CT; nt++) {
            // Q split at each use by every warp: splitting it once per CTA (tf32 hi in place, lo in K's place)
            // measured 5-6% slower on the H100 (tools/kernel_ab.py, runs i2 / i4: the split loop and its
            // barrier cost more than the splits they saved), so it stays here
            const int row = nt * 8 + g;
            const float2 b = *reinterpret_cast<const float2*>(sQ + row * DK + sw_row(row, 8 * s + 2 * t));
            mma_p<P>(o[nt], ah, al, b.x, b.y);
        }
    }
#pragma unroll
    for (int nt = 0; nt < CT; nt++) {
        const float e0 = sG[2 * C + nt * 8 + 2 * t], e1 = sG[2 * C + nt * 8 + 2 * t + 1];
        o[nt][0] *= e0, o[nt][1] *= e1, o[nt][2] *= e0, o[nt][3] *= e1;
    }
    const float* vn = usc + ((i64)h * nchunks + ci) * C * DV + (warp * CT * 32 + lane) * 4;
#pragma unroll
    for (int mb = 0; mb < CT; mb++) {
        const float4 f = *reinterpret_cast<const float4*>(vn + mb * 128);
        u32 ah[4], al[4];
        split_a(f.x, f.z, f.y, f.w, ah, al);
#pragma unroll
        for (int nt = 0; nt < CT; nt++) {
            if (nt < mb) continue;  // M is lower triangular: token block nt sees blocks mb <= nt
            const float2 b = *reinterpret_cast<const float2*>(sM + (nt * 8 + g) * LDM + mb * 8 + 2 * t);
            mma_p<P>(o[nt], ah, al, b.x, b.y);
        }
    }
    if constexpr (!GATED) {
#pragma unroll
        for (int nt = 0; nt < CT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = nt * 8 + 2 * t + (e & 1), j = warp * 16 + g + (e >> 1) * 8;
                if (i < n) out[(i64)(c0 + i) * ldo + h * DV + j] = o[nt][e];
            }
    } else {
        // gated_rmsnorm_rows on the chunk's O rows while they are on chip: O goes through shared memory
        // (over Q and K, read by no warp any more) as [C][DV + 4] rows (conflict-free fragment stores), and
        // each warp normalizes whole tokens with the rows kernel's arithmetic: lane l of 32-column group q
        // holds column 32 q + l, its warp_sum is that kernel's warp q's sum, and the group sums meet as in
        // block_total (lane q < DV / 32 holds sum q, the rest 0, one more warp_sum). Same values, same
        // order: the same bits (tests/gpu/test_gdn_chunk.py holds it to the two-kernel path).
        static_assert(DV % 32 == 0 && C * (DV + 4) <= 2 * C * DK, "gated rows fit over Q and K");
        constexpr int LDO = DV + 4, NG = DV / 32;
        float* sO = smem + L::Q;
        __syncthreads();  // every warp is done reading Q and K
#pragma unroll
        for (int nt = 0; nt < CT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                sO[(nt * 8 + 2 * t + (e & 1)) * LDO + warp * 16 + g + (e >> 1) * 8] = o[nt][e];
        __syncthreads();
        float wq[NG];
#pragma unroll
        for (int q = 0; q < NG; q++) wq[q] = gn.w[32 * q + lane];
        for (int i = warp; i < n; i += NW) {
            const i64 row = c0 + i;
            float v[NG], zz[NG], part = 0.f;
#pragma unroll
            for (int q = 0; q < NG; q++) {
                v[q] = sO[i * LDO + 32 * q + lane];
                zz[q] = gn.z[row * gn.ldz + h * DV + 32 * q + lane];
                const float s = warp_sum(v[q] * v[q]);
                if (lane == q) part = s;
            }
            const float ss = warp_sum(part);
            const float den = sqrtf(ss / (float)DV + gn.eps);
#pragma unroll
            for (int q = 0; q < NG; q++) {
                const float r = (v[q] / den) * wq[q] * (zz[q] * sigmoid_f(zz[q]));
                if (gn.y) gn.y[row * gn.ldy + h * DV + 32 * q + lane] = r;
                if (gn.yb) gn.yb[row * gn.ldyb + h * DV + 32 * q + lane] = bf16_rn(r);
            }
        }
    }
}

// Entry points. Scratch (floats, chunk-padded, nchunks = chunks of this run): W [HV][nchunks][C][DK],
// U / V_new [HV][nchunks][C * DV] fragment-native, S_c [HV][nchunks][DV * DK] fragment-native,
// gates [HV][nchunks][GDN2_GATES = 4][C] (G hi, G lo, ED, EG). State K-last [HV][dv][dk] as gdn_prefill.
// One state-pass entry: gdn2_state_d<D>_s<S>[p] (S cp.async stages, P: the presplit operands).
#define GDN2_STATE_KERNEL(D, S, P, NAME)                                                                          \
    extern "C" __global__ void __launch_bounds__(GDN2_BV * 2, 1)                                                  \
        NAME(float* state, const float* qkvn, const float* wsc, float* usc, float* ssc, const float* gsc, int H,  \
             int HV, int dv, int nlanes, int pos0, int nchunks) {                                                 \
        state_body<D, S, P>(state, qkvn, wsc, usc, ssc, gsc, H, HV, dv, nlanes, pos0, nchunks);                   \
    }

// The 8-warp form (state8_body): gdn2_state_d<D>_s<S>[k|p]_w8 (k: K presplit alone, p: W and K), 2 GDN2_BV / 16
// warps; PP products a mma (gdn2_state1_d<D>_s<S>[k]_w8: 1, the "tf32 state" class; k: K rounded once per chunk).
#define GDN2_STATE8_KERNEL(D, S, P, PP, NAME)                                                                     \
    extern "C" __global__ void __launch_bounds__(GDN2_BV * 4, 1)                                                  \
        NAME(float* state, const float* qkvn, const float* wsc, float* usc, float* ssc, const float* gsc, int H,  \
             int HV, int dv, int nlanes, int pos0, int nchunks) {                                                 \
        state8_body<D, S, P, PP>(state, qkvn, wsc, usc, ssc, gsc, H, HV, dv, nlanes, pos0, nchunks);              \
    }

// The pre-pass in PP products a mma: gdn2_prep_d<D> (3), gdn2_prep1_d<D> (1, the "tf32 state" class)
#define GDN2_PREP_KERNEL(D, PP, NAME)                                                                             \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                          \
        NAME(const float* qkvn, const float* gb, float* wsc, float* usc, float* gsc, int H, int HV, int nlanes,   \
             int pos0, int nchunks) {                                                                             \
        prep_body<D, D, PP>(qkvn, gb, wsc, usc, gsc, H, HV, nlanes, pos0, nchunks);                               \
    }

// The output pass, plain and with the gated norm, in P passes a product (mma_p: gdn2_out* 3, gdn2_out1* 1)
#define GDN2_OUT_KERNELS(D, P, NAME, GNAME)                                                                       \
    extern "C" __global__ void __launch_bounds__(D * 2, 2)                                                        \
        NAME(const float* qkvn, const float* usc, const float* ssc, const float* gsc, float* out, int ldo, int H, \
             int HV, int nlanes, int pos0, int nchunks) {                                                         \
        out_body<D, D, false, P>(qkvn, usc, ssc, gsc, out, ldo, H, HV, nlanes, pos0, nchunks);                    \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(D * 2, 2)                                                        \
        GNAME(const float* qkvn, const float* usc, const float* ssc, const float* gsc, const float* z, int ldz,    \
              const float* w, float eps, float* y, int ldy, u16* yb, int ldyb, int H, int HV, int nlanes,         \
              int pos0, int nchunks) {                                                                            \
        out_body<D, D, true, P>(qkvn, usc, ssc, gsc, nullptr, 0, H, HV, nlanes, pos0, nchunks,                    \
                                GatedNorm{z, ldz, w, eps, y, ldy, yb, ldyb});                                     \
    }

#define GDN2_KERNELS(D)                                                                                           \
    GDN2_PREP_KERNEL(D, 3, gdn2_prep_d##D)                                                                        \
    GDN2_PREP_KERNEL(D, 1, gdn2_prep1_d##D)                                                                       \
    GDN2_STATE_KERNEL(D, 2, false, gdn2_state_d##D##_s2)                                                          \
    GDN2_STATE_KERNEL(D, 1, false, gdn2_state_d##D##_s1)                                                          \
    GDN2_STATE_KERNEL(D, 2, true, gdn2_state_d##D##_s2p)                                                          \
    GDN2_STATE_KERNEL(D, 1, true, gdn2_state_d##D##_s1p)                                                          \
    GDN2_STATE8_KERNEL(D, 2, 0, 3, gdn2_state_d##D##_s2_w8)                                                          \
    GDN2_STATE8_KERNEL(D, 1, 0, 3, gdn2_state_d##D##_s1_w8)                                                          \
    GDN2_STATE8_KERNEL(D, 2, 1, 3, gdn2_state_d##D##_s2k_w8)                                                         \
    GDN2_STATE8_KERNEL(D, 2, 2, 3, gdn2_state_d##D##_s2p_w8)                                                         \
    GDN2_STATE8_KERNEL(D, 1, 2, 3, gdn2_state_d##D##_s1p_w8)                                                         \
    GDN2_STATE8_KERNEL(D, 2, 0, 1, gdn2_state1_d##D##_s2_w8)                                                      \
    GDN2_STATE8_KERNEL(D, 1, 0, 1, gdn2_state1_d##D##_s1_w8)                                                      \
    GDN2_STATE8_KERNEL(D, 2, 1, 1, gdn2_state1_d##D##_s2k_w8)                                                     \
    GDN2_OUT_KERNELS(D, 3, gdn2_out_d##D, gdn2_out_gated_d##D)                                                    \
    GDN2_OUT_KERNELS(D, 1, gdn2_out1_d##D, gdn2_out1_gated_d##D)

GDN2_KERNELS(128)
GDN2_KERNELS(64)
