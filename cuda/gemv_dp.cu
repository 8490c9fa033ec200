// The 1-lane a8 q4 GEMV on the CUDA cores (dp4a), streaming its weights through registers (constants GEMV_DP4A,
// kernels.GemvPlan._on_dp; an experiment, off by default): the decode step's launches.
//
// Why: the tensor-core kernels (gemv.cu's mma.sync, gemv_wg.cu's wgmma) pay for lanes they do not have at 1 lane
// (an m64n8k32 for one column) and, more to the point, walk a shared-memory ring with a block barrier, a cp.async
// wait and a tensor-core wait per stage: a gemv_wg CTA streams ~8-10 GB/s, a latency-bound loop (docs/PERF.md,
// 2026-12-06 and 2026-12-07 sessions), so a launch's rate is its CTAs' count times that. Here every thread streams
// its own 16-byte fragments into a register ring GEMV_DP_DEPTH deep (no shared memory, no barrier, no asynchronous
// proxy in the loop), unpacks them with the same two LOP3s, and sums each row's chunk with 8 dp4a and two quad
// shuffles: ~40 instructions a 16-byte load, and nothing in the loop waits for another warp.
//
// Bits: the same units (row group x K split, gemv_unit), the same exact int32 chunk sums (integer, so their order
// does not matter), then the same fp32 operations in the same order as gemv8_q4_* / gemv8w_q4_*: a chunk's term
// fmaf(s_row * (x_scale * 0.0625), (float)sum, P[residue]) into its residue's partial (residue = the chunk's index
// in the unit mod 8, chunks in order), the partials added in residue order, then gemv_unit_finish (split-K ticket,
// epilogue, the SwiGLU a8 hand-over). So the outputs are bitwise the tensor-core kernels' at lane 0.
//
// Data (gemv.cu's layout): tile (16 rows) T's chunk c is 512 bytes at w + T * kch * 512 + c * 512; thread (g, t) of
// the tile's warp loads bytes t' = lane * 16 .. + 15, whose word s holds rows g (low nibbles) and g + 8 (high
// nibbles) at the activation bytes 16 t + 4 s .. + 3 of the chunk (gemv.cu: "byte t*16 + s*4 + j holds k = 16 s +
// 2 t + {0, 8, 1, 9}[j] -- exactly the k slots whose weights thread (g, t) holds"), so one 16-byte activation load a
// chunk pairs with the fragment word for word. The quad's four threads cover the chunk's 64 k.
#include "common.cuh"
#include "gemv_common.cuh"

__device__ __forceinline__ int dp4a_s8(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The quad's partial sums v[NL] of one row (each thread's 16 k of the chunk) to the full sums of the lanes this thread
// owns, o[DP_OWN(NL)]: NL = 1 lane 0 (every thread); 2 lane t & 1; 4 lane t; 8 lanes t and t + 4. A butterfly that
// keeps half of what is left each step (integers: exact in any order).
#define DP_OWN(NL) ((NL) < 4 ? 1 : (NL) / 4)
template <int NL>
__device__ __forceinline__ void dp_quad_sums(const int (&v)[NL], int (&o)[DP_OWN(NL)], int t) {
    if constexpr (NL == 1) {
        int a = v[0] + __shfl_xor_sync(FULL_MASK, v[0], 1);
        o[0] = a + __shfl_xor_sync(FULL_MASK, a, 2);
    } else if constexpr (NL == 2) {
        const bool b0 = t & 1;  // keeps lane b0
        int a = (b0 ? v[1] : v[0]) + __shfl_xor_sync(FULL_MASK, b0 ? v[0] : v[1], 1);
        o[0] = a + __shfl_xor_sync(FULL_MASK, a, 2);
    } else {
        const bool b0 = t & 1, b1 = t & 2;  // keeps lanes b0, b0 + 2 of each group of 4, then b0 + 2 b1
#pragma unroll
        for (int q = 0; q < NL / 4; q++) {
            const int* u = v + 4 * q;
            const int a0 = (b0 ? u[1] : u[0]) + __shfl_xor_sync(FULL_MASK, b0 ? u[0] : u[1], 1);
            const int a1 = (b0 ? u[3] : u[2]) + __shfl_xor_sync(FULL_MASK, b0 ? u[2] : u[3], 1);
            o[q] = (b1 ? a1 : a0) + __shfl_xor_sync(FULL_MASK, b1 ? a0 : a1, 2);
        }
    }
}
// the j-th lane thread t owns after dp_quad_sums
template <int NL>
__device__ __forceinline__ int dp_own_lane(int t, int j) {
    return NL == 1 ? 0 : NL == 2 ? (t & 1) : t + 4 * j;
}

