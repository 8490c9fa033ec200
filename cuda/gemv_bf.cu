// A weight-streaming q4 GEMV for wide lane counts on warpgroup MMA with bf16 activations (sm_90a only;
// a prototype measured by tools/gemv_bf_probe.py, not yet a route of kernels.GemvPlan).
//
// Why: the a8 kernels (cuda/gemv.cu, cuda/gemv_wg.cu) keep their int32 chunk sums exact and scale each
// one in fp32 in gemv.cu's order, so every 64-k chunk ends in an epilogue of ~3 instructions per (row,
// lane) term and 8 residue partials per term live in registers: the cost grows with the lane count
// (docs/PERF.md: at 32 lanes the epilogue is half the loop, two CTAs per SM, the family at ~20% of the
// H200's read probe). Here the weights are dequantized with their group scale folded in, w = bf16(code *
// bf16(scale)), straight into wgmma's register A fragment, and the tensor cores accumulate each (row,
// lane) in fp32 across the unit's whole K: the per-chunk work is per weight (3 shifts, 4 LOP3 and 8
// HFMA2 per 8 codes), not per term, so the loop is the same length at 8, 16, 32 or 64 lanes and only
// the accumulators (NL / 2 floats a thread) grow.
//
// Numerics: its own class (not bitwise the a8 tier): one bf16 rounding of each scaled weight (2^-9
// relative, against q4's ~1/16 quantization step) and of each activation, fp32 accumulation in the
// tensor cores' order -- the numerics of the prefill's cuBLAS route on bf16 expansions (blas.py), and
// finer than a8's int8 activations (2^-8 of each chunk's max). Whether lane n's output is the same bits
// at every launch width is a property of wgmma's fp32 accumulation, checked on the device by the probe.
//
// Data: the q4 packing is mma.m16n8k16's A-fragment order (cuda/gemv.cu), which is also wgmma's register
// A layout for a warp's 16 rows, so thread (g, t) reads its own 16-byte fragment per chunk and k runs in
// natural order: the activations are bf16 rows [lane][k], copied 16 bytes at a time into wgmma's
// K-major, no-swizzle canonical B layout (the same geometry as gemv_wg.cu's int8 k32 steps: a bf16 k16
// step is 32 bytes a lane too).
#include "common.cuh"
#define GSTAMP(i)
#include "gemv_common.cuh"

#if defined(Q27_ARCH_SPECIFIC) && defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "gemv_bf was asked for sm_90a but is being built without its features"
#endif

typedef unsigned long long u64;

// One ring stage: CPS consecutive chunks: the 4 tiles' fragments (512 B a warp), their scale words
// (8 per tile), the NL lanes' 64 bf16 activations (NL x 128 B)
template <int NL, int CPS>
struct WbStage {
    enum {
        WC = GEMV_R * 512,
        XC = NL * 128,
        W_OFF = 0,
        S_OFF = W_OFF + CPS * WC,
        X_OFF = S_OFF + CPS * GEMV_R * 32,
        BYTES = X_OFF + CPS * XC
    };
};

// byte of activation piece q (8 k: k16 step q >> 1, its core-matrix column q & 1) of lane n in a chunk's B region
template <int NL>
__device__ __forceinline__ u32 wb_act_off(int n, int q) {
    return (u32)((q >> 1) * NL * 32 + (n >> 3) * 256 + (q & 1) * 128 + (n & 7) * 16);
}

__device__ __forceinline__ u64 wb_desc(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(128 >> 4) << 16) | ((u64)(256 >> 4) << 32);
}

