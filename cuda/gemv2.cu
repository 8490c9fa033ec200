// Weight-streaming GEMV v2 for 1..16 lanes: register-direct 16-byte loads, tensor cores.
//
// Same contract, packed layout (q27py/gpu/layout.py) and descriptors as gemv.cu (v1):
//   y[lane][row] (op)= sum_k W[row][k] * x[lane][k], op = store / add / SwiGLU, up to 4 matrices
//   per launch, q4 / q8 weights against bf16(x) rounded once, bf16 weights against x as bf16 hi + lo.
// What changed, and why (v1 was issue-bound: ncu 9.8 active warps/SM, ~600 SASS per 2 KB):
// - No shared-memory ring. Each thread loads its own 16-byte fragments straight into registers
//   (ld.global.nc.L1::no_allocate: weights are read once, so they must not evict the activations
//   from L1) through a ring of PIPE register slots of R row tiles; a tile's slot is refilled as
//   soon as it is decoded, so ~PIPE - 1/2 slices stay in flight: at 1-8 lanes (PIPE 3, 4 CTAs of
//   4 warps per SM) ~2.5 x 4 x 512 B per warp, ~80 KB per SM, above the ~35 KB Little's law asks
//   for at 4.5 TB/s and ~1 us of loaded latency. No cp.async wait / LDS round trip per chunk.
// - Tile-outer compute: per row tile the partial p lives for one slice only, so the registers are
//   R x NT accumulators + one p: 8 lanes fit 128 registers (16 warps per SM), 16 lanes 168
//   (12 warps; q8 255 with 8 warps and a deeper ring). Occupancy and depths: constants table.
// - Activations are loaded once per slice and reused by the R tiles (fp32 -> bf16 once per warp
//   and slice); with D_RGB row groups per CTA the warps that share K chunks read the same x
//   through L1, cutting activation traffic from L2 by D_RGB.
// - Partition (rows per CTA, split-K) chosen per matrix from its shape only (kernels.py
//   choose_partition), so lane bits never depend on the launch width.
// Numerics: q4 scales apply per 64-k chunk (as v1); q8 per 32 k (a slice: two k16 steps), bf16
// accumulates straight into fp32. Reductions in fixed order, split partials summed by the last
// CTA of a row block in split order (integer ticket, no float atomics).
//
// Constants (FMT_*, MODE_*, GEMV_R, G2_WARPS, PIPE*_*, CB_*, WPC_*, GSC_*, D_*) come from
// q27py/gpu/constants.py as -D defines.
#include "common.cuh"

// int4 nibbles at bits (0, 16) -> bf16x2 (code - 8), exact: 0x4300 | n = 128 + n, then - 136
__device__ __forceinline__ u32 g2_q4_pair(u32 q) {
    return fma_bf16x2((q & 0x000F000Fu) | 0x43004300u, 0x3F803F80u, 0xC308C308u);
}
// biased int8 bytes at bits (0, 16) -> bf16x2 (byte - 128), exact (see gemv.cu q8_pair)
__device__ __forceinline__ u32 g2_q8_pair(u32 v) {
    u32 x = (v & 0x007F007Fu) | 0x43004300u;
    u32 c = (v & 0x00800080u) ^ 0x43804380u;
    return fma_bf16x2(c, 0xBF80BF80u, x);
}

template <int FMT>
struct G2Fmt;
// CB: chunk bytes; WPC: 16-byte words (slices) per thread and chunk; SPS: k16 steps per slice
template <>
struct G2Fmt<FMT_BF16> { enum { CB = CB_BF16, WPC = WPC_BF16, SPS = 4 / WPC_BF16, GSC = 1 }; };
template <>
struct G2Fmt<FMT_Q8> { enum { CB = CB_Q8, WPC = WPC_Q8, SPS = 4 / WPC_Q8, GSC = GSC_Q8 }; };
template <>
struct G2Fmt<FMT_Q4> { enum { CB = CB_Q4, WPC = WPC_Q4, SPS = 4 / WPC_Q4, GSC = GSC_Q4 }; };

