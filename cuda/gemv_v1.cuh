// The v1 GEMV unit (gemv.cu): formats, the per-warp cp.async ring, the chunk products and gemv_body, as one
// header so that gemv_wg.cu can run v1 units in its own launches (gemv8w_*_g: the GDN layer's bf16 gates beside
// qkvz in one grid). Included after common.cuh and gemv_common.cuh (GSTAMP defined by the includer).
#pragma once

// Formats, modes, GEMV_R, GEMV_WARPS, ring depths and the descriptor fields (D_*) come from the
// constants table (q27py/gpu/constants.py) as -D defines; gemv2.cu shares the descriptor.

__device__ __forceinline__ void split_bf16(float2 v, u32& hi, u32& lo) {
    hi = pack_bf16x2(v.x, v.y);
    lo = pack_bf16x2(v.x - bf16x2_lo(hi), v.y - bf16x2_hi(hi));
}

// int4 nibbles at bits (4p, 16+4p) -> bf16x2 (code - 8), exact
__device__ __forceinline__ u32 q4_pair(u32 q) {
    return fma_bf16x2((q & 0x000F000Fu) | 0x43004300u, 0x3F803F80u, 0xC308C308u);  // (128+n)*1 - 136
}

// biased int8 bytes at bits (0, 16) -> bf16x2 (byte - 128), exact
__device__ __forceinline__ u32 q8_pair(u32 v) {
    u32 x = (v & 0x007F007Fu) | 0x43004300u;   // 128 + low7
    u32 c = (v & 0x00800080u) ^ 0x43804380u;   // 256 if the top bit is clear, else 128
    return fma_bf16x2(c, 0xBF80BF80u, x);      // x - c
}

