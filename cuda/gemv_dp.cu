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

// streamed once: not kept in L1
__device__ __forceinline__ uint4 dp_ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ int dp4a_s8(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// One unit (64 rows, chunks c0 .. c1 - 1) of a 1-lane launch: 4 warps, warp w on tile rg * GEMV_R + w.
// D: the register ring's depth (chunks in flight a thread; a multiple of 8, so a chunk's residue is its ring slot mod 8).
// l2pf: chunks past the ring the warp asks L2 for before the wait (prefetch.global.L2, a 128-byte line a lane), so
// more of the unit's bytes move during the launch boundary than the ring holds (constants GEMV_DP_L2PF).
template <int D>
__device__ __forceinline__ void dp_body(const i64* __restrict__ desc, int nmat, const u8* __restrict__ xq,
                                        const float* __restrict__ xs, u32 sgn, int lane0, int l2pf) {
    static_assert(D % 8 == 0, "ring slots and residues");
    extern __shared__ __align__(16) u8 dyn_smem[];
    __shared__ float red0[GEMV_R * 16];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

    GSTAMP(0);
    const GemvUnit un = gemv_unit(desc, nmat, lane0, (int)blockIdx.x);
    const int rg = un.rg, c0 = un.c0, nch = un.c1 - un.c0;
    const i64 tile = (i64)rg * GEMV_R + warp;
    constexpr int CW = CB_Q4 / 16;  // a tile chunk's 16-byte words
    const uint4* wsrc = reinterpret_cast<const uint4*>(un.w + tile * un.kch * CB_Q4) + (i64)c0 * CW + lane;
    const u32* ssrc = un.sc + tile * un.ngroups * 8 + g;  // chunk c's word: rows (g, g + 8) as two halves

    // The weights and their scales are constants: the ring fills before the wait on the activations' producer (PDL)
    uint4 wr[D];
    u32 sr[D];
#pragma unroll
    for (int i = 0; i < D; i++)
        if (i < nch) {
            wr[i] = dp_ld_stream(wsrc + i * CW);
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
    // the unit's activations (lane 0: 64 bytes a chunk) and chunk scales (x 1/16: the codes' factor 16, as gemv8's
    // x2) into shared memory, once for the CTA's four tiles
    uint4* sx = reinterpret_cast<uint4*>(dyn_smem);
    float* sxs = reinterpret_cast<float*>(dyn_smem + (i64)nch * 64);
    const uint4* xsrc = reinterpret_cast<const uint4*>(xq + (i64)c0 * 64);
    for (int i = tid; i < nch * 4; i += blockDim.x) sx[i] = xsrc[i];
    for (int i = tid; i < nch; i += blockDim.x) sxs[i] = xs[(i64)(c0 + i) * GEMV_MAX_LANES] * 0.0625f;
    __syncthreads();
    GSTAMP(3);

    float plo[8], phi[8];  // the residue partials of rows g and g + 8
#pragma unroll
    for (int r = 0; r < 8; r++) plo[r] = phi[r] = 0.f;
#pragma unroll 1
    for (int k = 0; k < nch; k += D) {
#pragma unroll
        for (int r = 0; r < D; r++) {
            const int kk = k + r;
            if (kk < nch) {
                const uint4 w = wr[r];
                const u32 sv = sr[r];
                if (kk + D < nch) {  // the slot's next chunk
                    wr[r] = dp_ld_stream(wsrc + (i64)(kk + D) * CW);
                    sr[r] = __ldg(ssrc + ((c0 + kk + D) / GSC_Q4) * 8);
                }
                const uint4 x = sx[kk * 4 + t];
                int lo = dp4a_s8(q4_lo8(w.x, sgn), x.x, 0), hi = dp4a_s8(q4_hi8(w.x, sgn), x.x, 0);
                lo = dp4a_s8(q4_lo8(w.y, sgn), x.y, lo), hi = dp4a_s8(q4_hi8(w.y, sgn), x.y, hi);
                lo = dp4a_s8(q4_lo8(w.z, sgn), x.z, lo), hi = dp4a_s8(q4_hi8(w.z, sgn), x.z, hi);
                lo = dp4a_s8(q4_lo8(w.w, sgn), x.w, lo), hi = dp4a_s8(q4_hi8(w.w, sgn), x.w, hi);
                lo += __shfl_xor_sync(FULL_MASK, lo, 1);
                hi += __shfl_xor_sync(FULL_MASK, hi, 1);
                lo += __shfl_xor_sync(FULL_MASK, lo, 2);
                hi += __shfl_xor_sync(FULL_MASK, hi, 2);
                // gemv.cu compute_stage8 / gemv_wg.cu wg_terms, term for term (lane 0's column)
                const float x2 = sxs[kk];
                const float s_lo = half_to_float((u16)(sv & 0xffffu)), s_hi = half_to_float((u16)(sv >> 16));
                plo[r % 8] = fmaf(s_lo * x2, (float)lo, plo[r % 8]);
                phi[r % 8] = fmaf(s_hi * x2, (float)hi, phi[r % 8]);
            }
        }
    }
    GSTAMP(4);
    // gemv.cu's reduction: v = P0, v += P1, ..., v += P7, into the unit's tile (64 rows x 1 lane)
    if (t == 0) {
        float vl = plo[0], vh = phi[0];
#pragma unroll
        for (int r = 1; r < 8; r++) {
            vl += plo[r];
            vh += phi[r];
        }
        red0[warp * 16 + g] = vl;
        red0[warp * 16 + g + 8] = vh;
    }
    __syncthreads();
    GSTAMP(5);
    gemv_unit_finish<1>(un.d, red0, rg, un.sp, un.splits, 1, un.y, un.ldy, un.nout, un.mode, lane0);
    GSTAMP(7);
}

// Arguments as gemv_wg.cu's entries (units: the grid; nlanes must be 1), then l2pf (dp_body). Dynamic shared memory:
// kernels.gemv_dp_bytes (64 + 4 bytes a chunk of the launch's longest unit).
#define GEMV_DP_KERNEL(NAME, D, MINB)                                                                          \
    extern "C" __global__ void __launch_bounds__(128, MINB)                                                    \
        NAME(const i64* __restrict__ desc, int nmat, int units, const u8* __restrict__ xq, int ldq,            \
             const float* __restrict__ xs, u32 sgn, int nlanes, int lane0, int l2pf) {                         \
        dp_body<D>(desc, nmat, xq, xs, sgn, lane0, l2pf);                                                      \
    }
GEMV_DP_KERNEL(gemv8p_q4_d8, 8, GEMV_DP_CTAS_D8)
GEMV_DP_KERNEL(gemv8p_q4_d16, 16, GEMV_DP_CTAS_D16)