// One chunk kk of the unit (residue R of the 8 partials): its weight words w and scale word sv, the lanes' activations
// sx / sxs in shared memory: the exact int32 sums, then gemv8's fp32 terms into the owned lanes' partials
// (R: a constant once the caller's loop is unrolled, so the partials stay in registers)
template <int NL>
__device__ __forceinline__ void dp_chunk(uint4 w, u32 sv, u32 sgn, const uint4* sx, const float* sxs, int nch, int kk,
                                         int t, float (&plo)[DP_OWN(NL)][8], float (&phi)[DP_OWN(NL)][8], int R) {
    constexpr int OWN = DP_OWN(NL);
    const u32 l0 = q4_lo8(w.x, sgn), l1 = q4_lo8(w.y, sgn), l2 = q4_lo8(w.z, sgn), l3 = q4_lo8(w.w, sgn);
    const u32 h0 = q4_hi8(w.x, sgn), h1 = q4_hi8(w.y, sgn), h2 = q4_hi8(w.z, sgn), h3 = q4_hi8(w.w, sgn);
    int vlo[NL], vhi[NL];
#pragma unroll
    for (int n = 0; n < NL; n++) {
        const uint4 x = sx[(n * nch + kk) * 4 + t];
        vlo[n] = dp4a_s8(l3, x.w, dp4a_s8(l2, x.z, dp4a_s8(l1, x.y, dp4a_s8(l0, x.x, 0))));
        vhi[n] = dp4a_s8(h3, x.w, dp4a_s8(h2, x.z, dp4a_s8(h1, x.y, dp4a_s8(h0, x.x, 0))));
    }
    int olo[OWN], ohi[OWN];
    dp_quad_sums<NL>(vlo, olo, t);
    dp_quad_sums<NL>(vhi, ohi, t);
    // gemv.cu compute_stage8 / gemv_wg.cu wg_terms, term for term (the owned lanes' columns)
    const float s_lo = half_to_float((u16)(sv & 0xffffu)), s_hi = half_to_float((u16)(sv >> 16));
#pragma unroll
    for (int j = 0; j < OWN; j++) {
        const float x2 = sxs[dp_own_lane<NL>(t, j) * nch + kk];
        plo[j][R] = fmaf(s_lo * x2, (float)olo[j], plo[j][R]);
        phi[j][R] = fmaf(s_hi * x2, (float)ohi[j], phi[j][R]);
    }
}

// The unit's activations (64 bytes a lane and chunk; lanes past the launch's repeat its last) and chunk scales (x 1/16:
// the codes' factor 16, as gemv8's x2) into shared memory at act, once for the CTA's four tiles: lane n's chunk kk at
// sx[(n nch + kk) 4 ..], its scale at sxs[n nch + kk]. After the PDL wait (the previous kernel wrote them).
template <int NL>
__device__ __forceinline__ void dp_stage_acts(u8* act, const u8* __restrict__ xq, int ldq, const float* __restrict__ xs,
                                              int nlanes, int c0, int nch) {
    uint4* sx = reinterpret_cast<uint4*>(act);
    float* sxs = reinterpret_cast<float*>(act + (i64)NL * nch * 64);
    for (int i = threadIdx.x; i < NL * nch * 4; i += blockDim.x) {
        const int n = i / (nch * 4), e = i - n * nch * 4;
        sx[i] = reinterpret_cast<const uint4*>(xq + (i64)min(n, nlanes - 1) * ldq + (i64)c0 * 64)[e];
    }
    for (int i = threadIdx.x; i < NL * nch; i += blockDim.x) {
        const int n = i / nch, kk = i - n * nch;
        sxs[i] = xs[(i64)(c0 + kk) * GEMV_MAX_LANES + min(n, nlanes - 1)] * 0.0625f;
    }
    __syncthreads();
}