__device__ __forceinline__ u32 prmt_b32(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// D = A(16x32 s8, row) * B(32x8 s8, col) + C (s32). Fragment layout: PTX ISA, mma.m16n8k32.
__device__ __forceinline__ void mma_s8_16832(int& d0, int& d1, int& d2, int& d3, u32 a0, u32 a1, u32 a2, u32 a3,
                                             u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(d0), "+r"(d1), "+r"(d2), "+r"(d3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int FMT>
struct FmtInfo;
template <>
struct FmtInfo<FMT_BF16> { enum { CB = CB_BF16, WPC = WPC_BF16 }; };  // chunk bytes, uint4 words per thread
template <>
struct FmtInfo<FMT_Q8> { enum { CB = CB_Q8, WPC = WPC_Q8 }; };
template <>
struct FmtInfo<FMT_Q4> { enum { CB = CB_Q4, WPC = WPC_Q4 }; };

template <int FMT>
__device__ __forceinline__ void frag_a(const uint4 (&wv)[FmtInfo<FMT>::WPC], int s, u32& a0, u32& a1, u32& a2, u32& a3) {
    if (FMT == FMT_BF16) {
        const uint4 v = wv[s & (FmtInfo<FMT>::WPC - 1)];
        a0 = v.x; a1 = v.y; a2 = v.z; a3 = v.w;
    } else if (FMT == FMT_Q8) {
        const uint4 v = wv[(s >> 1) & (FmtInfo<FMT>::WPC - 1)];
        const u32 wa = (s & 1) ? v.z : v.x;
        const u32 wb = (s & 1) ? v.w : v.y;
        a0 = q8_pair(wa); a1 = q8_pair(wa >> 8); a2 = q8_pair(wb); a3 = q8_pair(wb >> 8);
    } else {
        const uint4 v = wv[0];
        const u32 q = s == 0 ? v.x : s == 1 ? v.y : s == 2 ? v.z : v.w;
        a0 = q4_pair(q); a1 = q4_pair(q >> 4); a2 = q4_pair(q >> 8); a3 = q4_pair(q >> 12);
    }
}

// Weights stream through a per-thread ring of shared-memory stages filled by cp.async (each
// thread copies exactly the 16-byte fragments it will consume, so no barrier is needed, only
// cp.async.wait_group): STAGES-1 chunks are in flight while one is computed.
template <int FMT>
struct Ring;
template <>
struct Ring<FMT_BF16> { enum { STAGES = RING_BF16 }; };
template <>
struct Ring<FMT_Q8> { enum { STAGES = RING_Q8 }; };
template <>
struct Ring<FMT_Q4> { enum { STAGES = RING_Q4 }; };

template <int FMT>
__host__ __device__ constexpr int ring_bytes() {
    return Ring<FMT>::STAGES * GEMV_R * (FmtInfo<FMT>::WPC * 16 + 4) * GEMV_WARPS * 32;
}


// Slot layout [stage][tile][word][thread] (uint4) then [stage][tile][thread] (scale word): a
// warp's 32 threads touch 512 consecutive bytes, conflict-free.
// wslot/sslot: this thread's first weight word / scale word in the stage (shared addresses).
// wc: this chunk of tile 0 (lane offset included); tiles are tstride bytes apart in memory.
template <int FMT, int TH = GEMV_WARPS * 32>  // TH: the threads whose slots a stage holds (RingCfg)
__device__ __forceinline__ void issue_stage(u32 wslot, u32 sslot, const u8* wc, const u32* scc, int tstride,
                                            int sstride) {
    typedef FmtInfo<FMT> F;
    constexpr int T = TH;
#pragma unroll
    for (int i = 0; i < GEMV_R; i++) {
#pragma unroll
        for (int j = 0; j < F::WPC; j++) cp_async_cg16(wslot + (i * F::WPC + j) * T * 16, wc + i * tstride + j * 512);
        if (FMT != FMT_BF16) cp_async_ca4(sslot + i * T * 4, scc + i * sstride);
    }
}

template <int FMT>
struct Stage {
    uint4 wv[GEMV_R][FmtInfo<FMT>::WPC];
    u32 sv[GEMV_R];
};

template <int FMT, int TH = GEMV_WARPS * 32>
__device__ __forceinline__ void read_stage(Stage<FMT>& st, const u8* wslot, const u8* sslot) {
    typedef FmtInfo<FMT> F;
    constexpr int T = TH;
#pragma unroll
    for (int i = 0; i < GEMV_R; i++) {
#pragma unroll
        for (int j = 0; j < F::WPC; j++) st.wv[i][j] = *reinterpret_cast<const uint4*>(wslot + (i * F::WPC + j) * T * 16);
        if (FMT != FMT_BF16) st.sv[i] = *reinterpret_cast<const u32*>(sslot + i * T * 4);
    }
}

template <int FMT, int NT>
__device__ __forceinline__ void compute_stage(float (&acc)[GEMV_R][NT][4], const Stage<FMT>& st, int c,
                                              const float* const (&xr)[NT]) {
    // Step-outer order keeps only one k16 step of activation fragments live.
    float p[GEMV_R][NT][4];
#pragma unroll
    for (int i = 0; i < GEMV_R; i++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) p[i][nt][0] = p[i][nt][1] = p[i][nt][2] = p[i][nt][3] = 0.f;
#pragma unroll
    for (int s = 0; s < 4; s++) {
        u32 bh[NT][2], bl[NT][2];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const float* px = xr[nt] + c * 64 + s * 16;
            const float2 v0 = __ldg(reinterpret_cast<const float2*>(px));
            const float2 v1 = __ldg(reinterpret_cast<const float2*>(px + 8));
            if (FMT == FMT_BF16) {
                split_bf16(v0, bh[nt][0], bl[nt][0]);
                split_bf16(v1, bh[nt][1], bl[nt][1]);
            } else {
                bh[nt][0] = pack_bf16x2(v0.x, v0.y);
                bh[nt][1] = pack_bf16x2(v1.x, v1.y);
            }
        }
#pragma unroll
        for (int i = 0; i < GEMV_R; i++) {
            u32 a0, a1, a2, a3;
            frag_a<FMT>(st.wv[i], s, a0, a1, a2, a3);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                if (FMT == FMT_BF16) {
                    // bf16 weights carry no scale: accumulate straight into acc, activations as hi + lo
                    float* q = acc[i][nt];
                    mma_bf16_16816(q[0], q[1], q[2], q[3], a0, a1, a2, a3, bh[nt][0], bh[nt][1]);
                    mma_bf16_16816(q[0], q[1], q[2], q[3], a0, a1, a2, a3, bl[nt][0], bl[nt][1]);
                } else {
                    float* q = p[i][nt];
                    mma_bf16_16816(q[0], q[1], q[2], q[3], a0, a1, a2, a3, bh[nt][0], bh[nt][1]);
                }
            }
        }
    }
    if (FMT != FMT_BF16) {
#pragma unroll
        for (int i = 0; i < GEMV_R; i++) {
            const float s_lo = half_to_float((u16)(st.sv[i] & 0xffffu));  // row g
            const float s_hi = half_to_float((u16)(st.sv[i] >> 16));      // row g + 8
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                acc[i][nt][0] = fmaf(s_lo, p[i][nt][0], acc[i][nt][0]);
                acc[i][nt][1] = fmaf(s_lo, p[i][nt][1], acc[i][nt][1]);
                acc[i][nt][2] = fmaf(s_hi, p[i][nt][2], acc[i][nt][2]);
                acc[i][nt][3] = fmaf(s_hi, p[i][nt][3], acc[i][nt][3]);
            }
        }
    }
}