// Where a warp's slice qi lives: chunk j = qi / WPC of the warp's chunks (cs + j * kw), word
// w = qi % WPC of that chunk.
template <int FMT>
__device__ __forceinline__ void g2_slice(int qi, int cs, int kw, int& chunk, int& word) {
    typedef G2Fmt<FMT> F;
    const int j = F::WPC == 1 ? qi : qi / F::WPC;
    word = F::WPC == 1 ? 0 : qi - j * F::WPC;
    chunk = cs + j * kw;
}

// Addressing (here and in g2_next): 32-bit offsets from fixed per-warp bases, so a load costs one
// wide multiply-add instead of 64-bit pointer arithmetic; tiles are ts16 uint4 apart.
// Activations of one slice as fp32 pairs: xf[step][nt] = (k, k+1) and (k+8, k+9) of lane nt*8+g.
// One 32-bit k offset per slice; the steps are immediate offsets from it.
template <int FMT, int NT>
__device__ __forceinline__ void g2_load_x(float4 (&xf)[G2Fmt<FMT>::SPS][NT], const float* const (&xr)[NT], int chunk,
                                          int word) {
    typedef G2Fmt<FMT> F;
    const u32 ko = (u32)chunk * 64 + (u32)word * (F::SPS * 16);
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        const float* px = xr[nt] + ko;
#pragma unroll
        for (int s = 0; s < F::SPS; s++) {
            const float2 a = __ldg(reinterpret_cast<const float2*>(px + s * 16));
            const float2 b = __ldg(reinterpret_cast<const float2*>(px + s * 16 + 8));
            xf[s][nt] = make_float4(a.x, a.y, b.x, b.y);
        }
    }
}

// Refill target of a slot: tile i's word of slice `next` (valid when `refill`).
struct G2Next {
    bool refill;
    u32 o, so;  // uint4 offset of tile 0's word, u32 offset of tile 0's scale
};

template <int FMT>
__device__ __forceinline__ G2Next g2_next(bool refill, int chunk, int word) {
    typedef G2Fmt<FMT> F;
    G2Next nx;
    nx.refill = refill;
    nx.o = (u32)chunk * (F::CB / 16) + (u32)word * 32;
    nx.so = ((u32)chunk / (u32)F::GSC) * 8;
    return nx;
}

// One slice: R tiles x SPS k16 steps x NT lane tiles of mma, then the per-tile scale. Tile i's
// registers are refilled with the slot's next slice as soon as they are decoded, so about
// PIPE - 1/2 slices stay in flight on average instead of PIPE - 1 (no extra registers).
template <int FMT, int NT>
__device__ __forceinline__ void g2_compute(float (&acc)[GEMV_R][NT][4], uint4 (&buf)[GEMV_R], u32 (&sw)[GEMV_R],
                                           const float4 (&xf)[G2Fmt<FMT>::SPS][NT], const G2Next& nx,
                                           const uint4* __restrict__ wt, const u32* __restrict__ st, u32 ts16,
                                           u32 sstride) {
    typedef G2Fmt<FMT> F;
    u32 bh[F::SPS][NT][2], bl[F::SPS][NT][2];
#pragma unroll
    for (int s = 0; s < F::SPS; s++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const float4 v = xf[s][nt];
            bh[s][nt][0] = pack_bf16x2(v.x, v.y);
            bh[s][nt][1] = pack_bf16x2(v.z, v.w);
            if (FMT == FMT_BF16) {  // x = hi + lo to ~16 bits: fp32-grade products with bf16 weights
                bl[s][nt][0] = pack_bf16x2(v.x - bf16x2_lo(bh[s][nt][0]), v.y - bf16x2_hi(bh[s][nt][0]));
                bl[s][nt][1] = pack_bf16x2(v.z - bf16x2_lo(bh[s][nt][1]), v.w - bf16x2_hi(bh[s][nt][1]));
            }
        }
#pragma unroll
    for (int i = 0; i < GEMV_R; i++) {
        const uint4 v = buf[i];
        const u32 scw = sw[i];
        if (FMT == FMT_BF16) {
            // one k16 step per slice: the word is (a0, a1, a2, a3) directly
            if (nx.refill) buf[i] = ld_stream16(wt + (nx.o + i * ts16));
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                float* q = acc[i][nt];
                mma_bf16_16816(q[0], q[1], q[2], q[3], v.x, v.y, v.z, v.w, bh[0][nt][0], bh[0][nt][1]);
                mma_bf16_16816(q[0], q[1], q[2], q[3], v.x, v.y, v.z, v.w, bl[0][nt][0], bl[0][nt][1]);
            }
        } else {
            float p[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) p[nt][0] = p[nt][1] = p[nt][2] = p[nt][3] = 0.f;
#pragma unroll
            for (int s = 0; s < F::SPS; s++) {
                u32 a0, a1, a2, a3;
                if (FMT == FMT_Q4) {
                    const u32 q = s == 0 ? v.x : s == 1 ? v.y : s == 2 ? v.z : v.w;
                    a0 = g2_q4_pair(q);
                    a1 = g2_q4_pair(q >> 4);
                    a2 = g2_q4_pair(q >> 8);
                    a3 = g2_q4_pair(q >> 12);
                } else {  // q8: the word holds steps 2j (x, y) and 2j+1 (z, w)
                    const u32 wa = s == 0 ? v.x : v.z, wb = s == 0 ? v.y : v.w;
                    a0 = g2_q8_pair(wa);
                    a1 = g2_q8_pair(wa >> 8);
                    a2 = g2_q8_pair(wb);
                    a3 = g2_q8_pair(wb >> 8);
                }
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
                    mma_bf16_16816(p[nt][0], p[nt][1], p[nt][2], p[nt][3], a0, a1, a2, a3, bh[s][nt][0], bh[s][nt][1]);
            }
            // the tile's words are decoded: its registers take the slot's next slice now
            if (nx.refill) {
                buf[i] = ld_stream16(wt + (nx.o + i * ts16));
                sw[i] = __ldg(st + (nx.so + i * sstride));
            }
            const float s_lo = half_to_float((u16)(scw & 0xffffu));  // row g
            const float s_hi = half_to_float((u16)(scw >> 16));      // row g + 8
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                acc[i][nt][0] = fmaf(s_lo, p[nt][0], acc[i][nt][0]);
                acc[i][nt][1] = fmaf(s_lo, p[nt][1], acc[i][nt][1]);
                acc[i][nt][2] = fmaf(s_hi, p[nt][2], acc[i][nt][2]);
                acc[i][nt][3] = fmaf(s_hi, p[nt][3], acc[i][nt][3]);
            }
        }
    }
}

