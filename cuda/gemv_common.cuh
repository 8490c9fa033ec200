// Pieces of the a8 weight-streaming GEMV shared by its two kernel families: cuda/gemv.cu (mma.sync,
// every card) and cuda/gemv_wg.cu (wgmma, sm_90a). Both compute the same units (row group x K split)
// in the same order, so they share the a8 unpacking and everything after a unit's reduction: the
// split-K combine and the epilogue; and GSTAMP, the trace stamps of both.
#pragma once
#include "common.cuh"

// GEMV_TRACE (tools/gemv_trace.py): thread 0 of each CTA stamps %globaltimer at 8 phases of its life, into the
// including module's own gemv_trace (gemv.cu's units, gemv_wg.cu's wg_body)
#if GEMV_TRACE
__device__ unsigned long long gemv_trace[2 * 16384 * 8];  // [globaltimer ns | clock64] x CTA x phase
__device__ __forceinline__ void gemv_stamp(int i) {
    if (threadIdx.x == 0 && blockIdx.x < 16384) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        gemv_trace[blockIdx.x * 8 + i] = t;
        gemv_trace[16384 * 8 + blockIdx.x * 8 + i] = clock64();
    }
}
#define GSTAMP(i) gemv_stamp(i)
#else
#define GSTAMP(i)
#endif

// ---- a8 helpers
// int4 nibbles of a word -> int8 x 16 (signed, exact): the low nibbles (even slots: row g) and
// the high nibbles (odd slots: row g + 8). Nibbles hold code + 8; flipping the top bit of the
// byte's high nibble turns (code + 8) << 4 into the two's complement byte code << 4.
// sgn = 0x80808080 arrives as a kernel argument on purpose: held in a register, (w & mask) ^ sgn
// is one LOP3 (a literal would make ptxas split it into two: LOP3 takes one immediate).
__device__ __forceinline__ u32 lop3_and_xor(u32 a, u32 b, u32 c) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(r) : "r"(a), "n"(0xF0F0F0F0u), "r"(c));  // (a & b) ^ c
    return r;
}
__device__ __forceinline__ u32 q4_lo8(u32 w, u32 sgn) { return lop3_and_xor(w << 4, 0xF0F0F0F0u, sgn); }
__device__ __forceinline__ u32 q4_hi8(u32 w, u32 sgn) { return lop3_and_xor(w, 0xF0F0F0F0u, sgn); }

// ---- split-K through a thread-block cluster (sm_90): when a row group's `splits` CTAs are one
// cluster (the host launches clusters of `splits` CTAs; units of a row group are consecutive), the
// partials never leave the SMs: each CTA's reduced tile stays in its shared memory, the split-0 CTA
// reads the others' through DSMEM and sums them in split order -- the same additions in the same
// order as the ticket path (v = p0, v += p1, ...), so the bits do not change. Saves the ticket
// path's partial write, fence, atomic and L2 read-back (~2.5 us of a small launch's ~12, measured
// by tools/gemv_trace.py).
__device__ __forceinline__ int cluster_ctas() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    u32 n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return (int)n;
#else
    return 1;
#endif
}
__device__ __forceinline__ void cluster_sync_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
#endif
}
// value at shared address `a` (this CTA's layout) in cluster CTA `rank`
__device__ __forceinline__ float ld_dsmem_f32(u32 a, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    u32 ra;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(ra) : "memory");
    return v;
#else
    return 0.f;
#endif
}

// Element i of a row group's valid partial tile (rows x the launch's nv lanes) in the full
// [rows][cols] layout.
__device__ __forceinline__ int valid_elem(int i, int nv, int cols) {
    const int rl = i / nv;
    return rl * cols + (i - rl * nv);
}

// The descriptor row of the matrix unit u belongs to (rows list their first CTA, D_CTA0, in order)
__device__ __forceinline__ const i64* gemv_unit_desc(const i64* __restrict__ desc, int nmat, int u) {
    int m = 0;
    for (int i = 1; i < nmat; i++)
        if (u >= (int)desc[i * D_NFIELDS + D_CTA0]) m = i;
    return desc + m * D_NFIELDS;
}

