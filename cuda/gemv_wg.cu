// The a8 weight-streaming GEMV on warpgroup MMA (wgmma, sm_90a only; kernels.GEMV_WGMMA): the same
// units, the same exact int32 chunk sums and the same fp32 operations in the same order as
// cuda/gemv.cu's gemv8_q4_* kernels, so its outputs are bitwise theirs at every width; what changes
// is how a CTA gets there.
//
// Why: the mma.sync kernels hold every lane tile's accumulators in each of 8 warps (a warp owns all
// 64 rows of its unit and a slice of K), so each 8 lanes add a second mma per k32 step, another 16
// accumulators per thread and the register pressure that caps the ring at 3 stages: 16 lanes stream
// at ~0.75x the 1-lane rate (docs/PERF.md, runs d9-d10). Here one warpgroup owns the unit and each of
// its 4 warps one 16-row tile: per 64-k chunk a wgmma m64nNk32 takes A (the tile's int4 codes as int8,
// unpacked in registers exactly as gemv.cu unpacks them) and B (the chunk's int8 activations, N lanes,
// straight from shared memory), so the lane count only widens the instruction's N: 8, 16 or 32 lanes
// (gemv8w_q4_n8 / _n16 / _n32) per weight sweep.
//
// Order (bitwise gemv.cu): gemv.cu's warp w sums its unit's chunks c0 + w, c0 + w + 8, ... in order
// into its own fp32 partial (residue w), then the partials are added in warp order, v = P0, v += P1, ...
// The warpgroup here keeps residue r's running partial in acc[r] and adds each chunk's terms to its
// residue's partial in chunk order; at the end the partials are added in residue order: the same
// additions in the same order whatever the lane count. At 8 / 16 lanes the stages walk the chunks in
// order (8 partials live); at 32 lanes in two passes, residues 0-3 then 4-7 (4 live: wg_body, PASSES).
//
// Data: each warp's 16-byte weight fragment per chunk is what gemv.cu's thread loads, but wgmma's
// register A fragment wants, per k32 step, the bytes of the activation slots 32 b + 4 t + j (see the
// activation order in gemv.cu): thread t of a quad needs word t of each of the quad's four fragments
// (a 4 x 4 transpose). The ring stores the fragments at XOR-rotated 16-byte positions so those 4-byte
// reads are conflict-free. Activations are copied 16 bytes at a time into wgmma's K-major,
// no-swizzle canonical layout (8 lanes x 16 bytes per core matrix), in gemv.cu's slot order, which is
// therefore the k order both operands agree on.
//
// A software-pipelined walk (one wgmma commit group a chunk, its epilogue beside the next chunk's wgmmas) was
// tried and measured slower on the H200 (2026-12-06, docs/PERF.md).
#include "common.cuh"
#include "gemv_common.cuh"
#include "gemv_v1.cuh"

// the runtime asked for the sm_90a build (runtime.ARCH_SPECIFIC): fail loudly if the compiler targets plain sm_90
#if defined(Q27_ARCH_SPECIFIC) && defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "gemv_wg was asked for sm_90a but is being built without its features"
#endif

typedef unsigned long long u64;

// One stage of the ring: GWG_CPS consecutive chunks (byte offsets): per chunk the 4 tiles' fragments
// (512 B per warp), the 4 tiles' scale words (8 per tile), the N lanes' 64 activation bytes (B layout
// below) and the N chunk scales.
template <int NL, int CPS = GWG_CPS>
struct WgStage {
    enum {
        WC = GEMV_R * 512,  // one chunk's fragments
        XC = NL * 64,       // one chunk's activations
        W_OFF = 0,
        S_OFF = W_OFF + CPS * WC,
        X_OFF = S_OFF + CPS * GEMV_R * 32,
        XS_OFF = X_OFF + CPS * XC,
        BYTES = XS_OFF + CPS * NL * 4
    };
};

// Where lane quad position (g, tp) stores its 16-byte fragment within its warp's 512 bytes: rotated
// so that the reads "word t of fragment (g, tp)" of a warp (fixed tp) hit 32 distinct banks
__device__ __forceinline__ u32 wg_frag_pos(int g, int tp) { return (u32)(g * 4 + (tp ^ ((g >> 1) & 3))) * 16u; }

// Byte of activation 16-byte piece q (k32 step q >> 1, core-matrix column q & 1) of lane n in a stage's
// B region: per k32 step NL x 32 bytes, core matrix (n / 8, q & 1) at 256 (n / 8) + 128 (q & 1), row n % 8.
// So within a k32 step the 8-lane groups sit 256 B apart at every NL (the descriptor's SBO, fixed) and the
// K-adjacent core matrices 128 B (LBO); the second k32 step starts NL * 32 B on (the descriptor's start)
template <int NL>
__device__ __forceinline__ u32 wg_act_off(int n, int q) {
    return (u32)((q >> 1) * NL * 32 + (n >> 3) * 256 + (q & 1) * 128 + (n & 7) * 16);
}

// A fragments of one chunk's 16-row tile for its two k32 steps (wgmma's register A): word t of each of the quad's
// four 16-byte fragments (read transposed from their rotated slots, chunk_base = the chunk's fragments + this
// thread's t * 4), the int4 codes unpacked to int8 exactly as gemv.cu unpacks them.
__device__ __forceinline__ void wg_load_a(const u8* chunk_base, int g, u32 sgn, u32 (&a)[2][4]) {
    u32 wv[4];
#pragma unroll
    for (int tp = 0; tp < 4; tp++) wv[tp] = *reinterpret_cast<const u32*>(chunk_base + wg_frag_pos(g, tp));
#pragma unroll
    for (int b = 0; b < 2; b++) {
        a[b][0] = q4_lo8(wv[2 * b], sgn);
        a[b][1] = q4_hi8(wv[2 * b], sgn);
        a[b][2] = q4_lo8(wv[2 * b + 1], sgn);
        a[b][3] = q4_hi8(wv[2 * b + 1], sgn);
    }
}