// gemv.cu's reduction (v = P0, v += P1, ..., v += P7) of the owned lanes into the unit's tile red0 (64 rows x NL
// lanes), then gemv_unit_finish
template <int NL>
__device__ __forceinline__ void dp_finish(const GemvUnit& un, float (&plo)[DP_OWN(NL)][8], float (&phi)[DP_OWN(NL)][8],
                                          float* red0, int nlanes, int lane0) {
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    if (NL >= 4 || t < NL) {  // NL = 1: thread 0 of the quad; 2: threads 0, 1 (lanes 0, 1); 4, 8: every thread
#pragma unroll
        for (int j = 0; j < DP_OWN(NL); j++) {
            float vl = plo[j][0], vh = phi[j][0];
#pragma unroll
            for (int r = 1; r < 8; r++) {
                vl += plo[j][r];
                vh += phi[j][r];
            }
            const int n = dp_own_lane<NL>(t, j);
            red0[(warp * 16 + g) * NL + n] = vl;
            red0[(warp * 16 + g + 8) * NL + n] = vh;
        }
    }
    __syncthreads();
    GSTAMP(5);
    gemv_unit_finish<NL>(un.d, red0, un.rg, un.sp, un.splits, min(nlanes, NL), un.y, un.ldy, un.nout, un.mode, lane0);
    GSTAMP(7);
}

// A unit's place for this thread (4 warps, warp w on tile rg * GEMV_R + w): the unit, its chunk range, the thread's
// 16-byte fragment of chunk c0 (chunk c0 + k at wsrc + k * DP_CW) and its scale word of chunk c (ssrc + (c / GSC_Q4) * 8:
// rows g and g + 8 as two halves). Out-parameters, not a struct taken apart by a structured binding: NVRTC rejects a
// lambda capturing one (C++17), and the bodies' lambdas capture these.
constexpr int DP_CW = CB_Q4 / 16;  // a tile chunk's 16-byte words
__device__ __forceinline__ void dp_unit(const i64* __restrict__ desc, int nmat, int lane0, GemvUnit& un, int& c0,
                                        int& nch, const uint4*& wsrc, const u32*& ssrc) {
    un = gemv_unit(desc, nmat, lane0, (int)blockIdx.x);
    const int lane = threadIdx.x & 31;
    const i64 tile = (i64)un.rg * GEMV_R + (threadIdx.x >> 5);
    c0 = un.c0, nch = un.c1 - un.c0;
    wsrc = reinterpret_cast<const uint4*>(un.w + tile * un.kch * CB_Q4) + (i64)c0 * DP_CW + lane;
    ssrc = un.sc + tile * un.ngroups * 8 + (lane >> 2);
}