// Pointers to one launch's activations, by lane tile: fp32 rows (bf16 path) or int8 codes +
// chunk scales (a8 path).
template <int NT>
struct Act {
    const float* xr[NT];  // fp32 row of this thread's B column (+ 2t)
    const uint4* xq[NT];  // a8: this thread's 16 bytes of chunk 0 in its B column's code row
    const float* xs;      // a8: chunk scales [chunk][GEMV_MAX_LANES], + 2t
    u32 sgn;              // a8: 0x80808080 (see q4_lo8)
};

// a8: one chunk = two k32 steps. Weights per tile: q4 one uint4 (words s = 0..3), q8 two
// (steps 2j, 2j+1 as words A, B each). Scales: the weight's fp16 pair (rows g, g + 8) times the
// activation chunk scales of columns 2t, 2t + 1, applied to the chunk's exact int32 sums.
// The chunk's activation B fragments and scales (loaded one chunk ahead by gemv_loop: the L1/L2
// latency of these loads was the top stall of the a8 loop under ncu, device run 1)
template <int NT>
__device__ __forceinline__ void a8_load_act(const Act<NT>& xa, int c, uint4 (&xb)[NT], float2 (&xs)[NT]) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        xb[nt] = __ldg(xa.xq[nt] + c * 4);  // 64 bytes per chunk = 4 uint4
        xs[nt] = __ldg(reinterpret_cast<const float2*>(xa.xs + c * GEMV_MAX_LANES + nt * 8));
    }
}

template <int FMT, int NT>
__device__ __forceinline__ void compute_stage8(float (&acc)[GEMV_R][NT][4], const Stage<FMT>& st,
                                               const uint4 (&xb)[NT], const float2 (&xs0)[NT], u32 sgn) {
    // q4 codes carry a factor 16 (nibble in the high half of the byte): folded into the chunk's
    // activation scales once, not into every tile's weight scales
    const float wmul = FMT == FMT_Q4 ? 0.0625f : 1.0f;
    float2 xs[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) xs[nt] = make_float2(xs0[nt].x * wmul, xs0[nt].y * wmul);
#pragma unroll
    for (int i = 0; i < GEMV_R; i++) {
        int ia[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) ia[nt][0] = ia[nt][1] = ia[nt][2] = ia[nt][3] = 0;
#pragma unroll
        for (int b = 0; b < 2; b++) {
            u32 a0, a1, a2, a3;
            if (FMT == FMT_Q4) {
                const uint4 v = st.wv[i][0];
                const u32 w0 = b ? v.z : v.x, w1 = b ? v.w : v.y;  // steps 2b, 2b + 1
                a0 = q4_lo8(w0, sgn); a1 = q4_hi8(w0, sgn); a2 = q4_lo8(w1, sgn); a3 = q4_hi8(w1, sgn);
            } else {
                const uint4 v = st.wv[i][b];
                const u32 A0 = v.x ^ sgn, B0 = v.y ^ sgn;  // step 2b: bytes code + 128
                const u32 A1 = v.z ^ sgn, B1 = v.w ^ sgn;  // step 2b + 1
                a0 = prmt_b32(A0, B0, 0x6240u); a1 = prmt_b32(A0, B0, 0x7351u);
                a2 = prmt_b32(A1, B1, 0x6240u); a3 = prmt_b32(A1, B1, 0x7351u);
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const u32 b0 = b ? xb[nt].z : xb[nt].x, b1 = b ? xb[nt].w : xb[nt].y;
                mma_s8_16832(ia[nt][0], ia[nt][1], ia[nt][2], ia[nt][3], a0, a1, a2, a3, b0, b1);
            }
        }
        const float s_lo = half_to_float((u16)(st.sv[i] & 0xffffu));  // row g
        const float s_hi = half_to_float((u16)(st.sv[i] >> 16));      // row g + 8
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            acc[i][nt][0] = fmaf(s_lo * xs[nt].x, (float)ia[nt][0], acc[i][nt][0]);
            acc[i][nt][1] = fmaf(s_lo * xs[nt].y, (float)ia[nt][1], acc[i][nt][1]);
            acc[i][nt][2] = fmaf(s_hi * xs[nt].x, (float)ia[nt][2], acc[i][nt][2]);
            acc[i][nt][3] = fmaf(s_hi * xs[nt].y, (float)ia[nt][3], acc[i][nt][3]);
        }
    }
}