// wgmma shared-memory descriptor, no swizzle: start, leading (K-adjacent core matrices) = 128 B,
// stride (8-lane groups) = 256 B
__device__ __forceinline__ u64 wg_desc(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(128 >> 4) << 16) | ((u64)(256 >> 4) << 32);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void wg_fence_proxy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// D (64 x NL int32) {=, +=} A (64 x 32 s8, registers) B (32 x NL s8, shared memory). ACC: 0 writes D, 1 adds.
template <int NL, int ACC>
__device__ __forceinline__ void wg_mma(int (&d)[NL / 2], const u32 (&a)[4], u64 db);
template <>
__device__ __forceinline__ void wg_mma<8, 0>(int (&d)[4], const u32 (&a)[4], u64 db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n8k32.s32.s8.s8 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, 0;"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
template <>
__device__ __forceinline__ void wg_mma<8, 1>(int (&d)[4], const u32 (&a)[4], u64 db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n8k32.s32.s8.s8 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, 1;"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
template <>
__device__ __forceinline__ void wg_mma<16, 0>(int (&d)[8], const u32 (&a)[4], u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n16k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, 0;"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]), "=r"(d[4]), "=r"(d[5]), "=r"(d[6]), "=r"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
template <>
__device__ __forceinline__ void wg_mma<16, 1>(int (&d)[8], const u32 (&a)[4], u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n16k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, 1;"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
template <>
__device__ __forceinline__ void wg_mma<32, 0>(int (&d)[16], const u32 (&a)[4], u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, "
        "%14, %15}, {%16, %17, %18, %19}, %20, 0;"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]), "=r"(d[4]), "=r"(d[5]), "=r"(d[6]), "=r"(d[7]), "=r"(d[8]),
          "=r"(d[9]), "=r"(d[10]), "=r"(d[11]), "=r"(d[12]), "=r"(d[13]), "=r"(d[14]), "=r"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
template <>
__device__ __forceinline__ void wg_mma<32, 1>(int (&d)[16], const u32 (&a)[4], u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, "
        "%14, %15}, {%16, %17, %18, %19}, %20, 1;"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]),
          "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
// the accumulators are outputs of the issuing asm: keep their reads below the wait
template <int N>
__device__ __forceinline__ void wg_reg_fence(int (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+r"(d[i])::"memory");
}

// a compile-time stage parity (NVRTC has no <type_traits>)
template <int V>
struct WgPar {
    static constexpr int value = V;
};

// A chunk's terms into its residue partial p (gemv.cu compute_stage8's arithmetic, term for term; q4 codes carry a
// factor 16): sv = the tile's scale word of rows (g, g + 8), float xi of xsb = the chunk's scale of lane 2t (lane
// tile i 8 floats on), d = the chunk's int32 sums
template <int NL>
__device__ __forceinline__ void wg_terms(u32 sv, const u8* xsb, int xi, const int (&d)[NL / 2], float (&p)[NL / 8][4]) {
    const float s_lo = half_to_float((u16)(sv & 0xffffu)), s_hi = half_to_float((u16)(sv >> 16));
#pragma unroll
    for (int i = 0; i < NL / 8; i++) {
        const float2 x0 = *reinterpret_cast<const float2*>(xsb + (xi + 8 * i) * 4);
        const float2 x2 = make_float2(x0.x * 0.0625f, x0.y * 0.0625f);
        p[i][0] = fmaf(s_lo * x2.x, (float)d[4 * i + 0], p[i][0]);
        p[i][1] = fmaf(s_lo * x2.y, (float)d[4 * i + 1], p[i][1]);
        p[i][2] = fmaf(s_hi * x2.x, (float)d[4 * i + 2], p[i][2]);
        p[i][3] = fmaf(s_hi * x2.y, (float)d[4 * i + 3], p[i][3]);
    }
}

// One chunk's epilogue (gemv.cu compute_stage8's arithmetic, term for term; q4 codes carry a factor 16): chunk j
// of the stage at st (its first chunk first_k; PASSES, PAR: which residue partial, as wg_body picks it), its int32
// sums d into acc. FULL: no chunk of the stage is >= c1 (else such a chunk, computed on stale bytes, is dropped).
template <int NL, int PASSES, int PAR, bool FULL, int CPS>
__device__ __forceinline__ void wg_epilogue(const u8* st, int j, const int (&d)[NL / 2],
                                            float (&acc)[GEMV_WARPS / PASSES][NL / 8][4], int first_k, int c1,
                                            int warp, int g, int t) {
    typedef WgStage<NL, CPS> SG;
    // stage k's chunk j is residue (k CPS + j) mod 8: CPS = 4 alternates residues 0-3 / 4-7 (PAR = k & 1), CPS = 8
    // covers all eight every stage
    constexpr int R0 = PASSES == 1 ? (PAR * CPS) % GEMV_WARPS : 0;
    if (!FULL && first_k + j >= c1) return;
    wg_terms<NL>(*reinterpret_cast<const u32*>(st + SG::S_OFF + (j * GEMV_R + warp) * 32 + g * 4),
                 st + SG::XS_OFF, j * NL + 2 * t, d, acc[R0 + j]);
}

// the residue partials, zeroed
template <int R, int N>
__device__ __forceinline__ void wg_zero(float (&acc)[R][N][4]) {
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int i = 0; i < N; i++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[r][i][q] = 0.f;
}

// gemv.cu's reduction of the one-pass walk: the 8 residue (warp) partials added in order, v = P0, v += P1, ..., into
// the unit's tile red0 (64 rows x NL lanes)
template <int NL>
__device__ __forceinline__ void wg_fold(const float (&acc)[GEMV_WARPS][NL / 8][4], float* red0, int warp, int g,
                                        int t) {
#pragma unroll
    for (int i = 0; i < NL / 8; i++)
#pragma unroll
        for (int q = 0; q < 4; q++) {
            float v = acc[0][i][q];
#pragma unroll
            for (int r = 1; r < GEMV_WARPS; r++) v += acc[r][i][q];
            red0[(warp * 16 + g + 8 * (q >> 1)) * NL + 8 * i + 2 * t + (q & 1)] = v;
        }
}

// The two-pass walks' reduction (gemv.cu's order, v = P0, v += P1, ..., v += P7): after the first pass, its RL
// residue partials summed into v and zeroed for the second pass
template <int RL, int NT>
__device__ __forceinline__ void wg_fold_first(float (&acc)[RL][NT][4], float (&v)[NT][4]) {
#pragma unroll
    for (int i = 0; i < NT; i++)
#pragma unroll
        for (int q = 0; q < 4; q++) {
            v[i][q] = acc[0][i][q];
#pragma unroll
            for (int r = 1; r < RL; r++) v[i][q] += acc[r][i][q];
#pragma unroll
            for (int r = 0; r < RL; r++) acc[r][i][q] = 0.f;
        }
}
// ... and after the second: its partials added to v, written to the unit's tile red0 (64 rows x NL lanes)
template <int NL, int RL, int NT>
__device__ __forceinline__ void wg_fold_second(const float (&acc)[RL][NT][4], float (&v)[NT][4], float* red0, int warp,
                                               int g, int t) {
#pragma unroll
    for (int i = 0; i < NT; i++)
#pragma unroll
        for (int q = 0; q < 4; q++) {
#pragma unroll
            for (int r = 0; r < RL; r++) v[i][q] += acc[r][i][q];
            red0[(warp * 16 + g + 8 * (q >> 1)) * NL + 8 * i + 2 * t + (q & 1)] = v[i][q];
        }
}

// constants NORM_FOLD (kernels.GemvPlan.folds_norm): the RMSNorm in front of this GEMV, done by its own CTAs
// instead of a norm launch before it (norm.cu rmsnorm_rows_a8, 1 CTA a lane, 3.6 us of the 27B decode step's
// critical path 128 times: docs/PERF.md, fourteenth session's timeline). After its PDL wait each CTA reads the
// residual rows h (what the norm launch would read), replays rmsnorm_row's sum of squares in its exact order, and
// quantizes the chunks of its own unit (c0 .. c1 - 1) into shared memory, from where the ring's activation stages
// are filled; the first matrix's row-group-0 CTAs (one a K split) also write the normed fp32 rows y of their chunks
// (the norm launch's other output: the GDN conv reads it for the gates). The same bits as the norm launch +
// prequantized GEMV:
// - the sum: rmsnorm_row runs nb threads (1024 at the 27B hidden, 256 below 2,048); thread i sums its elements
//   i, i + nb, ... (fmaf, in order), warp_sum over each 32 threads, then warp_sum of the nb / 32 warp sums.
//   Here thread t of 128 holds virtual threads t + 128 m (m < nb / 128): virtual warp (t >> 5) + 4 m, lane t & 31,
//   so its real warp's shuffles are that virtual warp's, and the warp sums land in red as block_sum's do.
// - the values: (x / den) * (w + add_one), then act8_quantize_pair per 64-k chunk (pads past H are 0, as the
//   staged copy's are), the bytes and scales quant_act8 / rmsnorm_rows_a8 write.
// - w null (constants QUANT_FOLD: down's SwiGLU rows): no norm, the rows' own values quantized per chunk, the bytes
//   quant_act8 writes; each CTA reads only its unit's chunks (no sum to replay), so it costs the CTA ~its chunks'
//   fp32 reads from L2 in place of a quant_act8 launch on the chain.
// Shared memory after the ring: codes [lanes][fnch chunks][64], scales [fnch][GEMV_MAX_LANES], red[32].
// gq / gs (may be null): the plan's global a8 activations, which its other launches read (attention's in plan: q
// on this kernel, the q8 kv launch after it): the CTAs of the first matrix's row group 0 (one per K split, so every
// chunk) also write their chunks there, the bytes rmsnorm_rows_a8 would.
struct NormFold {
    const float* h;  // residual rows (lane l at h + l ldh)
    const float* w;  // the norm's weights (+ add_one)
    float* y;        // the normed fp32 rows (the writers write them), or null
    u8* gq;          // global codes (row l at gq + l ldgq) and chunk scales ([chunk][GEMV_MAX_LANES]), or null
    float* gs;
    int ldh, ldy, H, nb, fnch, ldgq;
    float add_one, eps;
};

__device__ __forceinline__ void st_shared16(u32 addr, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// a fold buffer's chunk scales of the lanes past the launch's (their columns are computed and dropped): zero, not
// stale shared memory
__device__ __forceinline__ void fold_zero_scales(float* fs, int fnch, int nlanes) {
    for (int i = threadIdx.x; i < fnch * GEMV_MAX_LANES; i += 128)  // gemv_wg's CTAs: one warpgroup
        if ((i & (GEMV_MAX_LANES - 1)) >= nlanes) fs[i] = 0.f;
}

// rmsnorm_row's elements of row xr for the replay of its sum order: thread tid of the 128 stands for the norm block's
// threads tid + 128 m (m < nb / 128), each holding k = that thread + i nb; every load first (clamped addresses, no
// predicated loads: they issue together), zeros where the norm block has no thread or the row no element
__device__ __forceinline__ void norm_replay_load(const NormFold& nf, const float* __restrict__ xr,
                                                 float (&v)[8][NORM_PER_THREAD]) {
    const int tid = threadIdx.x, vb = nf.nb >> 7;
#pragma unroll
    for (int m = 0; m < 8; m++)
#pragma unroll
        for (int i = 0; i < NORM_PER_THREAD; i++) {
            const int k = tid + 128 * m + i * nf.nb;
            const float x = xr[min(k, nf.H - 1)];
            v[m][i] = m < vb && k < nf.H ? x : 0.f;
        }
}

// fq / fs: the unit's codes and chunk scales (chunk c at c - c0; null: none, NORM_TAIL's global-only pass), red: 32
// floats of shared memory; writer: this CTA
// (one of the first matrix's row group 0: one a K split, so every chunk once) also writes its chunks' normed rows to
// nf.y and their codes to nf.gq / nf.gs where those are given
__device__ __forceinline__ void wg_norm_fold(const NormFold& nf, int nlanes, int c0, int c1, u8* fq, float* fs,
                                             float* red, bool writer) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int vb = nf.nb >> 7, nwv = nf.nb >> 5;
    const bool normed = nf.w != nullptr;  // else constants QUANT_FOLD: the rows quantized as they are
    if (fq != nullptr) fold_zero_scales(fs, nf.fnch, nlanes);
#pragma unroll 1
    for (int ln = 0; ln < nlanes; ln++) {
        const float* xr = nf.h + (i64)ln * nf.ldh;
        float den = 1.f;
        if (normed) {
            // every load first (norm_replay_load), then the sums
            float v[8][NORM_PER_THREAD], s[8];
            norm_replay_load(nf, xr, v);
#pragma unroll
            for (int m = 0; m < 8; m++) {
                float ss = 0.f;
#pragma unroll
                for (int i = 0; i < NORM_PER_THREAD; i++) ss = fmaf(v[m][i], v[m][i], ss);
                s[m] = warp_sum(ss);  // m >= vb: 0, unused
            }
            __syncthreads();  // red: the previous lane's readers are done
            if (lane == 0)
#pragma unroll
                for (int m = 0; m < 8; m++)
                    if (m < vb) red[warp + 4 * m] = s[m];
            __syncthreads();
            den = sqrtf(warp_sum(lane < nwv ? red[lane] : 0.f) / (float)nf.H + nf.eps);
        }
        // the unit's chunks, warp w on chunks c0 + w + 4 j, FU of them a round: every round's loads first (clamped
        // addresses), as the stores below may alias them for the compiler and would hold each load behind them
        constexpr int FU = 4;
        float* yr = nf.y != nullptr && writer ? nf.y + (i64)ln * nf.ldy : nullptr;
#pragma unroll 1
        for (int cb = c0 + warp; cb < c1; cb += 4 * FU) {
            float xv[FU][2], wv[FU][2];
#pragma unroll
            for (int u = 0; u < FU; u++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int k = min((cb + 4 * u) * 64 + 2 * lane + e, nf.H - 1);
                    xv[u][e] = xr[k];
                    wv[u][e] = normed ? nf.w[k] : 0.f;
                }
#pragma unroll
            for (int u = 0; u < FU; u++) {
                const int c = cb + 4 * u, k = c * 64 + 2 * lane;
                if (c >= c1) break;  // warp-uniform
                float2 o;
                o.x = k < nf.H ? (normed ? (xv[u][0] / den) * (wv[u][0] + nf.add_one) : xv[u][0]) : 0.f;
                o.y = k + 1 < nf.H ? (normed ? (xv[u][1] / den) * (wv[u][1] + nf.add_one) : xv[u][1]) : 0.f;
                if (fq != nullptr) act8_quantize_pair(o, c - c0, fq + (i64)ln * nf.fnch * 64, fs + ln, lane);
                if (writer && nf.gq != nullptr) act8_quantize_pair(o, c, nf.gq + (i64)ln * nf.ldgq, nf.gs + ln, lane);
                if (yr != nullptr) {  // the normed rows (rmsnorm_row writes k < H)
                    if (k < nf.H) yr[k] = o.x;
                    if (k + 1 < nf.H) yr[k + 1] = o.y;
                }
            }
        }
    }
    __syncthreads();  // every warp's chunks are in fq / fs before the ring's stages copy them
}

// constants GATED_FOLD (kernels.GemvPlan.folds_gated): the GDN output norm in front of gdn_out, done by its own CTAs
// instead of norm.cu gated_rmsnorm_a8 (48 launches of a 27B decode step, 1.6 us of the chain each). Per lane, the
// heads the unit's chunks cover: thread j (< dv) holds column j of each head, as gated_rmsnorm_a8's block of dv
// threads does, so block_sums_post / block_total add in block_sum's order (the same bits), then
// ((v / den) * w_j) * (z * sigmoid(z)) into a shared row, quantized per chunk with act8_quantize_pair. dv: 64 or 128.
// Shared memory after the ring: codes [lanes][fnch][64], scales [fnch][GEMV_MAX_LANES], red[GF_HEADS][32], the
// heads' normed rows [(fnch + 2) * 64].
struct GatedFold {
    const float* o;  // the GDN step's output rows (lane l at o + l ldo), heads of dv
    const float* z;  // the gate rows (raw's z part)
    const float* w;  // the norm's weights (dv)
    int ldo, ldz, dv, fnch;
    float eps;
};

__device__ __forceinline__ void wg_gated_fold(const GatedFold& gf, int nlanes, int c0, int c1, u8* fq, float* fs,
                                              float (*red)[32], float* rows) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, dv = gf.dv;
    const int h0 = (c0 * 64) / dv, h1 = (c1 * 64 + dv - 1) / dv;  // the heads the unit's chunks lie in
    const float wj = tid < dv ? gf.w[tid] : 0.f;
    fold_zero_scales(fs, gf.fnch, nlanes);
#pragma unroll 1
    for (int ln = 0; ln < nlanes; ln++) {
        const float* orow = gf.o + (i64)ln * gf.ldo;
        const float* zrow = gf.z + (i64)ln * gf.ldz;
#pragma unroll 1
        for (int hb = h0; hb < h1; hb += GF_HEADS) {
            float v[GF_HEADS], zz[GF_HEADS], sq[GF_HEADS];
#pragma unroll
            for (int r = 0; r < GF_HEADS; r++) {  // every load first (clamped to the batch's first head)
                const int k = (hb + r < h1 ? hb + r : hb) * dv + (tid < dv ? tid : 0);
                v[r] = orow[k];
                zz[r] = zrow[k];
            }
#pragma unroll
            for (int r = 0; r < GF_HEADS; r++) sq[r] = tid < dv ? v[r] * v[r] : 0.f;
            __syncthreads();  // red: the previous batch's readers are done
            block_sums_post<GF_HEADS>(sq, red);
#pragma unroll
            for (int r = 0; r < GF_HEADS; r++) {
                // block_total(red[r]) sums lanes < blockDim / 32 warps: here the 128 threads' 4, of which the warps
                // past dv / 32 posted 0, so the sum of gated_rmsnorm's dv / 32 warp sums plus zeros: the same bits
                const float ss = warp_sum(lane < (dv >> 5) ? red[r][lane] : 0.f);
                if (hb + r < h1 && tid < dv) {
                    const float den = sqrtf(ss / (float)dv + gf.eps);
                    rows[(hb + r - h0) * dv + tid] = (v[r] / den) * wj * (zz[r] * sigmoid_f(zz[r]));
                }
            }
        }
        __syncthreads();  // the heads' rows are complete
        for (int c = c0 + warp; c < c1; c += 4) {
            const float2 pv = *reinterpret_cast<const float2*>(rows + c * 64 - h0 * dv + 2 * lane);
            act8_quantize_pair(pv, c - c0, fq + (i64)ln * gf.fnch * 64, fs + ln, lane);
        }
        __syncthreads();  // rows: the next lane overwrites them
    }
}

// constants MLP_WALK: a down unit of a *_walk grid waits for the a8 codes of its chunks c0 .. c1 - 1, which the
// gate_up units of the same grid quantize as their SwiGLU rows land (gemv_common.cuh swiglu_act8, one ready flag a
// chunk). Warp 0 polls the flags (acquire: the codes the flag publishes are visible to the CTA after the barrier),
// with a short sleep between rounds so that hundreds of waiting CTAs do not crowd the L2 the gate_up units stream
// through. Sets no flag back: the grid's last CTA clears them (gemv8w_walk).
__device__ __forceinline__ void wg_wait_ready(const int* __restrict__ rdy, int c0, int c1) {
    if (threadIdx.x < 32) {
        for (;;) {
            bool all = true;
            for (int c = c0 + (int)threadIdx.x; c < c1; c += 32) {
                int v;
                asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(rdy + c) : "memory");
                all = all && v != 0;
            }
            if (__all_sync(0xffffffffu, all)) break;
            __nanosleep(MLP_WALK_SLEEP);
        }
    }
    __syncthreads();
}

// TWO: the 32-lane two-pass walk at 8 / 16 lanes too (gemv8w_q4_n16t: 4 partials live instead of 8, so
// the 16-lane kernel fits GWG_CTAS_N16T = 3 CTAs per SM, 12 warps instead of 8; the same additions in the same
// order, as the 32-lane kernel's are). SUB: a stage's chunks go to the tensor cores SUB at a time, each batch
// committed, waited for and its epilogue run before the next batch's A fragments are unpacked (gemv8w_q4_n32s:
// SUB = 2 keeps half the int32 results and A registers live, so the 32-lane kernel fits 3 CTAs per SM with a
// ring of STAGES = GWG_STAGES_N32S); each chunk's terms still go to its own residue partial in chunk order.
// NF: 1 constants NORM_FOLD's entries (*_nf: the norm replayed in front, wg_norm_fold; nf its arguments), 2
// GATED_FOLD's (*_gf: the GDN output norm, wg_gated_fold; gf)
template <int NL, int TWO = 0, int SUB = GWG_CPS, int STAGES = GWG_STAGES, int CPS = GWG_CPS, int NF = 0>
__device__ __forceinline__ void wg_body(const i64* __restrict__ desc, int nmat, const u8* __restrict__ xq, int ldq,
                                        const float* __restrict__ xs, u32 sgn, int nlanes, int lane0, int ubase = 0,
                                        const NormFold* nf = nullptr, const GatedFold* gf = nullptr,
                                        const int* rdy = nullptr) {
    typedef WgStage<NL, CPS> SG;
    static_assert(NL == 8 || NL == 16 || NL == 32, "wg_mma's shapes");
    static_assert(NL <= GWG_MAX_LANES && (NL <= GEMV_MAX_LANES || NL == 2 * GEMV_MAX_LANES), "xs: one or two halves");
    constexpr int S = STAGES, NT = NL / 8, ND = NL / 2;
    static_assert(CPS % SUB == 0, "whole batches of chunks a stage");
    // CPS = 4: two stages span the 8 residues (every walk); CPS = 8 (the one-pass walk only): one stage does
    static_assert(GEMV_WARPS / CPS == 2 || (CPS == GEMV_WARPS && NL <= GEMV_MAX_LANES && !TWO), "stages and residues");
    extern __shared__ __align__(128) u8 dyn_smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

    GSTAMP(0);
    const GemvUnit un = gemv_unit(desc, nmat, lane0, (int)blockIdx.x - ubase);  // ubase: gemv8w_*_g's v1 units
    const i64* d = un.d;
    const u8* w = un.w;
    const u32* sc = un.sc;
    float* y = un.y;
    const int ldy = un.ldy, nout = un.nout, kch = un.kch, mode = un.mode, splits = un.splits, ngroups = un.ngroups;
    const int rg = un.rg, sp = un.sp, c0 = un.c0, c1 = un.c1;
    // NF: the activations come from the fold's shared buffer (after the ring), chunk c at c - c0
    const int xoff = NF ? c0 : 0;
    if constexpr (NF) {
        u8* fq = dyn_smem + S * SG::BYTES;
        xq = fq;
        ldq = (NF == 1 ? nf->fnch : gf->fnch) * 64;
        xs = reinterpret_cast<const float*>(fq + (i64)nlanes * ldq);
    }
    // How the stages walk the unit's chunks (each stage CPS consecutive ones, residues R .. R + CPS - 1):
    // PASSES = 1 (8 / 16 lanes): in order, c0 + CPS k, so all 8 residue partials stay live throughout.
    // PASSES = 2 (32 lanes): 8 partials of NL / 2 floats are 128 registers, which beside the 64 wgmma
    // results and the 32 A registers spill at 255; so the stages first walk residues 0 .. CPS - 1 (chunks
    // c0 + 8 m + j, m = 0, 1, ...), then residues CPS .. 7 (c0 + 8 m + CPS + j): 4 partials live, each still
    // summed over its chunks in order, the first pass's folded into v when it ends (the same additions in
    // the same order). Every stage still streams CPS consecutive chunks (2 KB runs of each tile).
    constexpr int PASSES = (NL > GEMV_MAX_LANES || TWO) ? 2 : 1, RL = GEMV_WARPS / PASSES;
    const int nch = c1 - c0;
    // stages of the first pass (PASSES = 1: of the unit), the last maybe partial, and of them those whose
    // chunks are all < c1 (PASSES = 1: nfull below); the same of the second pass
    const int nst0 = PASSES == 1 ? (nch + CPS - 1) / CPS : (nch + GEMV_WARPS - 1) / GEMV_WARPS;
    const int nfull0 = PASSES == 1 ? nch / CPS : (nch + CPS) / GEMV_WARPS;
    const int nst1 = PASSES == 1 ? 0 : (nch + GEMV_WARPS - 1 - CPS) / GEMV_WARPS;
    const int nfull1 = PASSES == 1 ? 0 : nch / GEMV_WARPS;
    const int nst = nst0 + nst1;
    // stage k's first chunk, and (PASSES = 2) whether all its chunks are < c1
    auto first = [&](int k) -> int {
        if (PASSES == 1) return c0 + k * CPS;
        return k < nst0 ? c0 + GEMV_WARPS * k : c0 + GEMV_WARPS * (k - nst0) + CPS;
    };
    auto whole2 = [&](int k) -> bool { return k < nst0 ? k < nfull0 : k - nst0 < nfull1; };

    // This thread's copies per stage (chunks c .. c + CPS - 1, those < c1):
    // - its 16-byte fragment of its warp's tile for each chunk (gemv.cu's thread loads the same bytes)
    const int tstride = kch * CB_Q4, sstride = ngroups * 8;
    const u8* wsrc = w + (i64)(rg * GEMV_R + warp) * tstride + lane * 16;
    const u32 wdst = SG::W_OFF + warp * 512 + wg_frag_pos(g, t);
    // - one 16-byte piece of the scales ([chunk][tile][8 words], threads < CPS * 8)
    const int sj = tid >> 3, sw = (tid >> 1) & 3, sh = tid & 1;
    const u32* ssrc = sc + (i64)(rg * GEMV_R + sw) * sstride + sh * 4;
    const u32 sdst = SG::S_OFF + (sj * GEMV_R + sw) * 32 + sh * 16;
    // - activation pieces (chunk j, lane n, 16-byte piece q): CPS * NL * 4 over the 128 threads
    constexpr int XP = CPS * NL * 4 / 128;
    static_assert(XP * 128 == CPS * NL * 4, "whole activation pieces per thread");
    const u8* xsrc[XP];
    u32 xdst[XP];
    int xj[XP];
    if constexpr (NL * 4 == 128) {
        // 32 lanes: the same pieces, written so that ptxas sees one base (thread = lane tid / 4's piece tid % 4
        // of chunk e): the general form's per-piece pointers cost the registers n32 does not have
        const int ln = tid >> 2, q = tid & 3;
        const u8* src = xq + (i64)min(ln, nlanes - 1) * ldq + q * 16;
        const u32 dst = SG::X_OFF + wg_act_off<NL>(ln, q);
#pragma unroll
        for (int e = 0; e < XP; e++) {
            xj[e] = e;
            xsrc[e] = src + e * 64;
            xdst[e] = dst + e * SG::XC;
        }
    } else {
#pragma unroll
        for (int e = 0; e < XP; e++) {
            const int p = tid + e * 128, j = p / (NL * 4), ln = (p >> 2) % NL, q = p & 3;
            xj[e] = j;
            xsrc[e] = xq + (i64)min(ln, nlanes - 1) * ldq + j * 64 + q * 16;  // lanes past the launch's repeat its last
            xdst[e] = SG::X_OFF + j * SG::XC + wg_act_off<NL>(ln, q);
        }
    }
    // - chunk scales (chunk j, 4 lanes per piece): CPS * NL / 4 pieces. xs is gemv8's [chunk][GEMV_MAX_LANES]
    //   scales of 16 lanes; at 32 lanes two such halves, lanes 16 .. 31 ldq / 4 floats (a half's ldq / 64
    //   chunks) after lanes 0 .. 15, as kernels.GemvPlan lays them out (quant_act8 writes 16 lanes a launch)
    const int aj = tid / (NL / 4), ap = tid % (NL / 4);
    const u32 ring = smem_addr(dyn_smem);
    // FULL: every chunk of the stage is < c1 (all but a unit's last stage)
    auto issue_w = [&](int slot, int c, auto full) {
        constexpr bool FULL = decltype(full)::value;
        const u32 base = ring + slot * SG::BYTES;
#pragma unroll
        for (int j = 0; j < CPS; j++)
            if (FULL || c + j < c1) cp_async_cg16(base + wdst + j * SG::WC, wsrc + (i64)(c + j) * CB_Q4);
        if (tid < CPS * 8 && (FULL || c + sj < c1))
            cp_async_ca16(base + sdst, ssrc + (((unsigned)(c + sj) / GSC_Q4) << 3));
    };
    auto issue_x = [&](int slot, int c, auto full) {
        constexpr bool FULL = decltype(full)::value;
        const u32 base = ring + slot * SG::BYTES;
#pragma unroll
        for (int e = 0; e < XP; e++)
            if (FULL || c + xj[e] < c1) {
                if constexpr (NF)  // shared to shared; stage()'s proxy fence and barrier publish it as cp.async's
                    st_shared16(base + xdst[e], *reinterpret_cast<const uint4*>(xsrc[e] + (c - xoff) * 64));
                else
                    cp_async_ca16(base + xdst[e], xsrc[e] + c * 64);
            }
        if (tid < CPS * NL / 4 && (FULL || c + aj < c1))
            if constexpr (NF)
                st_shared16(base + SG::XS_OFF + (aj * NL + ap * 4) * 4,
                            *reinterpret_cast<const uint4*>(xs + (c - xoff + aj) * GEMV_MAX_LANES + ap * 4));
            else if constexpr (NL > GEMV_MAX_LANES)
                cp_async_ca16(base + SG::XS_OFF + (aj * NL + ap * 4) * 4,
                              xs + (ap >> 2) * (ldq >> 2) + (c + aj) * GEMV_MAX_LANES + (ap & 3) * 4);
            else
                cp_async_ca16(base + SG::XS_OFF + (aj * NL + ap * 4) * 4, xs + (c + aj) * GEMV_MAX_LANES + ap * 4);
    };
    const int nfull = (c1 - c0) / CPS;  // PASSES = 1: stages whose chunks are all < c1
    auto issue = [&](int slot, int k, bool weights, bool acts) {
        const int c = first(k);
        if (PASSES == 1 ? k < nfull : whole2(k)) {
            if (weights) issue_w(slot, c, WgPar<1>());
            if (acts) issue_x(slot, c, WgPar<1>());
        } else {
            if (weights) issue_w(slot, c, WgPar<0>());
            if (acts) issue_x(slot, c, WgPar<0>());
        }
    };

    // The weights are constants: their first S - 1 stages go out before the wait on the kernel that wrote
    // the activations (PDL); group 0 = those weights + stage 0's activations, group k = stage k's
    GSTAMP(1);  // the unit decoded, the weights' prologue next
#pragma unroll 1
    for (int k = 0; k < S - 1; k++)
        if (k < nst) issue(k, k, true, false);
    pdl_wait();
    pdl_trigger();
    if (rdy != nullptr) wg_wait_ready(rdy, c0, c1);  // MLP_WALK's down units: their chunks' codes, from this grid
    GSTAMP(2);
    if constexpr (NF) {
        u8* fq = dyn_smem + S * SG::BYTES;
        float* fs = reinterpret_cast<float*>(fq + (i64)nlanes * ldq);
        if constexpr (NF == 1) {
            wg_norm_fold(*nf, nlanes, c0, c1, fq, fs, fs + nf->fnch * GEMV_MAX_LANES, d == desc && rg == 0);
        } else {
            float(*red)[32] = reinterpret_cast<float(*)[32]>(fs + gf->fnch * GEMV_MAX_LANES);
            wg_gated_fold(*gf, nlanes, c0, c1, fq, fs, red, &red[GF_HEADS][0]);
        }
    }
#pragma unroll 1
    for (int k = 0; k < S - 1; k++) {
        if (k < nst) issue(k, k, false, true);
        cp_async_commit();
    }

    // acc[r]: the partial of residue r (gemv.cu's warp r; PASSES = 2: of residue r + CPS in the second pass),
    // summed over its chunks in order
    float acc[RL][NT][4];
    wg_zero(acc);
    const u8* rbase = dyn_smem + SG::W_OFF + warp * 512 + t * 4;
    // the B descriptor of stage slot 0's first chunk; others by adding their offset / 16 to the start field
    // (shared addresses < 256 KB: the 14-bit field never carries)
    const u64 xdesc0 = wg_desc(ring + SG::X_OFF);
    int rd = 0, wr = S - 1;  // the slot read this stage, the slot refilled
    // stage k (chunks first(k) + j: residues CPS PAR + j, PAR = k & 1 as a constant; PASSES = 2: residues
    // j of the pass, PAR = 0); FULL: no chunk >= c1
    auto stage = [&](int k, auto par, auto full) {
        constexpr int PAR = decltype(par)::value;
        constexpr bool FULL = decltype(full)::value;
        cp_async_wait<S - 2>();  // this thread's copies of stage k have landed
        wg_fence_proxy();        // ... and are visible to the async proxy (wgmma reads B through it)
        __syncthreads();         // every thread's have; every thread is done with stage k - 1's slot
        if (k == 0) GSTAMP(3);   // the first stage landed (NORM_FOLD: after the fold)
        if (k + S - 1 < nst) issue(wr, k + S - 1, true, true);
        cp_async_commit();
        const u8* st = dyn_smem + rd * SG::BYTES;
        const u64 xd = xdesc0 + (u64)((rd * SG::BYTES) >> 4);
        if constexpr (SUB < CPS) {
            const u8* ab = rbase + rd * SG::BYTES;
            rd = rd + 1 == S ? 0 : rd + 1;
            wr = wr + 1 == S ? 0 : wr + 1;
#pragma unroll
            for (int b = 0; b < CPS; b += SUB) {
                u32 a[SUB][2][4];
                int dd[SUB][ND];
#pragma unroll
                for (int jj = 0; jj < SUB; jj++) wg_load_a(ab + (b + jj) * SG::WC, g, sgn, a[jj]);
                wg_fence();  // also orders the previous batch's epilogue reads of dd before these wgmmas
#pragma unroll
                for (int jj = 0; jj < SUB; jj++) {
                    wg_mma<NL, 0>(dd[jj], a[jj][0], xd + ((b + jj) * SG::XC >> 4));
                    wg_mma<NL, 1>(dd[jj], a[jj][1], xd + (((b + jj) * SG::XC + NL * 32) >> 4));
                }
                wg_commit();
                wg_wait0();
#pragma unroll
                for (int jj = 0; jj < SUB; jj++) wg_reg_fence(dd[jj]);
#pragma unroll
                for (int jj = 0; jj < SUB; jj++) wg_epilogue<NL, PASSES, PAR, FULL, CPS>(st, b + jj, dd[jj], acc, first(k), c1,
                                                                                     warp, g, t);
            }
            return;
        }
        u32 a[CPS][2][4];
        int dd[CPS][ND];
#pragma unroll
        for (int j = 0; j < CPS; j++) wg_load_a(rbase + rd * SG::BYTES + j * SG::WC, g, sgn, a[j]);
        // chunks past c1 (a partial last stage) compute on stale bytes and are dropped below
        wg_fence();
#pragma unroll
        for (int j = 0; j < CPS; j++) {
            wg_mma<NL, 0>(dd[j], a[j][0], xd + (j * SG::XC >> 4));
            wg_mma<NL, 1>(dd[j], a[j][1], xd + ((j * SG::XC + NL * 32) >> 4));
        }
        wg_commit();
        wg_wait0();
#pragma unroll
        for (int j = 0; j < CPS; j++) wg_reg_fence(dd[j]);
        rd = rd + 1 == S ? 0 : rd + 1;
        wr = wr + 1 == S ? 0 : wr + 1;
#pragma unroll
        for (int j = 0; j < CPS; j++) wg_epilogue<NL, PASSES, PAR, FULL, CPS>(st, j, dd[j], acc, first(k), c1, warp, g, t);
    };
    float* red0 = reinterpret_cast<float*>(dyn_smem);
    if constexpr (PASSES == 1) {
        int k = 0;
#pragma unroll 1
        for (; k + 1 < nfull; k += 2) {
            stage(k, WgPar<0>(), WgPar<1>());
            stage(k + 1, WgPar<1>(), WgPar<1>());
        }
        if (k < nfull) {  // k even
            stage(k, WgPar<0>(), WgPar<1>());
            k++;
        }
        if (k < nst) {  // the partial last stage
            if (k & 1)
                stage(k, WgPar<1>(), WgPar<0>());
            else
                stage(k, WgPar<0>(), WgPar<0>());
        }
        cp_async_wait<0>();
        __syncthreads();  // the ring becomes the unit's tile
        GSTAMP(4);  // streamed

        wg_fold<NL>(acc, red0, warp, g, t);  // gemv.cu's reduction: the residue (warp) partials added in order
    } else {
        // the first pass (residues 0 .. CPS - 1), then gemv.cu's reduction begun: v = P0, v += P1, ...
        int k = 0;
#pragma unroll 1
        for (; k < nfull0; k++) stage(k, WgPar<0>(), WgPar<1>());
        if (k < nst0) stage(k, WgPar<0>(), WgPar<0>());  // its partial last stage
        float v[NT][4];
        wg_fold_first(acc, v);
        // the second pass (residues CPS .. 7), and the reduction ended: ..., v += P7
#pragma unroll 1
        for (k = nst0; k < nst0 + nfull1; k++) stage(k, WgPar<0>(), WgPar<1>());
        if (k < nst) stage(k, WgPar<0>(), WgPar<0>());
        cp_async_wait<0>();
        __syncthreads();  // the ring becomes the unit's tile
        GSTAMP(4);
        wg_fold_second<NL>(acc, v, red0, warp, g, t);
    }
    __syncthreads();
    GSTAMP(5);  // the unit's tile reduced
    gemv_unit_finish<NL>(d, red0, rg, sp, splits, min(nlanes, NL), y, ldy, nout, mode, lane0);
    GSTAMP(7);
}

#endif

// xq / xs / sgn / nlanes / lane0: as gemv.cu's gemv8_* kernels (the a8 activations of the launch's lanes;
// gemv8w_q4_n32: xq rows 0 .. 31, xs two [ldq / 64][GEMV_MAX_LANES] halves, lanes 16 .. 31 in the second)
// TWO / SUB / STAGES: wg_body's (the walk, chunks per tensor-core batch, ring depth)
// CPS: chunks a ring stage holds (GWG_CPS; the wide-stage entries GWG_CPS_W)
#define GWG_KERNEL_C(NAME, NL, CTAS, TWO, SUB, STAGES, CPS)                                                    \
    extern "C" __global__ void __launch_bounds__(128, CTAS)                                                    \
        NAME(const i64* __restrict__ desc, int nmat, int units, const u8* __restrict__ xq, int ldq,            \
             const float* __restrict__ xs, u32 sgn, int nlanes, int lane0) {                                   \
        GWG_CALL(NL, TWO, SUB, STAGES, CPS)                                                                    \
    }
#define GWG_KERNEL(NAME, NL, CTAS, TWO, SUB, STAGES) GWG_KERNEL_C(NAME, NL, CTAS, TWO, SUB, STAGES, GWG_CPS)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GWG_CALL(NL, TWO, SUB, STAGES, CPS) \
    wg_body<NL, TWO, SUB, STAGES, CPS>(desc, nmat, xq, ldq, xs, sgn, nlanes, lane0);
#else
#define GWG_CALL(NL, TWO, SUB, STAGES, CPS) __trap();  // built for sm_90a only (kernels.gemv_wgmma_supported)
#endif
GWG_KERNEL(gemv8w_q4_n8, 8, GWG_CTAS_N8, 0, GWG_CPS, GWG_STAGES)
GWG_KERNEL(gemv8w_q4_n16, 16, GWG_CTAS_N16, 0, GWG_CPS, GWG_STAGES)
GWG_KERNEL(gemv8w_q4_n32, 32, GWG_CTAS_N32, 0, GWG_CPS, GWG_STAGES)
// kernels.gemv_wg_kernel under GWG_N16_TWO / GWG_N32_SUB
GWG_KERNEL(gemv8w_q4_n16t, 16, GWG_CTAS_N16T, 1, GWG_CPS, GWG_STAGES)
GWG_KERNEL(gemv8w_q4_n32s, 32, GWG_CTAS_N32S, 0, GWG_SUB_N32S, GWG_STAGES_N32S)
// kernels.gemv_wg_kernel under GWG_WIDE_STAGE: the one-pass walk with GWG_CPS_W chunks a stage (all 8 residues; half
// the stage barriers and cp.async waits a byte), their tensor-core batches GWG_SUB_W at a time, a ring of
// GWG_STAGES_W stages (the same bytes in flight as GWG_STAGES of GWG_CPS); bitwise the same sums
GWG_KERNEL_C(gemv8w_q4_n8w, 8, GWG_CTAS_N8, 0, GWG_SUB_W, GWG_STAGES_W, GWG_CPS_W)
// kernels.gemv_wg_kernel under GWG_N8_FOUR: 1-8 lanes on the two-pass walk (4 residue partials live), which fits 128
// registers, so GWG_CTAS_N8Q = 4 CTAs an SM (16 warps instead of 12; the same ring): bitwise the same sums
GWG_KERNEL(gemv8w_q4_n8q, 8, GWG_CTAS_N8Q, 1, GWG_CPS, GWG_STAGES)
// kernels.gemv_wg_kernel under GWG_N16_FOUR: 9-16 lanes the same way (each chunk its own tensor-core batch and a 4-stage
// ring, so 128 registers and 4 x 52,224 B fit 4 CTAs an SM); bitwise the same sums
GWG_KERNEL(gemv8w_q4_n16q, 16, GWG_CTAS_N16Q, 1, GWG_SUB_N16Q, GWG_STAGES_N16Q)
GWG_KERNEL_C(gemv8w_q4_n16w, 16, GWG_CTAS_N16, 0, GWG_SUB_W, GWG_STAGES_W, GWG_CPS_W)
// kernels.gemv_wg_kernel under GWG_DEEP: 1-8 lanes of a launch that fits one wave at GWG_CTAS_N8D CTAs an SM, the plain
// entry's walk with a GWG_STAGES_N8D-stage ring, whose 87 KB hold such a launch to 2 CTAs an SM (spread evenly: docs/PERF.md,
// 2026-12-06 seventh session, reads the gain as placement more than depth): bitwise the same
GWG_KERNEL(gemv8w_q4_n8d, 8, GWG_CTAS_N8D, 0, GWG_CPS, GWG_STAGES_N8D)

// constants NORM_FOLD (kernels.GemvPlan.folds_norm): gemv8w_q4_n8 / n8d with the RMSNorm in front (wg_norm_fold):
// h / ldh rows, w (+ add_one), eps, H, nb (rmsnorm's block, whose order is replayed), y / ldy (the normed rows, the
// first matrix's row group 0; may be null), fnch (the fold buffer's chunks a lane: the launch's longest unit), gq / ldgq / gs (the plan's global
// a8 activations for its other launches, or null). xq / xs are not read.
#define GWG_KERNEL_NF(NAME, NL, CTAS, STAGES)                                                                  \
    extern "C" __global__ void __launch_bounds__(128, CTAS)                                                    \
        NAME(const i64* __restrict__ desc, int nmat, int units, const u8* __restrict__ xq, int ldq,            \
             const float* __restrict__ xs, u32 sgn, int nlanes, int lane0, const float* __restrict__ h,        \
             int ldh, const float* __restrict__ w, float add_one, float eps, int H, int nb,                    \
             float* __restrict__ y, int ldy, int fnch, u8* __restrict__ gq, int ldgq, float* __restrict__ gs) {  \
        GWG_CALL_NF(NL, STAGES)                                                                                \
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GWG_CALL_NF(NL, STAGES)                                                                                \
    const NormFold nf{h, w, y, gq, gs, ldh, ldy, H, nb, fnch, ldgq, add_one, eps};                             \
    wg_body<NL, 0, GWG_CPS, STAGES, GWG_CPS, 1>(desc, nmat, xq, ldq, xs, sgn, nlanes, lane0, 0, &nf);
#else
#define GWG_CALL_NF(NL, STAGES) __trap();
#endif
GWG_KERNEL_NF(gemv8w_q4_n8_nf, 8, GWG_CTAS_N8, GWG_STAGES)
GWG_KERNEL_NF(gemv8w_q4_n8d_nf, 8, GWG_CTAS_N8D, GWG_STAGES_N8D)

// constants NORM_TAIL (kernels.GemvPlan.set_norm_tail, FastModel._norm): a residual GEMV (gdn_out / attn_o: MODE_ADD
// into h) whose next launch would be the post-attention RMSNorm of h feeding gate_up: its CTAs count out on the plan's
// own ticket (ctl[0]) after their unit, and the last one, every row group's epilogue being in, computes that norm
// for the launch's lanes -- the normed fp32 rows y and gate_up's a8 codes gq / gs, wg_norm_fold's replay of
// rmsnorm_row's order over every chunk (fnch: the norm's), the bytes rmsnorm_rows_a8 writes -- so the norm launch
// and one grid boundary go, and no CTA repeats the norm (NORM_FOLD's cost). The ring's shared memory is free by then
// (red lives there). Arguments after GWG_KERNEL's: NormFold's, then ctl and the launch's CTA count.
#define GWG_KERNEL_NT(NAME, NL, CTAS, STAGES)                                                                  \
    extern "C" __global__ void __launch_bounds__(128, CTAS)                                                    \
        NAME(const i64* __restrict__ desc, int nmat, int units, const u8* __restrict__ xq, int ldq,            \
             const float* __restrict__ xs, u32 sgn, int nlanes, int lane0, const float* __restrict__ h,        \
             int ldh, const float* __restrict__ w, float add_one, float eps, int H, int nb,                    \
             float* __restrict__ y, int ldy, int fnch, u8* __restrict__ gq, int ldgq, float* __restrict__ gs,  \
             int* __restrict__ ctl) {                                                                          \
        GWG_CALL_NT(NL, STAGES)                                                                                \
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GWG_CALL_NT(NL, STAGES)                                                                                \
    wg_body<NL, 0, GWG_CPS, STAGES, GWG_CPS>(desc, nmat, xq, ldq, xs, sgn, nlanes, lane0);                     \
    const NormFold nf{h, w, y, gq, gs, ldh, ldy, H, nb, fnch, ldgq, add_one, eps};                             \
    wg_norm_tail(nf, nlanes, ctl, units);
#else
#define GWG_CALL_NT(NL, STAGES) __trap();
#endif
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// the last of the launch's n CTAs to get here (acq_rel: every other CTA's epilogue writes to h are visible to it)
// computes the norm; it leaves the ticket zero for the next launch. The norm is on the step's chain, so it is built
// for latency: w lands in shared memory by cp.async while lane 0's loads of h are in flight; each lane's row is loaded
// once (rmsnorm_row's replay, wg_norm_fold's first phase) and kept in shared memory for the chunk phase, which then
// reads only shared memory, four chunks a warp at a time. Shared memory (the ring's, free by now): w [fnch 64], the
// row [fnch 64], red[32]. The same values in the same order as wg_norm_fold's writer: the same bits. Measured (docs/
// PERF.md eighteenth session, H100): the grid ends ~19 us later at 1 lane, this form and wg_norm_fold's alike -- the
// norm (3.6 us busy in the norm kernel's 32 warps) runs latency-bound in this CTA's 4 -- so NORM_TAIL stays off.
__device__ __forceinline__ void wg_norm_tail(const NormFold& nf, int nlanes, int* __restrict__ ctl, int n) {
    extern __shared__ __align__(128) u8 dyn_smem[];
    __shared__ int s_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        int prev;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(prev) : "l"(ctl) : "memory");
        s_last = prev == n - 1;
        if (s_last) *ctl = 0;
    }
    __syncthreads();
    if (!s_last) return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int vb = nf.nb >> 7, nwv = nf.nb >> 5, KP = nf.fnch * 64;
    float* ws = reinterpret_cast<float*>(dyn_smem);
    float* row = ws + KP;
    float* red = row + KP;
    const u32 wbase = smem_addr(ws);
    for (int k = tid; k < nf.H; k += 128)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(wbase + 4 * k), "l"(nf.w + k) : "memory");
    cp_async_commit();
#pragma unroll 1
    for (int ln = 0; ln < nlanes; ln++) {
        const float* xr = nf.h + (i64)ln * nf.ldh;
        float v[8][NORM_PER_THREAD], s[8];
        norm_replay_load(nf, xr, v);
        __syncthreads();  // row / red: the previous lane's readers are done
#pragma unroll
        for (int m = 0; m < 8; m++) {
            float ss = 0.f;
#pragma unroll
            for (int i = 0; i < NORM_PER_THREAD; i++) {
                ss = fmaf(v[m][i], v[m][i], ss);
                const int k = tid + 128 * m + i * nf.nb;
                if (m < vb && k < nf.H) row[k] = v[m][i];
            }
            s[m] = warp_sum(ss);  // m >= vb: 0, unused
        }
        if (lane == 0)
#pragma unroll
            for (int m = 0; m < 8; m++)
                if (m < vb) red[warp + 4 * m] = s[m];
        if (ln == 0) asm volatile("cp.async.wait_all;" ::: "memory");  // this thread's copies of w have landed (the barrier publishes them)
        __syncthreads();
        const float den = sqrtf(warp_sum(lane < nwv ? red[lane] : 0.f) / (float)nf.H + nf.eps);
        float* yr = nf.y != nullptr ? nf.y + (i64)ln * nf.ldy : nullptr;
        constexpr int FU = 4;
#pragma unroll 1
        for (int cb = warp; cb < nf.fnch; cb += 4 * FU) {
#pragma unroll
            for (int u = 0; u < FU; u++) {
                const int c = cb + 4 * u, k = c * 64 + 2 * lane;
                if (c >= nf.fnch) break;  // warp-uniform
                const float2 xv = *reinterpret_cast<const float2*>(row + k);
                const float2 wv = *reinterpret_cast<const float2*>(ws + k);
                float2 o;
                o.x = k < nf.H ? (xv.x / den) * (wv.x + nf.add_one) : 0.f;
                o.y = k + 1 < nf.H ? (xv.y / den) * (wv.y + nf.add_one) : 0.f;
                if (nf.gq != nullptr) act8_quantize_pair(o, c, nf.gq + (i64)ln * nf.ldgq, nf.gs + ln, lane);
                if (yr != nullptr) {  // the normed rows (rmsnorm_row writes k < H)
                    if (k < nf.H) yr[k] = o.x;
                    if (k + 1 < nf.H) yr[k + 1] = o.y;
                }
            }
        }
    }
}
#endif
GWG_KERNEL_NT(gemv8w_q4_n8_nt, 8, GWG_CTAS_N8, GWG_STAGES)
GWG_KERNEL_NT(gemv8w_q4_n8d_nt, 8, GWG_CTAS_N8D, GWG_STAGES_N8D)