// Unit u's place (gemv_v1.cuh's units: row group rg of its matrix, K split sp of splits, chunks c0 .. c1 - 1) and its
// matrix's descriptor fields; y already offset to lane0's row. u: the CTA's unit in its launch's numbering
struct GemvUnit {
    const i64* d;
    const u8* w;
    const u32* sc;
    float* y;
    int ldy, nout, kch, mode, splits, ngroups, rg, sp, c0, c1;
};
__device__ __forceinline__ GemvUnit gemv_unit(const i64* __restrict__ desc, int nmat, int lane0, int u) {
    GemvUnit un;
    const i64* d = un.d = gemv_unit_desc(desc, nmat, u);
    un.w = reinterpret_cast<const u8*>(d[D_W]);
    un.sc = reinterpret_cast<const u32*>(d[D_S]);
    un.ldy = (int)d[D_LDY], un.nout = (int)d[D_NOUT], un.kch = (int)d[D_KCH];
    un.mode = (int)d[D_MODE], un.splits = (int)d[D_SPLITS], un.ngroups = (int)d[D_NGROUPS];
    un.y = reinterpret_cast<float*>(d[D_Y]) + (i64)lane0 * un.ldy;
    const int local = u - (int)d[D_CTA0];
    un.rg = local / un.splits, un.sp = local - un.rg * un.splits;
    un.c0 = (int)((i64)un.sp * un.kch / un.splits), un.c1 = (int)((i64)(un.sp + 1) * un.kch / un.splits);
    return un;
}

// A unit's reduced tile red0 (GEMV_R x 16 rows x COLS lanes in shared memory; the launch's nv lanes
// valid) to its outputs. A unit with splits > 1 writes its partial tile; the CTA that arrives last for
// the row group (integer ticket) sums the partials in split order and runs the epilogue (a cluster of
// the row group's splits sums them through DSMEM instead, in the same order). The bits never depend
// on timing, nor on the launch width.
// The SwiGLU epilogue's a8 hand-over (d[D_XQ] != 0: kernels.GemvPlan quant_into): a row group writes 32 SwiGLU
// outputs (GEMV_R tiles x 8), so two consecutive row groups make one 64-k chunk of the next plan's input. The second
// of a chunk's row groups to finish (an arrival counter per chunk, reset by that arrival, so a captured graph replays
// cleanly; release / acquire by thread 0) quantizes the chunk from the rows both wrote, as
// quant_act8 does from the finished rows: the same bytes, one launch (and its boundary) fewer before the down
// projection. The codes go to the next plan's own buffers (never the ones this launch reads its activations from).
// Only a launch of lanes 0 .. nv - 1, nv <= GEMV_MAX_LANES (the next plan then runs prequantized); wider or later
// blocks skip it (the next plan quantizes for itself then). y: the piece's outputs (lane 0).
// Not inlined: the epilogue runs once a unit, and inlined it cost gemv8_q4_nt2 a spill at 128 registers (sm_86).
__device__ __noinline__ void swiglu_act8(const i64* __restrict__ d, int rg, int nv, const float* __restrict__ y,
                                            int ldy, int nout) {
    constexpr int RGO = GEMV_R * 8;  // SwiGLU outputs of a row group
    __shared__ int s_mine;
    const int o0 = (int)d[D_O0];
    const int c = (o0 / RGO + rg) >> 1;            // the chunk of the matrix's row group
    const int groups = (o0 + nout + RGO - 1) / RGO;  // the matrix's row groups
    const int expect = min(2, groups - 2 * c);
    // The arrival as release / acquire by thread 0 between two barriers (the CTA's writes are ordered before
    // thread 0's release by the first barrier, the other CTA's writes before this CTA's reads by thread 0's
    // acquire and the second): one acq_rel atomic where a __threadfence in every thread would cost each of them
    // the wait for its own writes.
    __syncthreads();
    if (threadIdx.x == 0) {
        int mine = 1;
        if (expect > 1) {
            int* cnt = reinterpret_cast<int*>(d[D_QCNT]) + c;
            int prev;
            asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(prev) : "l"(cnt) : "memory");
            mine = prev == expect - 1;
            if (mine) *cnt = 0;  // every other arrival is in: ready for the next launch
        }
        s_mine = mine;
    }
    __syncthreads();
    if (!s_mine) return;
    const float* row = y - o0;  // the matrix's output row of lane 0
    u8* xq = reinterpret_cast<u8*>(d[D_XQ]);
    float* xs = reinterpret_cast<float*>(d[D_XS]);
    const int ldq = (int)d[D_LDQ], warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int ln = warp; ln < nv; ln += blockDim.x >> 5)
        act8_quantize_pair(__ldcg(reinterpret_cast<const float2*>(row + (i64)ln * ldy + c * 64 + 2 * lane)), c,
                           xq + (i64)ln * ldq, xs + ln, lane);
    // MLP_WALK (gemv_wg.cu's *_walk entries): the chunk's codes are in, published to the down units that wait on
    // its ready flag in the same grid (every thread's writes before thread 0's release by the barrier, as above)
    int* rdy = reinterpret_cast<int*>(d[D_QRDY]);
    if (rdy != nullptr) {
        __syncthreads();
        if (threadIdx.x == 0) asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(rdy + c), "r"(1) : "memory");
    }
}