// The ring's stage layout. a8 on q4 weights (ACT): the chunk's activation B fragments (16 bytes
// per thread and lane tile) and chunk scales (a float2 per thread and lane tile) ride in the same
// stage as the weights, so they arrive RING stages ahead like the weights instead of one chunk
// ahead from L2 (the L1TEX-scoreboard stall on those loads was a third of the loop's cycles under
// ncu at 1 and 16 lanes, device run 2026-12-01 night). Same data, same math: the bits do not move.
// 16 lanes keep two CTAs per SM with RING_Q4_NT2 stages; q8 (two weight words per tile) keeps its
// activations in registers.
// Only where two such CTAs fit one SM's shared memory (sm_90 / sm_100: 228 KB): the ~100 KB
// cards (sm_86 / 89 / 120) keep the register look-ahead. kernels.py a8_act_in_ring mirrors kA8ActRing.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900 || __CUDA_ARCH__ == 1000)
constexpr bool kA8ActRing = true;
#else
constexpr bool kA8ActRing = false;
#endif
template <int FMT, int NT, bool A8, int TH = GEMV_WARPS * 32>  // TH: the threads whose slots a stage holds
struct RingCfg {
    enum {
        ACT = (A8 && FMT == FMT_Q4 && kA8ActRing && GEMV_ACT_RING) ? 1 : 0,
        S = (ACT && NT == 2) ? RING_Q4_NT2 : Ring<FMT>::STAGES,
        T = TH,
        SCALE_OFF = GEMV_R * FmtInfo<FMT>::WPC * T * 16,  // scale words follow the weight words
        XQ_OFF = SCALE_OFF + GEMV_R * T * 4,
        XS_OFF = XQ_OFF + (ACT ? NT * T * 16 : 0),
        STAGE = XS_OFF + (ACT ? NT * T * 8 : 0)
    };
};

// a8 ACT: this thread's activation fragments and scales of chunk c into a stage's slots, through
// L1 (.ca): every CTA reads the same activation bytes, and below 8 lanes the threads of a warp
// repeat rows (the clamp in gemv_body): L1 serves the repeats (with .cg each went to L2 and the
// 1-lane launches lost 40%, device run 2026-12-01 night)
template <int NT>
__device__ __forceinline__ void a8_issue_act(u32 qslot, u32 xslot, const Act<NT>& xa, int c) {
    constexpr int T = GEMV_WARPS * 32;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        cp_async_ca16(qslot + nt * T * 16, xa.xq[nt] + c * 4);
        cp_async_ca8(xslot + nt * T * 8, xa.xs + c * GEMV_MAX_LANES + nt * 8);
    }
}