// A warp streams `n` chunks (cs, cs + kw, ...) of its row group: n * WPC slices through a ring
// of PIPE register slots. Slot p always holds slice base + p (the loop is unrolled by PIPE so the
// slot index is a compile-time constant); computing it refills it with slice base + p + PIPE.
// XPF: also load the next slice's activations one slice ahead (costs 4 x SPS x NT registers).
template <int FMT, int NT, int PIPE, bool XPF>
__device__ __forceinline__ void g2_loop(float (&acc)[GEMV_R][NT][4], const uint4* __restrict__ wt,
                                        const u32* __restrict__ st, u32 ts16, u32 sstride, int cs, int kw, int n,
                                        const float* const (&xr)[NT]) {
    typedef G2Fmt<FMT> F;
    const int total = n * F::WPC;
    uint4 buf[PIPE][GEMV_R];
    u32 sw[PIPE][GEMV_R];
    float4 xf[F::SPS][NT];
#pragma unroll
    for (int p = 0; p < PIPE; p++) {
        if (p < total) {
            int c, w;
            g2_slice<FMT>(p, cs, kw, c, w);
            const G2Next nx = g2_next<FMT>(true, c, w);
#pragma unroll
            for (int i = 0; i < GEMV_R; i++) buf[p][i] = ld_stream16(wt + (nx.o + i * ts16));
            if (FMT != FMT_BF16) {
#pragma unroll
                for (int i = 0; i < GEMV_R; i++) sw[p][i] = __ldg(st + (nx.so + i * sstride));
            }
        }
    }
    if (XPF && total > 0) {
        int c, w;
        g2_slice<FMT>(0, cs, kw, c, w);
        g2_load_x<FMT, NT>(xf, xr, c, w);
    }
    for (int base = 0; base < total; base += PIPE) {
#pragma unroll
        for (int p = 0; p < PIPE; p++) {
            const int qi = base + p;
            if (qi < total) {
                float4 xc[F::SPS][NT];
                if (XPF) {
#pragma unroll
                    for (int s = 0; s < F::SPS; s++)
#pragma unroll
                        for (int nt = 0; nt < NT; nt++) xc[s][nt] = xf[s][nt];
                    if (qi + 1 < total) {
                        int c, w;
                        g2_slice<FMT>(qi + 1, cs, kw, c, w);
                        g2_load_x<FMT, NT>(xf, xr, c, w);
                    }
                } else {
                    int c, w;
                    g2_slice<FMT>(qi, cs, kw, c, w);
                    g2_load_x<FMT, NT>(xc, xr, c, w);
                }
                int c, w;
                g2_slice<FMT>(qi + PIPE, cs, kw, c, w);
                const G2Next nx = g2_next<FMT>(qi + PIPE < total, c, w);
                g2_compute<FMT, NT>(acc, buf[p], sw[p], xc, nx, wt, st, ts16, sstride);
            }
        }
    }
}

