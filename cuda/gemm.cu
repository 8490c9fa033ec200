// Prefill GEMM on tensor cores: Y[t][row] (op)= sum_k W[row][k] * bf16(X[t][k]) for many
// tokens, W in the packed q4/q8 GEMV layout (docs/FORMAT.md), fp32 accumulate.
//
// A CTA computes 128 rows (8 warps, one 16-row tile each) x 64 tokens. Per 64-k chunk the CTA
// converts the activation tile (64 tokens x 64 k, fp32 -> bf16) into shared memory once, and
// every warp reuses it for its 8 token tiles: 32 mma.m16n8k16 per warp per chunk against one
// 16-byte weight fragment load, so weights are read once per 64 tokens instead of once per 16
// (the GEMV). Weight fragments stream through a per-warp cp.async ring as in the GEMV.
// Numerics: the GEMV's quantized path (bf16 activations, per-chunk fp32 scaling), summed over
// the chunks in order -- not bitwise equal to the GEMV's split order, tolerance-equal.
#include "common.cuh"



__device__ __forceinline__ u32 gm_q4_pair(u32 q) {
    return fma_bf16x2((q & 0x000F000Fu) | 0x43004300u, 0x3F803F80u, 0xC308C308u);
}
__device__ __forceinline__ u32 gm_q8_pair(u32 v) {
    u32 x = (v & 0x007F007Fu) | 0x43004300u;
    u32 c = (v & 0x00800080u) ^ 0x43804380u;
    return fma_bf16x2(c, 0xBF80BF80u, x);
}

// grid (ceil(row_tiles / 8), ceil(T / 64)), block 256, dynamic smem:
//   2 x 64 x GM_XS bf16 (activation tiles) + GM_STAGES x 256 x (WPC*16 + 4) (weight rings)
template <int FMT>
__device__ __forceinline__ void gemm_body(const u8* __restrict__ w, const u32* __restrict__ sc, int kch, int ngroups,
                                          int row_tiles, const float* __restrict__ x, int ldx, int ntok,
                                          float* __restrict__ y, int ldy, int nout, int mode) {
    constexpr int WPC = FMT == FMT_Q8 ? WPC_Q8 : WPC_Q4;
    constexpr int CB = FMT == FMT_Q8 ? CB_Q8 : CB_Q4;
    constexpr unsigned GSC = FMT == FMT_Q8 ? GSC_Q8 : GSC_Q4;  // chunks per scale group
    constexpr int SLOT = WPC * 16 + 4;  // bytes per thread per stage
    extern __shared__ __align__(16) u8 gsm[];
    u16* xs = reinterpret_cast<u16*>(gsm);                       // [2][64][GM_XS]
    u8* ring = gsm + 2 * GM_TOK * GM_XS * 2;                      // [stage][thread] slots
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int rt = blockIdx.x * GM_WARPS + warp;
    const int rtc = min(rt, row_tiles - 1);
    const int t0 = blockIdx.y * GM_TOK;

    // weight ring (per thread)
    const u8* wb = w + (i64)rtc * kch * CB + lane * 16;
    const u32* sb = sc + (i64)rtc * ngroups * 8 + g;
    // stage layout: [word j][thread] 16-byte weight words, then [thread] 4-byte scale words
    const u32 rbase = smem_addr(ring);
    auto issue = [&](int stage, int c) {
        const u32 d = rbase + stage * 256 * SLOT;
#pragma unroll
        for (int j = 0; j < WPC; j++) cp_async_cg16(d + (j * 256 + tid) * 16, wb + (i64)c * CB + j * 512);
        cp_async_ca4(d + WPC * 256 * 16 + tid * 4, sb + (((unsigned)c / GSC) << 3));
    };
    // activation tile loader: thread covers 16 consecutive floats of one token row
    const int xt = tid >> 2, xk = (tid & 3) * 16;
    const float* xrow = x + (i64)min(t0 + xt, ntok - 1) * ldx + xk;
    float4 xv[4];
    auto load_x = [&](int c) {
#pragma unroll
        for (int i = 0; i < 4; i++) xv[i] = *reinterpret_cast<const float4*>(xrow + c * 64 + 4 * i);
    };
    auto store_x = [&](int buf) {
        u32* dst = reinterpret_cast<u32*>(xs + (buf * GM_TOK + xt) * GM_XS + xk);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            dst[2 * i] = pack_bf16x2(xv[i].x, xv[i].y);
            dst[2 * i + 1] = pack_bf16x2(xv[i].z, xv[i].w);
        }
    };