// A warp walks its n chunks cstart, cstart+cstep, ... through the ring. Iteration k waits for
// chunk k, copies it to registers, refills the slot read in iteration k-1 (its values are
// consumed, so the overwrite is safe) with chunk k+STAGES-1, then computes chunk k.
// pf_dst / pf_word: the next-launch prefetch word this thread loaded at entry (gemv_body), stored
// to shared memory once the prologue's copies are issued, so its load latency hides behind them.
// WAIT false: the thread has already waited (gemv_body_w4's second pass: one wait a CTA, one STEP_TRACE record)
template <int FMT, int NT, bool A8, int TH = GEMV_WARPS * 32, bool WAIT = true>
__device__ __forceinline__ void gemv_loop(float (&acc)[GEMV_R][NT][4], u8* ring_ptr, const u8* __restrict__ w,
                                          const u32* __restrict__ sc, int kch, int ngroups, int rg, int cstart,
                                          int cstep, int n, const Act<NT>& xa, int lane,
                                          unsigned long long* pf_dst, unsigned long long pf_word) {
    typedef FmtInfo<FMT> F;
    typedef RingCfg<FMT, NT, A8, TH> RC;
    static_assert(TH == GEMV_WARPS * 32 || !A8, "the a8 activation slots are laid out for gemv_body's threads");
    constexpr bool ACT = RC::ACT;
    constexpr int S = RC::S;
    constexpr int STAGE_BYTES = RC::STAGE;
    constexpr unsigned GSC = FMT == FMT_Q8 ? GSC_Q8 : GSC_Q4;  // chunks per scale group: q8 groups are 128 k
    const int tid = threadIdx.x;
    const u32 wring = smem_addr(ring_ptr) + tid * 16, sring = smem_addr(ring_ptr) + RC::SCALE_OFF + tid * 4;
    // ACT: this thread's activation slots (only the ACT path uses them)
    const u32 qring = wring + RC::XQ_OFF, xring = smem_addr(ring_ptr) + RC::XS_OFF + tid * 8;
    const u8* wring_rd = ring_ptr + tid * 16;
    const u8* sring_rd = ring_ptr + RC::SCALE_OFF + tid * 4;
    const int tstride = kch * F::CB, sstride = ngroups * 8;
    const u8* wb = w + (i64)rg * GEMV_R * tstride + lane * 16;
    const u32* sb = sc + (i64)rg * GEMV_R * sstride + (lane >> 2);
    GSTAMP(1);  // descriptor read, prologue issue next
#pragma unroll
    for (int k = 0; k < S - 1; k++) {
        const int c = cstart + k * cstep;
        if (k < n)
            issue_stage<FMT, TH>(wring + k * STAGE_BYTES, sring + k * STAGE_BYTES, wb + (i64)c * F::CB,
                             sb + (((unsigned)c / GSC) << 3), tstride, sstride);
        if constexpr (!ACT) cp_async_commit();
    }
    if (pf_dst) *pf_dst = pf_word;
    // The weights are constants: their first S-1 stages are in flight before the wait on the
    // kernel that wrote this launch's activations (PDL; a no-op without it). Trigger after the
    // wait, so the kernels launched early never reach past this GEMV.
    if constexpr (WAIT) {
        pdl_wait();
        pdl_trigger();
    }
    GSTAMP(2);
    if constexpr (ACT) {
        // group 0 = the prologue's weights + chunk 0's activations, group k = chunk k's activations
#pragma unroll
        for (int k = 0; k < S - 1; k++) {
            if (k < n) a8_issue_act<NT>(qring + k * STAGE_BYTES, xring + k * STAGE_BYTES, xa, cstart + k * cstep);
            cp_async_commit();
        }
    }
    int rd = 0, wr = S - 1;  // ring slots to read and to refill
    uint4 xb[A8 ? NT : 1];
    float2 xsv[A8 ? NT : 1];
    // q8 at 16 lanes holds two weight words per tile: the look-ahead registers would spill there
    constexpr bool AHEAD = A8 && !ACT && !(FMT == FMT_Q8 && NT == 2);
    if constexpr (AHEAD)
        if (n > 0) a8_load_act<NT>(xa, cstart, xb, xsv);
    for (int k = 0; k < n; k++) {
        cp_async_wait<S - 2>();
        if (k == 0) GSTAMP(3);  // first stage landed
        Stage<FMT> st;
        read_stage<FMT, TH>(st, wring_rd + rd * STAGE_BYTES, sring_rd + rd * STAGE_BYTES);
        if constexpr (ACT) {
            constexpr int T = TH;
            const u8* slot = ring_ptr + rd * STAGE_BYTES;
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                xb[nt] = *reinterpret_cast<const uint4*>(slot + RC::XQ_OFF + (nt * T + tid) * 16);
                xsv[nt] = *reinterpret_cast<const float2*>(slot + RC::XS_OFF + (nt * T + tid) * 8);
            }
        }
        const int c = cstart + k * cstep, cn = c + (S - 1) * cstep;
        if (k + S - 1 < n) {
            issue_stage<FMT, TH>(wring + wr * STAGE_BYTES, sring + wr * STAGE_BYTES, wb + (i64)cn * F::CB,
                             sb + (((unsigned)cn / GSC) << 3), tstride, sstride);
            if constexpr (ACT) a8_issue_act<NT>(qring + wr * STAGE_BYTES, xring + wr * STAGE_BYTES, xa, cn);
        }
        cp_async_commit();
        rd = rd + 1 == S ? 0 : rd + 1;
        wr = wr + 1 == S ? 0 : wr + 1;
        if constexpr (ACT) {
            compute_stage8<FMT, NT>(acc, st, xb, xsv, xa.sgn);
        } else if constexpr (AHEAD) {
            uint4 xbn[NT];
            float2 xsn[NT];
            if (k + 1 < n) a8_load_act<NT>(xa, c + cstep, xbn, xsn);
            compute_stage8<FMT, NT>(acc, st, xb, xsv, xa.sgn);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                xb[nt] = xbn[nt];
                xsv[nt] = xsn[nt];
            }
        } else if constexpr (A8) {
            a8_load_act<NT>(xa, c, xb, xsv);
            compute_stage8<FMT, NT>(acc, st, xb, xsv, xa.sgn);
        } else
            compute_stage<FMT, NT>(acc, st, c, xa.xr);
    }
    cp_async_wait<0>();
    GSTAMP(4);  // warp 0 done streaming
}