// A CTA owns one unit = (row block of D_RGB row groups, K split). Warp w works on row group
// w / kw of the block and on every kw-th chunk of the split (kw = G2_WARPS / D_RGB), so the
// D_RGB warps with the same w % kw read the same activations. Partials reduce through shared
// memory in fixed warp order; with splits > 1 the CTA that arrives last for its row block sums
// the split partials in split order and runs the epilogue.
template <int FMT, int NT, int PIPE, bool XPF>
__device__ __forceinline__ void gemv2_body(const i64* __restrict__ desc, int nmat, const float* __restrict__ x,
                                           int ldx, int nlanes, int lane0) {
    constexpr int COLS = NT * 8, E = GEMV_R * 16 * COLS;  // one row group's partial tile
    __shared__ __align__(16) float red[G2_WARPS][E];
    __shared__ int s_last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, tid = threadIdx.x;
    x += (i64)lane0 * ldx;
    const float* xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) xr[nt] = x + (i64)min(nt * 8 + g, nlanes - 1) * ldx + 2 * t;

    const int u = blockIdx.x;
    int m = 0;
    for (int i = 1; i < nmat; i++)
        if (u >= (int)desc[i * D_NFIELDS + D_CTA0]) m = i;
    const i64* d = desc + m * D_NFIELDS;
    const u8* w = reinterpret_cast<const u8*>(d[D_W]);
    const u32* sc = reinterpret_cast<const u32*>(d[D_S]);
    const int kch = (int)d[D_KCH], splits = (int)d[D_SPLITS], rgt = (int)d[D_RG], rgb = (int)d[D_RGB];
    const int ngroups = (int)d[D_NGROUPS];
    const int local = u - (int)d[D_CTA0];
    const int rb = local / splits, sp = local - rb * splits;
    const int kw = G2_WARPS / rgb;
    const int rgl = warp / kw, kk = warp - rgl * kw;
    const int rg = rb * rgb + rgl;
    const int c0 = (int)((i64)sp * kch / splits), c1 = (int)((i64)(sp + 1) * kch / splits);
    const int cs = c0 + kk;
    const int n = (rg < rgt && cs < c1) ? (c1 - cs + kw - 1) / kw : 0;

    float acc[GEMV_R][NT][4];