// w = bf16(code * s) for the pair of nibbles at bits (0, 16) of q: the code exactly ((128 + n) - 136, gemv.cu's
// q4_pair), then one rounding by the scale pair s2. (A nibble at bits 4-7 cannot take the same magic: bit 7 is
// bf16's lowest exponent bit, so every pair needs its shift, as in gemv.cu.)
__device__ __forceinline__ u32 wb_w2(u32 q, u32 s2) {
    const u32 c = fma_bf16x2((q & 0x000F000Fu) | 0x43004300u, 0x3F803F80u, 0xC308C308u);
    return fma_bf16x2(c, s2, 0x80008000u);  // c * s2 + (-0): one round to nearest even
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wb_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wb_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wb_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void wb_fence_proxy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// D (64 x NL fp32) += A (64 x 16 bf16, registers) B (16 x NL bf16, shared memory)
template <int NL>
__device__ __forceinline__ void wb_mma(float (&d)[NL / 2], const u32 (&a)[4], u64 db);
template <>
__device__ __forceinline__ void wb_mma<8>(float (&d)[4], const u32 (&a)[4], u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, 1, 1, 1, 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
template <>
__device__ __forceinline__ void wb_mma<16>(float (&d)[8], const u32 (&a)[4], u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, 1, 1, 1, 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
template <>
__device__ __forceinline__ void wb_mma<32>(float (&d)[16], const u32 (&a)[4], u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, 1, 1, 1, 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
template <>
__device__ __forceinline__ void wb_mma<64>(float (&d)[32], const u32 (&a)[4], u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

template <int N>
__device__ __forceinline__ void wb_reg_fence(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// One unit (64 rows x chunks c0 .. c1 - 1 of its split) for NL lanes: a ring of S stages of CPS chunks,
// one __syncthreads a stage; the tensor cores accumulate across every chunk; gemv_unit_finish as gemv_wg.
template <int NL, int CPS, int S>
__device__ __forceinline__ void wb_body(const i64* __restrict__ desc, int nmat, const u16* __restrict__ xb, int ldx,
                                        int nlanes, int lane0) {
    typedef WbStage<NL, CPS> SG;
    static_assert(NL == 8 || NL == 16 || NL == 32 || NL == 64, "wb_mma's shapes");
    static_assert(CPS * NL * 8 % 128 == 0, "whole activation pieces per thread");
    constexpr int ND = NL / 2, XP = CPS * NL * 8 / 128;
    extern __shared__ __align__(128) u8 dyn_smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2;

    const int u = blockIdx.x;
    const i64* d = gemv_unit_desc(desc, nmat, u);
    const u8* w = reinterpret_cast<const u8*>(d[D_W]);
    const u32* sc = reinterpret_cast<const u32*>(d[D_S]);
    const int ldy = (int)d[D_LDY], nout = (int)d[D_NOUT], kch = (int)d[D_KCH];
    const int mode = (int)d[D_MODE], splits = (int)d[D_SPLITS], ngroups = (int)d[D_NGROUPS];
    float* y = reinterpret_cast<float*>(d[D_Y]) + (i64)lane0 * ldy;
    const int local = u - (int)d[D_CTA0];
    const int rg = local / splits, sp = local - rg * splits;
    const int c0 = (int)((i64)sp * kch / splits), c1 = (int)((i64)(sp + 1) * kch / splits);
    const int nch = c1 - c0, nst = (nch + CPS - 1) / CPS, nfull = nch / CPS;

    const int tstride = kch * CB_Q4, sstride = ngroups * 8;
    const u8* wsrc = w + (i64)(rg * GEMV_R + warp) * tstride + lane * 16;
    const u32 wdst = SG::W_OFF + warp * 512 + lane * 16;
    const int sj = tid >> 3, sw = (tid >> 1) & 3, sh = tid & 1;
    const u32* ssrc = sc + (i64)(rg * GEMV_R + sw) * sstride + sh * 4;
    const u32 sdst = SG::S_OFF + (sj * GEMV_R + sw) * 32 + sh * 16;
    // activation pieces: p = tid + 128 e over the stage's CPS x NL x 8 pieces (chunk j, lane ln, piece q)
    const u8* xsrc[XP];
    u32 xdst[XP];
    int xj[XP];
#pragma unroll
    for (int e = 0; e < XP; e++) {
        const int p = tid + e * 128, j = p / (NL * 8), ln = (p >> 3) % NL, q = p & 7;
        xj[e] = j;
        xsrc[e] = reinterpret_cast<const u8*>(xb + (i64)min(ln, nlanes - 1) * ldx + j * 64 + q * 8);
        xdst[e] = SG::X_OFF + j * SG::XC + wb_act_off<NL>(ln, q);
    }
    const u32 ring = smem_addr(dyn_smem);
    auto issue = [&](int slot, int k, bool weights, bool acts) {
        const int c = c0 + k * CPS;
        const bool full = k < nfull;
        const u32 base = ring + slot * SG::BYTES;
        if (weights) {
#pragma unroll
            for (int j = 0; j < CPS; j++)
                if (full || c + j < c1) cp_async_cg16(base + wdst + j * SG::WC, wsrc + (i64)(c + j) * CB_Q4);
            if (tid < CPS * 8 && (full || c + sj < c1))
                cp_async_ca16(base + sdst, ssrc + (((unsigned)(c + sj) / GSC_Q4) << 3));
        }
        if (acts) {
#pragma unroll
            for (int e = 0; e < XP; e++)
                if (full || c + xj[e] < c1) cp_async_ca16(base + xdst[e], xsrc[e] + (i64)c * 128);
        }
    };

    // the weights are constants: their first S - 1 stages go out before the wait on the activations' writer (PDL)
#pragma unroll 1
    for (int k = 0; k < S - 1; k++)
        if (k < nst) issue(k, k, true, false);
    pdl_wait();
    pdl_trigger();
#pragma unroll 1
    for (int k = 0; k < S - 1; k++) {
        if (k < nst) issue(k, k, false, true);
        cp_async_commit();
    }

    float acc[ND];
#pragma unroll
    for (int i = 0; i < ND; i++) acc[i] = 0.f;
    const u64 xdesc0 = wb_desc(ring + SG::X_OFF);
    int rd = 0, wr = S - 1;
#pragma unroll 1
    for (int k = 0; k < nst; k++) {
        cp_async_wait<S - 2>();
        wb_fence_proxy();
        __syncthreads();
        if (k + S - 1 < nst) issue(wr, k + S - 1, true, true);
        cp_async_commit();
        const u8* st = dyn_smem + rd * SG::BYTES;
        const u64 xd = xdesc0 + (u64)((rd * SG::BYTES) >> 4);
        const int nj = min(CPS, c1 - (c0 + k * CPS));  // the unit's last stage may hold fewer chunks
        u32 a[CPS][4][4];
#pragma unroll
        for (int j = 0; j < CPS; j++) {
            if (j < nj) {
                const uint4 wv = *reinterpret_cast<const uint4*>(st + SG::W_OFF + j * SG::WC + warp * 512 + lane * 16);
                const u32 sv = *reinterpret_cast<const u32*>(st + SG::S_OFF + (j * GEMV_R + warp) * 32 + g * 4);
                const float slo = half_to_float((u16)(sv & 0xffffu)), shi = half_to_float((u16)(sv >> 16));
                const u32 s2lo = pack_bf16x2(slo, slo), s2hi = pack_bf16x2(shi, shi);  // rows g, g + 8
                const u32 wq[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
                for (int s = 0; s < 4; s++) {
                    const u32 q = wq[s];
                    a[j][s][0] = wb_w2(q, s2lo);        // row g,     k 16 s + 2 t + {0, 1}
                    a[j][s][1] = wb_w2(q >> 4, s2hi);   // row g + 8, the same k
                    a[j][s][2] = wb_w2(q >> 8, s2lo);   // row g,     k 16 s + 2 t + {8, 9}
                    a[j][s][3] = wb_w2(q >> 12, s2hi);  // row g + 8
                }
            }
        }
        wb_fence();
#pragma unroll
        for (int j = 0; j < CPS; j++)
            if (j < nj) {
#pragma unroll
                for (int s = 0; s < 4; s++) wb_mma<NL>(acc, a[j][s], xd + ((j * SG::XC + s * NL * 32) >> 4));
            }
        wb_commit();
        wb_wait0();
        wb_reg_fence(acc);
        rd = rd + 1 == S ? 0 : rd + 1;
        wr = wr + 1 == S ? 0 : wr + 1;
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring becomes the unit's tile
    float* red0 = reinterpret_cast<float*>(dyn_smem);
    const int t = lane & 3;
#pragma unroll
    for (int i = 0; i < NL / 8; i++)
#pragma unroll
        for (int q = 0; q < 4; q++)
            red0[(warp * 16 + g + 8 * (q >> 1)) * NL + 8 * i + 2 * t + (q & 1)] = acc[4 * i + q];
    __syncthreads();
    gemv_unit_finish<NL>(d, red0, rg, sp, splits, min(nlanes, NL), y, ldy, nout, mode);
}
#endif

// xb: bf16 activation rows [lane][ldx] (lanes lane0 .. lane0 + nlanes - 1 of the launch at rows 0 .. nlanes - 1;
// lanes past nlanes repeat the last); y rows from lane0 (the plan's descriptors, as gemv_wg's)
#define WB_KERNEL(NAME, NL, CPS, S, CTAS)                                                                      \
    extern "C" __global__ void __launch_bounds__(128, CTAS)                                                    \
        NAME(const i64* __restrict__ desc, int nmat, int units, const u16* __restrict__ xb, int ldx,           \
             int nlanes, int lane0) {                                                                          \
        WB_CALL(NL, CPS, S)                                                                                    \
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WB_CALL(NL, CPS, S) wb_body<NL, CPS, S>(desc, nmat, xb, ldx, nlanes, lane0);
#else
#define WB_CALL(NL, CPS, S) __trap();  // built for sm_90a only
#endif
// gemvb_q4_n<lanes>_c<chunks a stage>s<stages>k<CTAs per SM>: the probe's variants
WB_KERNEL(gemvb_q4_n8_c2s6k5, 8, 2, 6, 5)
WB_KERNEL(gemvb_q4_n8_c4s4k4, 8, 4, 4, 4)
WB_KERNEL(gemvb_q4_n16_c2s6k4, 16, 2, 6, 4)
WB_KERNEL(gemvb_q4_n16_c4s4k3, 16, 4, 4, 3)
WB_KERNEL(gemvb_q4_n32_c2s5k3, 32, 2, 5, 3)
WB_KERNEL(gemvb_q4_n32_c4s3k2, 32, 4, 3, 2)
WB_KERNEL(gemvb_q4_n64_c2s4k2, 64, 2, 4, 2)
WB_KERNEL(gemvb_q4_n64_c1s6k2, 64, 1, 6, 2)