// ---- next-launch L2 prefetch (q27py/gpu/kernels.py link_prefetch). A launch's CTA streams the
// weights nothing else needs, then the DRAM sits idle through its reduction, the ticket, the
// launch's wave tail, the norm / GDN / attention kernels between two GEMVs and the next GEMV's
// descriptor reads and ring fill (tools/gemv_trace.py: ~3-5 us per launch at 1 lane). The host
// gives each CTA of the last wave up to GEMV_PF_PER L2 ranges: the first chunks of the tiles the
// next launch's first-wave CTAs read first. Its last warp issues them once its own stream has
// landed, so that launch starts on L2 hits. A hint only: the data and the math do not change.
// Word: bits 0..47 the global address (16-byte aligned), 48..63 the length in 16-byte units.
__device__ __forceinline__ void gemv_prefetch(const unsigned long long* s_pf, int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // one bulk prefetch per range (the copy engine walks it; the lane does not wait)
    if (lane < GEMV_PF_PER) {
        const unsigned long long wd = s_pf[lane];
        if (wd) {
            const unsigned long long a = wd & 0xFFFFFFFFFFFFull;
            const u32 nb = (u32)(wd >> 48) * 16u;
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(nb) : "memory");
        }
    }
#else
    // sm_80 / 86 / 89: one prefetch per 128-byte line, the warp's lanes striding each range
    __syncwarp();
    for (int j = 0; j < GEMV_PF_PER; j++) {
        const unsigned long long wd = s_pf[j];
        if (!wd) continue;
        const unsigned long long a = wd & 0xFFFFFFFFFFFFull;
        const u32 nb = (u32)(wd >> 48) * 16u;
        for (u32 off = (u32)lane * 128u; off < nb; off += 32u * 128u)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(a + off));
    }
#endif
}