// One unit (64 rows, chunks c0 .. c1 - 1) of a launch of nlanes <= NL lanes (NL = 1, 2, 4, 8): 4 warps, warp w on tile
// rg * GEMV_R + w. D: the register ring's depth (chunks in flight a thread; a multiple of 8, so a chunk's residue is
// its ring slot mod 8). l2pf: chunks past the ring the warp asks L2 for before the wait (prefetch.global.L2, a
// 128-byte line a lane), so more of the unit's bytes move during the launch boundary than the ring holds (constants
// GEMV_DP_L2PF). Per chunk the weights unpack once and each lane adds 8 dp4a against its own 16 activation bytes.
template <int D, int NL>
__device__ __forceinline__ void dp_body(const i64* __restrict__ desc, int nmat, const u8* __restrict__ xq, int ldq,
                                        const float* __restrict__ xs, u32 sgn, int nlanes, int lane0, int l2pf) {
    static_assert(D % 8 == 0, "ring slots and residues");
    constexpr int OWN = DP_OWN(NL);
    extern __shared__ __align__(16) u8 dyn_smem[];
    __shared__ float red0[GEMV_R * 16 * NL];
    const int lane = threadIdx.x & 31, t = lane & 3;

    GSTAMP(0);
    GemvUnit un;
    int c0, nch;
    const uint4* wsrc;
    const u32* ssrc;
    dp_unit(desc, nmat, lane0, un, c0, nch, wsrc, ssrc);

    // The weights and their scales are constants: the ring fills before the wait on the activations' producer (PDL)
    uint4 wr[D];
    u32 sr[D];
#pragma unroll
    for (int i = 0; i < D; i++)
        if (i < nch) {
            wr[i] = ld_stream16(wsrc + i * DP_CW);
            sr[i] = __ldg(ssrc + ((c0 + i) / GSC_Q4) * 8);
        }
    const u8* tbase = reinterpret_cast<const u8*>(wsrc - lane);  // the tile's chunk c0
    for (int i = lane; i < l2pf * (CB_Q4 / 128); i += 32) {
        const int kk = D + i / (CB_Q4 / 128);
        if (kk < nch) asm volatile("prefetch.global.L2 [%0];" ::"l"(tbase + (i64)kk * CB_Q4 + (i % (CB_Q4 / 128)) * 128));
    }
    GSTAMP(1);
    pdl_wait();
    pdl_trigger();
    GSTAMP(2);
    dp_stage_acts<NL>(dyn_smem, xq, ldq, xs, nlanes, c0, nch);
    const uint4* sx = reinterpret_cast<const uint4*>(dyn_smem);
    const float* sxs = reinterpret_cast<const float*>(dyn_smem + (i64)NL * nch * 64);
    GSTAMP(3);

    float plo[OWN][8], phi[OWN][8];  // the residue partials of rows g and g + 8, each owned lane
#pragma unroll
    for (int j = 0; j < OWN; j++)
#pragma unroll
        for (int r = 0; r < 8; r++) plo[j][r] = phi[j][r] = 0.f;
#pragma unroll 1
    for (int k = 0; k < nch; k += D) {
#pragma unroll
        for (int r = 0; r < D; r++) {
            const int kk = k + r;
            if (kk < nch) {
                dp_chunk<NL>(wr[r], sr[r], sgn, sx, sxs, nch, kk, t, plo, phi, r % 8);
                // the slot's next chunk, once this one's words and scale are used: loaded straight into the ring's
                // registers (refilled before the scale's last use, the compiler loaded into a temporary and copied it
                // into the slot at once: tests/gpu/test_compile.py checks the SASS)
                if (kk + D < nch) {
                    wr[r] = ld_stream16(wsrc + (i64)(kk + D) * DP_CW);
                    sr[r] = __ldg(ssrc + ((c0 + kk + D) / GSC_Q4) * 8);
                }
            }
        }
    }
    GSTAMP(4);
    dp_finish<NL>(un, plo, phi, red0, nlanes, lane0);
}

// The same unit with a deeper ring in shared memory (constants GEMV_DP_ASYNC): each thread cp.async-copies its own
// 16-byte fragment and scale word of chunk kk + S - 1 into its own slots and reads chunk kk's after its own
// cp.async.wait_group -- no thread reads another's copies, so still no barrier in the loop, but S - 1 chunks in flight
// a thread without the registers (the register ring's device reading: too few bytes in flight a CTA, docs/PERF.md).
// Slot j of thread tid: weights at ring + (j * 128 + tid) * 16, scale at ring + S * 2048 + (j * 128 + tid) * 4.
template <int S, int NL>
__device__ __forceinline__ void dpa_body(const i64* __restrict__ desc, int nmat, const u8* __restrict__ xq, int ldq,
                                         const float* __restrict__ xs, u32 sgn, int nlanes, int lane0) {
    constexpr int OWN = DP_OWN(NL);
    extern __shared__ __align__(16) u8 dyn_smem[];
    __shared__ float red0[GEMV_R * 16 * NL];
    const int tid = threadIdx.x, t = tid & 3;

    GSTAMP(0);
    GemvUnit un;
    int c0, nch;
    const uint4* wsrc;
    const u32* ssrc;
    dp_unit(desc, nmat, lane0, un, c0, nch, wsrc, ssrc);
    const u32 wring = smem_addr(dyn_smem) + tid * 16, sring = smem_addr(dyn_smem) + S * 2048 + tid * 4;
    auto issue = [&](int kk) {  // chunk kk into its slot (one commit group a chunk, empty past the unit)
        if (kk < nch) {
            const int j = kk % S;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(wring + j * 2048), "l"(wsrc + (i64)kk * DP_CW)
                         : "memory");
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(sring + j * 512),
                         "l"(ssrc + ((c0 + kk) / GSC_Q4) * 8)
                         : "memory");
        }
        cp_async_commit_mem();
    };