// constants GATED_FOLD (kernels.GemvPlan.folds_gated): gemv8w_q4_n8 / n8d with the GDN output norm in front
// (wg_gated_fold): o / ldo rows, z / ldz gate rows, w (dv weights), eps, dv, fnch (the fold buffer's chunks a lane).
// xq / xs are not read.
#define GWG_KERNEL_GF(NAME, NL, CTAS, STAGES)                                                                  \
    extern "C" __global__ void __launch_bounds__(128, CTAS)                                                    \
        NAME(const i64* __restrict__ desc, int nmat, int units, const u8* __restrict__ xq, int ldq,            \
             const float* __restrict__ xs, u32 sgn, int nlanes, int lane0, const float* __restrict__ o,        \
             int ldo, const float* __restrict__ z, int ldz, const float* __restrict__ w, float eps, int dv,    \
             int fnch) {                                                                                       \
        GWG_CALL_GF(NL, STAGES)                                                                                \
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GWG_CALL_GF(NL, STAGES)                                                                                \
    const GatedFold gf{o, z, w, ldo, ldz, dv, fnch, eps};                                                      \
    wg_body<NL, 0, GWG_CPS, STAGES, GWG_CPS, 2>(desc, nmat, xq, ldq, xs, sgn, nlanes, lane0, 0, nullptr, &gf);
#else
#define GWG_CALL_GF(NL, STAGES) __trap();
#endif
GWG_KERNEL_GF(gemv8w_q4_n8_gf, 8, GWG_CTAS_N8, GWG_STAGES)
GWG_KERNEL_GF(gemv8w_q4_n8d_gf, 8, GWG_CTAS_N8D, GWG_STAGES_N8D)

// constants GEMV_MERGE (kernels.GemvPlan): a plan of a bf16 launch and a q4 one -- the GDN layer's decay / beta gates
// and its qkvz -- as one grid: CTAs 0 .. gunits - 1 run the bf16 units (gemv.cu's gemv_bf16_nt* units on 4 warps,
// gemv_v1.cuh gemv_body_w4: the same bits), the rest this entry's q4 units. Why: the gates' own launch of 20 CTAs held
// the chain ~8 us a GDN layer before qkvz (docs/PERF.md, eleventh session's timeline), and a graph branch beside qkvz
// cannot launch early (twelfth session); in one grid the gates' units run in qkvz's first wave, under its PDL wait.
// gdesc / gnmat / gunits / x / ldx: the bf16 launch's descriptors, units and fp32 rows (gemv.cu's GEMV_KERNEL args).
#define GWG_KERNEL_G(NAME, NL, CTAS, TWO, SUB, STAGES)                                                         \
    extern "C" __global__ void __launch_bounds__(128, CTAS)                                                    \
        NAME(const i64* __restrict__ desc, int nmat, int units, const u8* __restrict__ xq, int ldq,            \
             const float* __restrict__ xs, u32 sgn, int nlanes, int lane0, const i64* __restrict__ gdesc,      \
             int gnmat, int gunits, const float* __restrict__ x, int ldx) {                                    \
        GWG_CALL_G(NL, TWO, SUB, STAGES, GWG_CPS)                                                              \
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GWG_CALL_G(NL, TWO, SUB, STAGES, CPS)                                                                  \
    if ((int)blockIdx.x < gunits)                                                                              \
        gemv_body_w4<FMT_BF16, NL / 8>(gdesc, gnmat, blockIdx.x, x, ldx, nlanes, lane0);                       \
    else                                                                                                       \
        wg_body<NL, TWO, SUB, STAGES, CPS>(desc, nmat, xq, ldq, xs, sgn, nlanes, lane0, gunits);
#else
#define GWG_CALL_G(NL, TWO, SUB, STAGES, CPS) __trap();
#endif
GWG_KERNEL_G(gemv8w_q4_n8_g, 8, GWG_CTAS_N8, 0, GWG_CPS, GWG_STAGES)
GWG_KERNEL_G(gemv8w_q4_n8d_g, 8, GWG_CTAS_N8D, 0, GWG_CPS, GWG_STAGES_N8D)
GWG_KERNEL_G(gemv8w_q4_n16_g, 16, GWG_CTAS_N16, 0, GWG_CPS, GWG_STAGES)

// constants MLP_WALK (kernels.GemvPlan.walks_into): a layer's MLP -- gate_up (SwiGLU epilogue) then down -- as ONE grid
// of both plans' units, so no launch boundary sits between them. Why: every boundary costs the step ~4 us past its
// bytes (the predecessor grid's completion and flush before griddepcontrol.wait returns: docs/PERF.md, fifteenth and
// sixteenth sessions), and this one is the only GEMV -> GEMV edge of a layer with no reduction over the whole row
// between them: a down unit needs only its own K range of the SwiGLU output, which gate_up's epilogue quantizes a
// 64-k chunk at a time (swiglu_act8) and now also flags. Each CTA claims the next unit from a ticket (ctl[0]), gate_up's
// first, so a down unit only ever waits on units that CTAs already running hold: no deadlock whatever the CTA order.
// Its first weight stages stream before it waits (wg_body's prologue), inside gate_up's tail. The same units and the
// same sums: bitwise the two launches. ctl: [ticket, CTAs done, ready flags of the nq chunks, (arrival counters)];
// the last CTA out clears the ticket, the count and the flags, so a captured graph replays cleanly.
// desc / nmat / units / xq / ldq / xs: gate_up's (as GWG_KERNEL); desc2 / nmat2 / units2 / xq2 / ldq2 / xs2: down's.
#define GWG_KERNEL_WALK(NAME, NL, CTAS, TWO, STAGES)                                                           \
    extern "C" __global__ void __launch_bounds__(128, CTAS)                                                    \
        NAME(const i64* __restrict__ desc, int nmat, int units, const u8* __restrict__ xq, int ldq,            \
             const float* __restrict__ xs, u32 sgn, int nlanes, int lane0, const i64* __restrict__ desc2,      \
             int nmat2, int units2, const u8* __restrict__ xq2, int ldq2, const float* __restrict__ xs2,       \
             int* __restrict__ ctl, int nq) {                                                                  \
        GWG_CALL_WALK(NL, TWO, STAGES)                                                                         \
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GWG_CALL_WALK(NL, TWO, STAGES)                                                                         \
    __shared__ int s_claim;                                                                                    \
    if (threadIdx.x == 0) s_claim = atomicAdd(ctl, 1);                                                         \
    __syncthreads();                                                                                           \
    const int u = s_claim, up = u < units;                                                                     \
    wg_body<NL, TWO, GWG_CPS, STAGES, GWG_CPS>(up ? desc : desc2, up ? nmat : nmat2, up ? xq : xq2,            \
                                               up ? ldq : ldq2, up ? xs : xs2, sgn, nlanes, lane0,             \
                                               (int)blockIdx.x - (up ? u : u - units), nullptr, nullptr,       \
                                               up ? nullptr : ctl + 2);                                        \
    gemv_walk_exit(ctl, units + units2, nq);
#else
#define GWG_CALL_WALK(NL, TWO, STAGES) __trap();
#endif
// the last of the grid's n CTAs to get here clears ctl (every other CTA is past its last read of the flags)
__device__ __forceinline__ void gemv_walk_exit(int* __restrict__ ctl, int n, int nq) {
    __shared__ int s_last;
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(ctl + 1, 1) == n - 1;
    __syncthreads();
    if (!s_last) return;
    for (int i = threadIdx.x; i < nq; i += blockDim.x) ctl[2 + i] = 0;
    if (threadIdx.x == 0) ctl[0] = ctl[1] = 0;
}
GWG_KERNEL_WALK(gemv8w_q4_n8_walk, 8, GWG_CTAS_N8, 0, GWG_STAGES)
GWG_KERNEL_WALK(gemv8w_q4_n8d_walk, 8, GWG_CTAS_N8D, 0, GWG_STAGES_N8D)
// 9-16 lanes (MLP_WALK_LANES = 16): on the two-pass 16-lane entry's walk (gemv8w_q4_n16t, 3 CTAs an SM)
GWG_KERNEL_WALK(gemv8w_q4_n16t_walk, 16, GWG_CTAS_N16T, 1, GWG_STAGES)