#pragma unroll
    for (int k = 0; k < GM_STAGES - 1; k++) {
        if (k < kch) issue(k, k);
        cp_async_commit();
    }
    load_x(0);
    store_x(0);
    __syncthreads();

    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    int rd = 0, wr = GM_STAGES - 1;
    for (int c = 0; c < kch; c++) {
        const int buf = c & 1;
        if (c + 1 < kch) load_x(c + 1);  // global loads in flight during the math
        cp_async_wait<GM_STAGES - 2>();
        uint4 wv[WPC];
        const u8* st = ring + rd * 256 * SLOT;
#pragma unroll
        for (int j = 0; j < WPC; j++) wv[j] = *reinterpret_cast<const uint4*>(st + (j * 256 + tid) * 16);
        const u32 sv = *reinterpret_cast<const u32*>(st + WPC * 256 * 16 + tid * 4);
        if (c + GM_STAGES - 1 < kch) issue(wr, c + GM_STAGES - 1);
        cp_async_commit();
        rd = rd + 1 == GM_STAGES ? 0 : rd + 1;
        wr = wr + 1 == GM_STAGES ? 0 : wr + 1;

        float p[8][4];
#pragma unroll
        for (int j = 0; j < 8; j++) p[j][0] = p[j][1] = p[j][2] = p[j][3] = 0.f;
        const u16* xb = xs + buf * GM_TOK * GM_XS;
#pragma unroll
        for (int s = 0; s < 4; s++) {
            u32 a0, a1, a2, a3;
            if (FMT == FMT_Q4) {
                const u32 q = s == 0 ? wv[0].x : s == 1 ? wv[0].y : s == 2 ? wv[0].z : wv[0].w;
                a0 = gm_q4_pair(q); a1 = gm_q4_pair(q >> 4); a2 = gm_q4_pair(q >> 8); a3 = gm_q4_pair(q >> 12);
            } else {
                const uint4 v = wv[(s >> 1) & (WPC - 1)];
                const u32 wa = (s & 1) ? v.z : v.x, wbb = (s & 1) ? v.w : v.y;
                a0 = gm_q8_pair(wa); a1 = gm_q8_pair(wa >> 8); a2 = gm_q8_pair(wbb); a3 = gm_q8_pair(wbb >> 8);
            }
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const u16* xr = xb + (8 * j + g) * GM_XS + 16 * s + 2 * t;
                const u32 b0 = *reinterpret_cast<const u32*>(xr);
                const u32 b1 = *reinterpret_cast<const u32*>(xr + 8);
                mma_bf16_16816(p[j][0], p[j][1], p[j][2], p[j][3], a0, a1, a2, a3, b0, b1);
            }
        }
        const float s_lo = half_to_float((u16)(sv & 0xffffu)), s_hi = half_to_float((u16)(sv >> 16));
#pragma unroll
        for (int j = 0; j < 8; j++) {
            acc[j][0] = fmaf(s_lo, p[j][0], acc[j][0]);
            acc[j][1] = fmaf(s_lo, p[j][1], acc[j][1]);
            acc[j][2] = fmaf(s_hi, p[j][2], acc[j][2]);
            acc[j][3] = fmaf(s_hi, p[j][3], acc[j][3]);
        }
        if (c + 1 < kch) store_x(buf ^ 1);
        __syncthreads();  // next tile visible; this tile free for chunk c + 2
    }
    cp_async_wait<0>();
    if (rt >= row_tiles) return;
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int tok = t0 + 8 * j + 2 * t + h;
            if (tok >= ntok) continue;
            float* yl = y + (i64)tok * ldy;
            if (mode == MODE_SWIGLU) {
                const int o = rt * 8 + g;  // tile rows 0..7 gate, 8..15 up
                if (o < nout) {
                    const float gt = acc[j][h], up = acc[j][2 + h];
                    yl[o] = gt * sigmoid_f(gt) * up;
                }
            } else {
#pragma unroll
                for (int hi = 0; hi < 2; hi++) {
                    const int row = rt * 16 + g + 8 * hi;
                    if (row >= nout) continue;
                    if (mode == MODE_ADD)
                        yl[row] += acc[j][2 * hi + h];
                    else
                        yl[row] = acc[j][2 * hi + h];
                }
            }
        }
}

#define GEMM_KERNEL(NAME, FMT)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                        \
        NAME(const u8* w, const u32* sc, int kch, int ngroups, int row_tiles, const float* x, int ldx, int ntok, \
             float* y, int ldy, int nout, int mode) {                                                           \
        gemm_body<FMT>(w, sc, kch, ngroups, row_tiles, x, ldx, ntok, y, ldy, nout, mode);                       \
    }

GEMM_KERNEL(gemm_q4, FMT_Q4)
GEMM_KERNEL(gemm_q8, FMT_Q8)