#pragma unroll 1
    for (int kk = 0; kk < S - 1; kk++) issue(kk);  // constants: before the wait
    GSTAMP(1);
    pdl_wait();
    pdl_trigger();
    GSTAMP(2);
    u8* act = dyn_smem + S * (2048 + 512);
    dp_stage_acts<NL>(act, xq, ldq, xs, nlanes, c0, nch);
    const uint4* sx = reinterpret_cast<const uint4*>(act);
    const float* sxs = reinterpret_cast<const float*>(act + (i64)NL * nch * 64);
    GSTAMP(3);

    float plo[OWN][8], phi[OWN][8];
#pragma unroll
    for (int j = 0; j < OWN; j++)
#pragma unroll
        for (int r = 0; r < 8; r++) plo[j][r] = phi[j][r] = 0.f;
#pragma unroll 1
    for (int k = 0; k < nch; k += 8) {
#pragma unroll
        for (int r = 0; r < 8; r++) {
            const int kk = k + r;
            if (kk < nch) {
                cp_async_wait_mem<S - 2>();  // this thread's copies of chunk kk have landed (S - 1 + kk groups issued)
                const int j = kk % S;
                uint4 w;
                u32 sv;
                asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                             : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                             : "r"(wring + j * 2048)
                             : "memory");
                asm volatile("ld.shared.u32 %0, [%1];" : "=r"(sv) : "r"(sring + j * 512) : "memory");
                issue(kk + S - 1);  // into chunk kk - 1's slot, which this thread read last iteration
                dp_chunk<NL>(w, sv, sgn, sx, sxs, nch, kk, t, plo, phi, r);
            }
        }
    }
    cp_async_wait_all_mem();
    GSTAMP(4);
    dp_finish<NL>(un, plo, phi, red0, nlanes, lane0);
}

// Arguments as gemv_wg.cu's entries (units: the grid; nlanes <= NL), then l2pf (dp_body). Dynamic shared memory:
// kernels.gemv_dp_bytes (NL x (64 + 4) bytes a chunk of the launch's longest unit).
#define GEMV_DP_KERNEL(NAME, D, NL, MINB)                                                                      \
    extern "C" __global__ void __launch_bounds__(128, MINB)                                                    \
        NAME(const i64* __restrict__ desc, int nmat, int units, const u8* __restrict__ xq, int ldq,            \
             const float* __restrict__ xs, u32 sgn, int nlanes, int lane0, int l2pf) {                         \
        dp_body<D, NL>(desc, nmat, xq, ldq, xs, sgn, nlanes, lane0, l2pf);                                     \
    }
GEMV_DP_KERNEL(gemv8p_q4_d8, 8, 1, GEMV_DP_CTAS_D8)
GEMV_DP_KERNEL(gemv8p_q4_d16, 16, 1, GEMV_DP_CTAS_D16)
// GEMV_DP_ASYNC: the cp.async ring of GEMV_DP_STAGES stages (1 lane)
#define GEMV_DPA_KERNEL(NAME, S, NL, MINB)                                                                     \
    extern "C" __global__ void __launch_bounds__(128, MINB)                                                    \
        NAME(const i64* __restrict__ desc, int nmat, int units, const u8* __restrict__ xq, int ldq,            \
             const float* __restrict__ xs, u32 sgn, int nlanes, int lane0, int l2pf) {                         \
        dpa_body<S, NL>(desc, nmat, xq, ldq, xs, sgn, nlanes, lane0);                                          \
    }
GEMV_DPA_KERNEL(gemv8p_q4_a, GEMV_DP_STAGES, 1, GEMV_DP_CTAS_A)
GEMV_DPA_KERNEL(gemv8p_q4_a_n2, GEMV_DP_STAGES, 2, GEMV_DP_CTAS_A)
GEMV_DPA_KERNEL(gemv8p_q4_a_n4, GEMV_DP_STAGES, 4, GEMV_DP_CTAS_A)
// 2-8 lanes (GEMV_DP_LANES): the 8-deep ring
GEMV_DP_KERNEL(gemv8p_q4_d8_n2, 8, 2, GEMV_DP_CTAS_D8)
GEMV_DP_KERNEL(gemv8p_q4_d8_n4, 8, 4, GEMV_DP_CTAS_D16)
GEMV_DP_KERNEL(gemv8p_q4_d8_n8, 8, 8, GEMV_DP_CTAS_N8)