// A CTA owns one unit = (row group of 64 rows, K split); its 8 warps interleave over the
// unit's chunks (short per-warp streams, so even small matrices finish fast), then reduce
// through shared memory in fixed warp order. A unit with splits > 1 writes its partial tile;
// the CTA that arrives last for the row group (integer ticket) sums the partials in split
// order and runs the epilogue.
// The end of a unit in gemv_body's order: each warp's fp32 partial into its slot of the reduction tile (the ring's
// memory, after a barrier; common.cuh gemv_store_partial), then -- after another -- the 8 partials of every valid
// element added in warp order into red[0]. Each element e is summed and rewritten by one thread only, so red[0] can
// hold the result. Only the launch's lanes are reduced, carried and written (1-lane decode: 64 of E elements):
// element i of the valid set is row i / nv, lane i % nv. Returns nv.
template <int NT>
__device__ __forceinline__ int gemv_reduce_warps(float (*red)[GEMV_R * 16 * NT * 8], int nlanes) {
    constexpr int COLS = NT * 8;
    const int nv = min(nlanes, COLS), EV = GEMV_R * 16 * nv;
    for (int i = threadIdx.x; i < EV; i += blockDim.x) {
        const int e = valid_elem(i, nv, COLS);
        float v = red[0][e];
#pragma unroll
        for (int wi = 1; wi < GEMV_WARPS; wi++) v += red[wi][e];
        red[0][e] = v;
    }
    return nv;
}

template <int FMT, int NT, bool A8>
__device__ __forceinline__ void gemv_body(const i64* __restrict__ desc, int nmat, int units, const float* __restrict__ x,
                                          int ldx, const u8* __restrict__ xq, int ldq, const float* __restrict__ xs,
                                          u32 sgn, int nlanes, int lane0,
                                          const unsigned long long* __restrict__ pf) {
    extern __shared__ __align__(16) u8 dyn_smem[];
    constexpr int COLS = NT * 8, E = GEMV_R * 16 * COLS;
    __shared__ unsigned long long s_pf[GEMV_PF_PER];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    Act<NT> xa;
    if constexpr (A8) {
        // the codes' rows are this launch's lanes (lane 0 = lane0); rows past nlanes repeat the last
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
            xa.xq[nt] = reinterpret_cast<const uint4*>(xq + (i64)min(nt * 8 + g, nlanes - 1) * ldq + t * 16);
        xa.xs = xs + 2 * t;
        xa.sgn = sgn;
    } else {
        x += (i64)lane0 * ldx;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) xa.xr[nt] = x + (i64)min(nt * 8 + g, nlanes - 1) * ldx + 2 * t;
    }

    GSTAMP(0);
    const int u = blockIdx.x;
    // the prefetch words are constants (written before the graph): loaded before the PDL wait
    const bool pf_lane = pf != nullptr && warp == GEMV_WARPS - 1 && lane < GEMV_PF_PER;
    const unsigned long long pf_word = pf_lane ? __ldg(pf + (i64)u * GEMV_PF_PER + lane) : 0ull;
    const GemvUnit un = gemv_unit(desc, nmat, lane0, u);
    const i64* d = un.d;
    const u8* w = un.w;
    const u32* sc = un.sc;
    const int ldy = un.ldy, nout = un.nout, kch = un.kch, mode = un.mode, splits = un.splits;
    const int ngroups = un.ngroups;  // scale group: 64 k (q4) or 128 k (q8), D_GSC
    float* y = un.y;
    const int rg = un.rg, sp = un.sp, c0 = un.c0, c1 = un.c1;
    const int cs = c0 + warp;
    const int n = cs < c1 ? (c1 - cs + GEMV_WARPS - 1) / GEMV_WARPS : 0;

    float acc[GEMV_R][NT][4];
#pragma unroll
    for (int i = 0; i < GEMV_R; i++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) acc[i][nt][0] = acc[i][nt][1] = acc[i][nt][2] = acc[i][nt][3] = 0.f;
    gemv_loop<FMT, NT, A8>(acc, dyn_smem, w, sc, kch, ngroups, rg, cs, GEMV_WARPS, n, xa, lane,
                           pf_lane ? &s_pf[lane] : nullptr, pf_word);
    if (pf != nullptr && warp == GEMV_WARPS - 1) gemv_prefetch(s_pf, lane);
    __syncthreads();  // every warp is done with its ring before it becomes the reduction buffer
    GSTAMP(5);

    float(*red)[E] = reinterpret_cast<float(*)[E]>(dyn_smem);
    gemv_store_partial<NT>(red, warp, acc, g, t);
    __syncthreads();
    const int nv = gemv_reduce_warps<NT>(red, nlanes);
    gemv_unit_finish<COLS>(d, red[0], rg, sp, splits, nv, y, ldy, nout, mode, lane0);
    GSTAMP(7);
}