template <int COLS>
__device__ __forceinline__ void gemv_unit_finish(const i64* __restrict__ d, float* red0, int rg, int sp, int splits,
                                                 int nv, float* __restrict__ y, int ldy, int nout, int mode,
                                                 int lane0) {
    constexpr int E = GEMV_R * 16 * COLS;
    __shared__ int s_last;
    const int tid = threadIdx.x, EV = GEMV_R * 16 * nv;
    if (splits > 1 && cluster_ctas() == splits) {
        cluster_sync_all();  // every split's red0 is final (release / acquire)
        if (sp == 0) {
            const u32 base = smem_addr(red0);
            for (int i = tid; i < EV; i += blockDim.x) {
                const int e = valid_elem(i, nv, COLS);
                float v = red0[e];
                for (int s2 = 1; s2 < splits; s2++) v += ld_dsmem_f32(base + e * 4, s2);
                red0[e] = v;
            }
        }
        cluster_sync_all();  // the other splits' shared memory stays alive until split 0 has read it
        GSTAMP(6);
        if (sp != 0) return;
    } else if (splits > 1) {
        float* ws = reinterpret_cast<float*>(d[D_WS]);
        int* cnt = reinterpret_cast<int*>(d[D_CNT]);
        float* mine = ws + ((i64)rg * splits + sp) * E;
        for (int i = tid; i < EV; i += blockDim.x) {
            const int e = valid_elem(i, nv, COLS);
            mine[e] = red0[e];
        }
        __threadfence();
        __syncthreads();
        if (tid == 0) s_last = (atomicAdd(cnt + rg, 1) == splits - 1);
        __syncthreads();
        GSTAMP(6);  // ticket taken
        if (!s_last) return;
        __threadfence();
        const float* all = ws + (i64)rg * splits * E;
        for (int i = tid; i < EV; i += blockDim.x) {
            const int e = valid_elem(i, nv, COLS);
            float v = __ldcg(all + e);
            for (int s2 = 1; s2 < splits; s2++) v += __ldcg(all + (i64)s2 * E + e);
            red0[e] = v;
        }
        if (tid == 0) cnt[rg] = 0;  // every other CTA of this row group has already counted in
    }
    __syncthreads();
    for (int i = tid; i < EV; i += blockDim.x) {
        const int rl = i / nv, ln = i - rl * nv, e = rl * COLS + ln;
        if (mode == MODE_SWIGLU) {
            // rows 0..7 of a tile are gate rows, 8..15 the matching up rows
            if ((rl & 15) >= 8) continue;
            const int o = (rg * GEMV_R + (rl >> 4)) * 8 + (rl & 7);
            if (o >= nout) continue;
            const float gt = red0[e], up = red0[e + 8 * COLS];
            y[(i64)ln * ldy + o] = gt * sigmoid_f(gt) * up;
        } else {
            const int row = rg * GEMV_R * 16 + rl;
            if (row >= nout) continue;
            float* dst = y + (i64)ln * ldy + row;
            if (mode == MODE_ADD)
                *dst += red0[e];
            else
                *dst = red0[e];
        }
    }
    if (mode == MODE_SWIGLU && d[D_XQ] != 0 && lane0 == 0 && nv <= GEMV_MAX_LANES) swiglu_act8(d, rg, nv, y, ldy, nout);
}