#pragma unroll
    for (int i = 0; i < GEMV_R; i++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) acc[i][nt][0] = acc[i][nt][1] = acc[i][nt][2] = acc[i][nt][3] = 0.f;
    {
        const u32 ts16 = (u32)kch * (G2Fmt<FMT>::CB / 16), sstride = (u32)ngroups * 8;
        const uint4* wt = reinterpret_cast<const uint4*>(w) + (i64)rg * GEMV_R * ts16 + lane;
        const u32* st = FMT == FMT_BF16 ? sc : sc + (i64)rg * GEMV_R * sstride + g;
        g2_loop<FMT, NT, PIPE, XPF>(acc, wt, st, ts16, sstride, cs, kw, n, xr);
    }
    gemv_store_partial<NT>(red, warp, acc, g, t);
    __syncthreads();
    // epilogue parameters are read only now: nothing of them stays live through the stream loop
    const int ldy = (int)d[D_LDY], nout = (int)d[D_NOUT], mode = (int)d[D_MODE];
    float* y = reinterpret_cast<float*>(d[D_Y]) + (i64)lane0 * ldy;
    // The block's rgb row groups: element e of group r is the sum over that group's kw warps, in
    // warp order, written back to the group's first warp slot (one thread per element).
    const int EB = rgb * E;
    float* res = &red[0][0];  // group r's result lives at res[r * kw * E + e]
    for (int e = tid; e < EB; e += blockDim.x) {
        const int r = e / E, el = e - r * E;
        const float* src = &red[r * kw][el];
        float v = src[0];
        for (int wi = 1; wi < kw; wi++) v += src[wi * E];
        res[r * kw * E + el] = v;
    }
    if (splits > 1) {
        float* ws = reinterpret_cast<float*>(d[D_WS]);
        int* cnt = reinterpret_cast<int*>(d[D_CNT]);
        float* mine = ws + ((i64)rb * splits + sp) * EB;
        __syncthreads();
        for (int e = tid; e < EB; e += blockDim.x) {
            const int r = e / E;
            mine[e] = res[r * kw * E + (e - r * E)];
        }
        __threadfence();
        __syncthreads();
        if (tid == 0) s_last = (atomicAdd(cnt + rb, 1) == splits - 1);
        __syncthreads();
        if (!s_last) return;
        __threadfence();
        const float* all = ws + (i64)rb * splits * EB;
        for (int e = tid; e < EB; e += blockDim.x) {
            float v = __ldcg(all + e);
            for (int s2 = 1; s2 < splits; s2++) v += __ldcg(all + (i64)s2 * EB + e);
            const int r = e / E;
            res[r * kw * E + (e - r * E)] = v;
        }
        if (tid == 0) cnt[rb] = 0;  // every other CTA of this row block has already counted in
    }
    __syncthreads();
    for (int e = tid; e < EB; e += blockDim.x) {
        const int r = e / E, el = e - r * E;
        const int rgo = rb * rgb + r;
        const int rl = el / COLS, ln = el - rl * COLS;
        if (rgo >= rgt || ln >= nlanes) continue;
        const float v = res[r * kw * E + el];
        if (mode == MODE_SWIGLU) {
            // rows 0..7 of a tile are gate rows, 8..15 the matching up rows
            if ((rl & 15) >= 8) continue;
            const int o = (rgo * GEMV_R + (rl >> 4)) * 8 + (rl & 7);
            if (o >= nout) continue;
            const float up = res[r * kw * E + el + 8 * COLS];
            y[(i64)ln * ldy + o] = v * sigmoid_f(v) * up;
        } else {
            const int row = rgo * GEMV_R * 16 + rl;
            if (row >= nout) continue;
            float* dst = y + (i64)ln * ldy + row;
            if (mode == MODE_ADD)
                *dst += v;
            else
                *dst = v;
        }
    }
}

// One kernel per (format, lane tiles). Resident CTAs of 4 warps per SM (launch bounds, constants
// table): 4 at 1-8 lanes (128 registers), 3 at 9-16 (168), 2 for q8 at 9-16 (255, deeper pipeline).
#define GEMV2_KERNEL(NAME, FMT, NT, PIPE, XPF, MINB)                                                        \
    extern "C" __global__ void __launch_bounds__(G2_WARPS * 32, MINB)                                      \
        NAME(const i64* __restrict__ desc, int nmat, const float* __restrict__ x, int ldx, int nlanes,      \
             int lane0) {                                                                                  \
        pdl_entry();                                                                                       \
        gemv2_body<FMT, NT, PIPE, XPF>(desc, nmat, x, ldx, nlanes, lane0);                                  \
    }

GEMV2_KERNEL(gemv2_q4_nt1, FMT_Q4, 1, PIPE_Q4, true, G2_CTAS_NT1)
GEMV2_KERNEL(gemv2_q4_nt2, FMT_Q4, 2, PIPE2_Q4, false, G2_CTAS_NT2)
GEMV2_KERNEL(gemv2_q8_nt1, FMT_Q8, 1, PIPE_Q8, true, G2_CTAS_NT1)
GEMV2_KERNEL(gemv2_q8_nt2, FMT_Q8, 2, PIPE2_Q8, false, G2_CTAS_NT2_Q8)
GEMV2_KERNEL(gemv2_bf16_nt1, FMT_BF16, 1, PIPE_BF16, true, G2_CTAS_NT1)
GEMV2_KERNEL(gemv2_bf16_nt2, FMT_BF16, 2, PIPE2_BF16, false, G2_CTAS_NT2)