// gemv_body's unit (non-a8 formats, no prefetch words) run by 4 warps instead of GEMV_WARPS = 8, for a v1 unit inside a
// 128-thread launch of another kernel (gemv_wg.cu gemv8w_*_g: the GDN layer's bf16 gates in the grid of its q4 qkvz,
// constants GEMV_MERGE). Real warp w runs gemv_body's warps w and w + 4 one after the other -- each its own chunks
// c0 + w', c0 + w' + 8, ... into its own fp32 partial, through the ring slots warp w owns -- and the 8 partials are
// added in warp order as gemv_body adds them: the same operations in the same order, so the same bits. Unit u of the
// v1 descriptors (their own CTA numbering).
template <int FMT, int NT>
__device__ __forceinline__ void gemv_body_w4(const i64* __restrict__ desc, int nmat, int u, const float* __restrict__ x,
                                             int ldx, int nlanes, int lane0) {
    static_assert(GEMV_WARPS == 8 && FMT == FMT_BF16, "two of gemv_body's warps a warp; the fp32-input format");
    constexpr int WR = 4;  // real warps
    extern __shared__ __align__(128) u8 dyn_smem[];  // gemv_wg.cu's declaration (gemv_body needs 16)
    constexpr int COLS = NT * 8, E = GEMV_R * 16 * COLS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    Act<NT> xa;
    x += (i64)lane0 * ldx;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) xa.xr[nt] = x + (i64)min(nt * 8 + g, nlanes - 1) * ldx + 2 * t;

    const GemvUnit un = gemv_unit(desc, nmat, lane0, u);
    const int rg = un.rg, sp = un.sp, c0 = un.c0, c1 = un.c1, splits = un.splits;

    float acc[GEMV_WARPS / WR][GEMV_R][NT][4];
    static_assert(GEMV_WARPS == 2 * WR, "two passes");
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int i = 0; i < GEMV_R; i++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
                acc[h][i][nt][0] = acc[h][i][nt][1] = acc[h][i][nt][2] = acc[h][i][nt][3] = 0.f;
    // gemv_body's warps warp and warp + 4, through a ring of 128 threads' slots; the second pass does not wait again
    const int cs0 = c0 + warp, cs1 = c0 + warp + WR;
    const int n0 = cs0 < c1 ? (c1 - cs0 + GEMV_WARPS - 1) / GEMV_WARPS : 0;
    const int n1 = cs1 < c1 ? (c1 - cs1 + GEMV_WARPS - 1) / GEMV_WARPS : 0;
    gemv_loop<FMT, NT, false, WR * 32>(acc[0], dyn_smem, un.w, un.sc, un.kch, un.ngroups, rg, cs0, GEMV_WARPS, n0, xa,
                                       lane, nullptr, 0ull);
    gemv_loop<FMT, NT, false, WR * 32, false>(acc[1], dyn_smem, un.w, un.sc, un.kch, un.ngroups, rg, cs1, GEMV_WARPS, n1,
                                              xa, lane, nullptr, 0ull);
    __syncthreads();  // every warp is done with its ring before it becomes the reduction buffer

    float(*red)[E] = reinterpret_cast<float(*)[E]>(dyn_smem);
#pragma unroll
    for (int h = 0; h < GEMV_WARPS / WR; h++) gemv_store_partial<NT>(red, warp + WR * h, acc[h], g, t);
    __syncthreads();
    const int nv = gemv_reduce_warps<NT>(red, nlanes);
    gemv_unit_finish<COLS>(un.d, red[0], rg, sp, splits, nv, un.y, un.ldy, un.nout, un.mode, lane0);
}
