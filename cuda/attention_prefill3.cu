// Causal prefill attention v3: attention_prefill2.cu's contract and numerics on Hopper's warpgroup MMA
// (wgmma, sm_90a only; EngineConfig.attn_prefill_wgmma). Everywhere else the entry points trap and
// kernels.attention_prefill2 keeps the v2 kernel.
//
// Why: v2 (mma.sync, 8 warps x 16 rows) runs at ~220 TFLOP/s on the H200 because every warp reads its
// own K and V fragments out of shared memory through ldmatrix (16 rows per read), so shared-memory
// bandwidth, not the tensor pipe, bounds it (~590 KB of smem reads per 128 x 64 tile against ~8
// MFLOP). wgmma reads B straight from shared memory for 64 rows at a time (a warpgroup), A (Q) from
// shared memory too and P from registers: per CTA tile 192 KB of reads for the same work.
//
// Same contract as v2 (kernels.attention_prefill2): a CTA owns ROWS = 128 (lane, q head) rows of one
// kv head, flattened lane-major, streams the visible keys of one key block (PF2_SPLIT_KEYS keys at
// absolute positions) through two cp.async stages of NK = 64 keys, fuses the sigmoid gate into the
// epilogue, and writes split rows' partials for attn_prefill2_combine. Numerics: Q and P as one bf16
// each, fp32 accumulation, fp32 online softmax in log2 units, l summing the bf16-rounded P in v2's
// order: v2's error class (tests/gpu/test_attention_prefill3.py holds it to v2 and to float64).
//
// Layout: two warpgroups (8 warps); warpgroup w owns rows 64 w .. 64 w + 63 (warp 4 w + i: rows
// 16 (4 w + i) .., v2's warp rows). Shared tiles are [HD / 64 column blocks][rows][64 bf16] with the
// 128-byte swizzle (16-byte chunk c of row r at c ^ (r & 7), 1024-byte atoms): K-major for Q (A) and
// K (B of S = Q K^T), MN-major for V (B of O = P V, transposed by the instruction), so K and V tiles
// share one layout and one cp.async loop. Accumulator fragments (S: 64 x 64, O: 64 x 256) follow
// the m16n8 C layout per warp, so P packs into wgmma's register A fragment exactly as v2 packs it
// for mma.sync.
#include "common.cuh"

// the runtime asked for the sm_90a build (runtime.ARCH_SPECIFIC): fail loudly if the compiler targets plain sm_90
#if defined(Q27_ARCH_SPECIFIC) && defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "attention_prefill3 was asked for sm_90a but is being built without its features"
#endif

typedef unsigned long long u64;


__device__ __forceinline__ u32 pf3_smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// byte offset of 16-byte chunk cc (dims 8 cc .. 8 cc + 7) of row r in a [HD / 64][R][128 B] swizzled tile
template <int R>
__device__ __forceinline__ u32 pf3_off(int r, int cc) {
    return (u32)((cc >> 3) * R * 128 + r * 128 + (((cc & 7) ^ (r & 7)) << 4));
}

// wgmma shared-memory matrix descriptor, 128-byte swizzle: start, leading / stride byte offsets
__device__ __forceinline__ u64 pf3_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo & 0x3FFFF) >> 4) << 16) | ((u64)((sbo & 0x3FFFF) >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void pf3_fence_proxy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void pf3_wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void pf3_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void pf3_wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// the accumulators are asm outputs of the issuing instruction: without this, the compiler could move
// their first reads above the wait (nothing ties them to it)
template <int N>
__device__ __forceinline__ void pf3_reg_fence(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
// an A fragment read by a wgmma in flight: kept live (and in place) until after its wait
template <int N>
__device__ __forceinline__ void pf3_reg_fence_u(u32 (&a)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+r"(a[i][e])::"memory");
}

// D (64 x 64 fp32, 32 per thread) = A (64 x 16, smem) B (16 x 64, smem, K-major): the first k16 step of S = Q K^T (D only
// written: no accumulator input, so S's registers are free between tiles as far as ptxas can tell)
__device__ __forceinline__ void pf3_wgmma_s0(float (&d)[32], u64 da, u64 db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, 0, 1, 1, 0, 0;\n}\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]),
          "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]),
          "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]),
          "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31])
        : "l"(da), "l"(db), "r"(0));
}


// D (64 x 64 fp32, 32 per thread) += A (64 x 16, smem) B (16 x 64, smem, K-major): a later k16 step of S = Q K^T
__device__ __forceinline__ void pf3_wgmma_s(float (&d)[32], u64 da, u64 db, int accumulate) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, 1, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(accumulate));
}

// D (64 x 256 fp32, 128 per thread) += A (64 x 16 bf16, registers) B (16 x 256, smem, MN-major): one k16
// step of O += P V
__device__ __forceinline__ void pf3_wgmma_pv(float (&d)[128], const u32 (&a)[4], u64 db, int accumulate) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, {%128, %129, %130, %131}, %132, 1, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}

// grid (nkv, row tiles, key blocks), dynamic smem kernels.attention_prefill3_bytes(). Arguments and outputs:
// attention_prefill2.cu prefill2_body (bf16 KV).
// FORM 0 ("sync"): a CTA barrier per tile keeps the two warpgroups in step (both issue their wgmma at
//   once, then both run the softmax while the tensor cores idle).
// FORM 1 ("ws"): per stage a "full" mbarrier (every thread's cp.async copies of the tile landed: 256
//   arrivals) and an "empty" one (the 8 warps are done reading it), so the warpgroups drift up to a tile
//   apart and one's softmax overlaps the other's wgmma. A thread refills a stage only once every warp
//   has released its previous tile (two stages: the one being read stays untouched).
// FORM 2 ("pipe"): FORM 1's barriers with K and V in rings of their own (2 K stages, 3 V stages), and
//   within a warpgroup the softmax of tile kt runs while the tensor cores do P V of tile kt - 1: per
//   tile, S(kt) and PV(kt - 1) are issued back to back, the wait for S leaves PV in flight, and O is
//   rescaled by tile kt's correction only once PV(kt - 1) landed -- the same operations on every
//   element in v2's order (O * corr_kt + P_kt V_kt after P_{kt-1} V_{kt-1}), so the same bits.
// All: block 32 PF3_WARPS, every thread loads its share of each K / V tile.
template <int FORM>
__device__ __forceinline__ void prefill3_body(const float* __restrict__ q, int ldq, const u16* __restrict__ kc,
                                              const u16* __restrict__ vc, int max_pos, int nq, int nkv, int t,
                                              float scale_log2, const int* __restrict__ pos0_dev, int lane0,
                                              const float* __restrict__ qg, int ldqg, float* __restrict__ out, int ldo,
                                              float* __restrict__ part) {
    constexpr int HD = PF3_HD, ROWS = 16 * PF3_WARPS, NK = PF3_NK, THREADS = 32 * PF3_WARPS;
    static_assert(PF3_WARPS == 8 && PF2_STAGES == 2 && NK % 16 == 0 && PF2_SPLIT_KEYS % NK == 0 && HD % 64 == 0, "two warpgroups, whole tiles");
    constexpr int CR = HD / 8;                   // 16-byte chunks per row
    constexpr int Q_BYTES = ROWS * HD * 2;       // 64 KB
    constexpr int KV_BYTES = NK * HD * 2;        // 32 KB: one K (or V) tile
    constexpr int STAGE_BYTES = 2 * KV_BYTES;
    constexpr int NT = NK / 8;                   // key n8 tiles of S
    constexpr int DT = HD / 8;                   // dim n8 tiles of O
    extern __shared__ __align__(128) unsigned char pf3_raw[];
    // 1024-byte alignment for the swizzle atoms (the host asks for 1 KB more than the tiles)
    const u32 raw = pf3_smem(pf3_raw);
    const u32 base = (raw + 1023u) & ~1023u;
    unsigned char* sm = pf3_raw + (base - raw);
    const u32 q_base = base, st_base = base + Q_BYTES;
    constexpr bool WS = FORM == 1, PIPE = FORM == 2;
    constexpr int KS = 2, VS = 3;  // PIPE: K and V ring stages (5 tiles beside Q: 224 KB)
    const u32 bar_full = st_base + PF2_STAGES * STAGE_BYTES, bar_empty = bar_full + 8 * PF2_STAGES;  // WS
    const u32 k_st = st_base, v_st = st_base + KS * KV_BYTES;  // PIPE rings
    const u32 bar_kf = st_base + (KS + VS) * KV_BYTES, bar_ke = bar_kf + 8 * KS, bar_vf = bar_ke + 8 * KS,
              bar_ve = bar_vf + 8 * VS;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
    const int wg = warp >> 2;
    const int g = blockIdx.x;
    const int tile = gridDim.y - 1 - blockIdx.y;  // the longest key ranges start first
    const int blk = blockIdx.z, nblk = gridDim.z;
    const int rep = nq / nkv;
    const int nrows = rep * t;
    const int r0 = tile * ROWS;
    const int pos0 = *pos0_dev + lane0;
    const int pos_max = pos0 + (min(r0 + ROWS, nrows) - 1) / rep;
    const int kb0 = blk * PF2_SPLIT_KEYS;
    if (kb0 > pos_max) return;  // uniform over the CTA
    const int kend = min(kb0 + PF2_SPLIT_KEYS, pos_max + 1);
    const int ntk = (kend - kb0 + NK - 1) / NK;

    const u16* kg = kc + (i64)g * max_pos * HD;
    const u16* vg = vc + (i64)g * max_pos * HD;

    // tile kt's K / V rows into stage kt & 1, by `nthr` threads (this one is number `me`)
    // tile kt's K / V rows into stage kt & 1. Thread (warp w, lane c) copies chunk c of rows w + 8 i: the
    // swizzle term (c & 7) ^ (row & 7) is the same for all 8 of its rows, so the addresses are fixed
    // per thread and step by constants.
    static_assert(THREADS == 8 * CR && NK % 8 == 0, "a warp per row residue, a lane per chunk");
    const int lc = tid & (CR - 1), lw = tid / CR;
    const u32 ld_dst = (u32)((lc >> 3) * NK * 128 + lw * 128 + (((lc & 7) ^ (lw & 7)) << 4));
    auto load_tile = [&](int kt) {
        const u32 st = st_base + (kt & 1) * STAGE_BYTES + ld_dst;
        const int k0 = kb0 + kt * NK + lw;
        const i64 src = (i64)k0 * HD + lc * 8;
#pragma unroll
        for (int i = 0; i < NK / 8; i++) {
            const int n = k0 + 8 * i <= pos_max ? 16 : 0;  // zero-filled past the CTA's last row (never stale, never NaN)
            const i64 at = n ? src + (i64)i * 8 * HD : 0;   // a valid address either way
            cp_async_cg16_zfill(st + i * 8 * 128, kg + at, n);
            cp_async_cg16_zfill(st + KV_BYTES + i * 8 * 128, vg + at, n);
        }
    };
    // PIPE: one K (or V) tile kt into the ring slot at `st`
    auto load_one = [&](const u16* src_base, u32 st, int kt) {
        const int k0 = kb0 + kt * NK + lw;
        const i64 src = (i64)k0 * HD + lc * 8;
#pragma unroll
        for (int i = 0; i < NK / 8; i++) {
            const int n = k0 + 8 * i <= pos_max ? 16 : 0;
            cp_async_cg16_zfill(st + ld_dst + i * 8 * 128, src_base + (n ? src + (i64)i * 8 * HD : 0), n);
        }
    };
    if constexpr (PIPE) {
        if (tid == 0) {
#pragma unroll
            for (int s = 0; s < KS; s++) {
                mbar_init(bar_kf + 8 * s, THREADS);
                mbar_init(bar_ke + 8 * s, PF3_WARPS);
            }
#pragma unroll
            for (int s = 0; s < VS; s++) {
                mbar_init(bar_vf + 8 * s, THREADS);
                mbar_init(bar_ve + 8 * s, PF3_WARPS);
            }
        }
        __syncthreads();
        load_one(kg, k_st, 0);
        cp_async_mbar_arrive(bar_kf);
        load_one(vg, v_st, 0);
        cp_async_mbar_arrive(bar_vf);
    } else if constexpr (WS) {
        if (tid == 0) {
#pragma unroll
            for (int s = 0; s < PF2_STAGES; s++) {
                mbar_init(bar_full + 8 * s, THREADS);  // one cp.async arrival per thread
                mbar_init(bar_empty + 8 * s, PF3_WARPS);  // one arrival per warp
            }
        }
        __syncthreads();
        load_tile(0);
        cp_async_mbar_arrive(bar_full);
    } else {
        load_tile(0);
        cp_async_commit();
    }

    // Q tile -> bf16, swizzled (rows past the launch stay zero and are never written out)
    for (int u = tid; u < ROWS * CR; u += THREADS) {
        const int r = u / CR, c = u - r * CR;
        const int R = r0 + r;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (R < nrows) {
            const int ln = R / rep, j = R - ln * rep;
            const float* p = q + (i64)ln * ldq + (g * rep + j) * HD + c * 8;
            const float4 a = *reinterpret_cast<const float4*>(p);
            const float4 b = *reinterpret_cast<const float4*>(p + 4);
            v = make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y), pack_bf16x2(b.z, b.w));
        }
        *reinterpret_cast<uint4*>(sm + pf3_off<ROWS>(r, c)) = v;
    }
    if constexpr (WS || PIPE) {
        pf3_fence_proxy();  // the Q stores, visible to the async proxy
        __syncthreads();
    }

    int rpos[2];
#pragma unroll
    for (int i = 0; i < 2; i++) rpos[i] = pos0 + min(r0 + warp * 16 + gq + 8 * i, nrows - 1) / rep;
    const int wpos_lo = pos0 + min(r0 + warp * 16, nrows - 1) / rep;
    // the warpgroup's last row position: a tile past it changes none of its rows (warpgroup-uniform)
    const int gpos_hi = pos0 + min(r0 + wg * 64 + 63, nrows - 1) / rep;
    const bool g_live = r0 + wg * 64 < nrows;

    // descriptors of this warpgroup's Q rows and of stage 0's K and V (addresses < 256 KB: the 14-bit
    // start field never carries into the next one when offsets are added)
    const u64 dq0 = pf3_desc(q_base + wg * 64 * 128, 16, 1024);
    const u64 dk0 = pf3_desc(st_base, 16, 1024), dv0 = pf3_desc(st_base + KV_BYTES, NK * 128, 1024);
    const u64 dvr = pf3_desc(v_st, NK * 128, 1024);  // PIPE: V ring slot 0

    float o[DT * 4];
#pragma unroll
    for (int d = 0; d < DT * 4; d++) o[d] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    // One tile's online-softmax step from its scaled, masked scores score(n, c) (S n-tile n, C-fragment slot c):
    // the new running max (mu: the exponent base, 0 while no key is visible), corr = this tile's correction of
    // O and l, l += the bf16-rounded P, and put(n, i, pk) for every bf16 pair of P (n-tile n, row half i):
    // v2's arithmetic in v2's order.
    auto online = [&](auto score, float (&mu)[2], float (&corr)[2], auto put) {
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) mx[c >> 1] = fmaxf(mx[c >> 1], score(n, c));
#pragma unroll
        for (int i = 0; i < 2; i++) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 2));
            const float mn = fmaxf(m[i], mx[i]);
            mu[i] = mn == -INFINITY ? 0.f : mn;  // no visible key yet: nothing becomes NaN (v2)
            corr[i] = exp2f(m[i] - mu[i]);
            m[i] = mn;
            l[i] *= corr[i];
        }
#pragma unroll
        for (int kk = 0; kk < NK / 16; kk++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    const int n = 2 * kk + h;
                    const u32 pk = pack_bf16x2(exp2f(score(n, 2 * i) - mu[i]), exp2f(score(n, 2 * i + 1) - mu[i]));
                    put(n, i, pk);
                    l[i] += bf16x2_lo(pk) + bf16x2_hi(pk);
                }
    };
    // S (raw scores of tile kt at k0) -> P as bf16 pairs written over S's own registers (s[4 n + 2 i]: each score
    // is read before its slot is overwritten); fragment() then reads them out as wgmma A fragments (k16 step kk
    // = S n-tiles 2 kk, 2 kk + 1). Why in place: S's accumulators, their wgmma waited for, are the registers
    // no other wgmma reads.
    auto softmax = [&](float (&s)[NT * 4], int k0, float (&corr)[2]) {
        // scale (log2 units), causal mask where the tile crosses this warp's first row position
        const bool diag = k0 + NK - 1 > wpos_lo;
        auto score = [&](int n, int c) {
            const float x = s[4 * n + c] * scale_log2;
            return diag && k0 + n * 8 + 2 * tq + (c & 1) > rpos[c >> 1] ? -INFINITY : x;
        };
        float mu[2];
        online(score, mu, corr, [&](int n, int i, u32 pk) { s[4 * n + 2 * i] = __uint_as_float(pk); });
    };
    // PIPE main loop: the softmax's max, correction and sum while P V (kt - 1) is in flight, P itself formed again
    // after its wait (from S, mu and the same mask: the same bits). lim[i] = rpos[i] - k0 - 2 tq, made before the
    // wgmma go out; the mask as integer ops: a predicate-based select inside the window made ptxas 13 serialize
    // every wgmma of the kernel (C7513).
    auto softmax_e = [&](const float (&s)[NT * 4], bool diag, const int (&lim)[2], float (&mu)[2], float (&corr)[2]) {
        const int dmask = diag ? -1 : 0;
        auto score = [&](int n, int c) {
            const float x = s[4 * n + c] * scale_log2;
            const int b = (lim[c >> 1] - (n * 8 + (c & 1))) >> 31 & dmask;  // -1: masked (-inf), 0: x
            return __int_as_float((__float_as_int(x) & ~b) | (b & (int)0xff800000));
        };
        online(score, mu, corr, [](int, int, u32) {});
    };
    auto fragment = [&](const float (&s)[NT * 4], u32 (&p)[NK / 16][4]) {
#pragma unroll
        for (int kk = 0; kk < NK / 16; kk++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int i = 0; i < 2; i++) p[kk][2 * h + i] = __float_as_uint(s[4 * (2 * kk + h) + 2 * i]);
    };
    // O *= corr, skipped where every row of the warp kept its max (corr exactly 1: x * 1 is x, so the bits
    // are v2's): past the first tiles of a long row the max rarely moves
    auto rescale = [&](const float (&corr)[2]) {
        if (__any_sync(FULL_MASK, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
            for (int d = 0; d < DT; d++) {
                o[4 * d + 0] *= corr[0];
                o[4 * d + 1] *= corr[0];
                o[4 * d + 2] *= corr[1];
                o[4 * d + 3] *= corr[1];
            }
        }
    };
    // S = Q K^T of the K tile behind descriptor dk: 16 k16 steps over the head dim (the start-address field
    // is (byte address >> 4) in the low bits: a k step adds its offset / 16)
    auto issue_s = [&](float (&s)[NT * 4], u64 dk) {
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            const u64 da = dq0 + (((kk >> 2) * ROWS * 128 + (kk & 3) * 32) >> 4);
            const u64 db = dk + (((kk >> 2) * NK * 128 + (kk & 3) * 32) >> 4);
            if (kk == 0) {
                pf3_wgmma_s0(s, da, db);
            } else {
                pf3_wgmma_s(s, da, db, 1);
            }
        }
        pf3_wg_commit();
    };
    // O += P V of the V tile behind descriptor dv: 4 k16 steps over the tile's keys, V transposed by the instruction
    auto issue_pv = [&](const u32 (&p)[NK / 16][4], u64 dv) {
#pragma unroll
        for (int kk = 0; kk < NK / 16; kk++) pf3_wgmma_pv(o, p[kk], dv + ((kk * 16 * 128) >> 4), 1);
        pf3_wg_commit();
    };

    if constexpr (PIPE) {
        // this warpgroup's tiles: kt < nact (k0 <= its last row position); the rest it only loads and releases.
        // The wgmma sit in straight-line code (tile 0, the steady loop, the last P V): issued under a
        // per-tile condition, ptxas would serialize them (C7520).
        const int nact = !g_live || gpos_hi < kb0 ? 0 : min(ntk, (gpos_hi - kb0) / NK + 1);
        // iteration kt's copies: tile kt + 1, K into the slot tile kt - 1 left, V into tile kt - 2's
        auto load_next = [&](int kt) {
            if (kt + 1 >= ntk) return;
            if (kt >= 1) mbar_wait(bar_ke + 8 * ((kt + 1) % KS), ((kt - 1) / KS) & 1);
            load_one(kg, k_st + ((kt + 1) % KS) * KV_BYTES, kt + 1);
            cp_async_mbar_arrive(bar_kf + 8 * ((kt + 1) % KS));
            if (kt >= 2) mbar_wait(bar_ve + 8 * ((kt + 1) % VS), ((kt - 2) / VS) & 1);
            load_one(vg, v_st + ((kt + 1) % VS) * KV_BYTES, kt + 1);
            cp_async_mbar_arrive(bar_vf + 8 * ((kt + 1) % VS));
        };
        auto wait_k = [&](int kt) { mbar_wait(bar_kf + 8 * (kt % KS), (kt / KS) & 1); };
        auto wait_v = [&](int kt) { mbar_wait(bar_vf + 8 * (kt % VS), (kt / VS) & 1); };
        auto done_k = [&](int kt) {  // this warp no longer reads K tile kt
            __syncwarp();
            if (lane == 0) mbar_arrive(bar_ke + 8 * (kt % KS));
        };
        auto done_v = [&](int kt) {
            __syncwarp();
            if (lane == 0) mbar_arrive(bar_ve + 8 * (kt % VS));
        };
        auto k_desc = [&](int kt) { return dk0 + (((kt % KS) * KV_BYTES) >> 4); };
        auto v_desc = [&](int kt) { return dvr + (((kt % VS) * KV_BYTES) >> 4); };
        u32 pp[NK / 16][4];  // P of the tile whose P V is issued next
        if (nact > 0) {  // tile 0: S alone
            load_next(0);
            wait_k(0);
            pf3_fence_proxy();  // every thread's landed copies (acquired by the wait), for the async proxy
            float s[NT * 4];
            pf3_wg_fence();
            issue_s(s, k_desc(0));
            pf3_wg_wait<0>();
            pf3_reg_fence(s);
            done_k(0);
            float corr[2];
            softmax(s, kb0, corr);
            fragment(s, pp);
            rescale(corr);
        }
        for (int kt = 1; kt < nact; kt++) {  // S(kt) and P V (kt - 1) back to back
            load_next(kt);
            wait_k(kt);
            wait_v(kt - 1);
            pf3_fence_proxy();
            // the causal mask's bounds, before the wgmma go out: computed inside the window they would take
            // uniform registers that hold the in-flight wgmma's descriptors (ptxas then serializes, C7513)
            const int k0 = kb0 + kt * NK;
            const bool dg = k0 + NK - 1 > wpos_lo;
            int lim[2] = {rpos[0] - k0 - 2 * tq, rpos[1] - k0 - 2 * tq};
            asm volatile("" : "+r"(lim[0]), "+r"(lim[1]));
            float s[NT * 4];
            pf3_wg_fence();
            issue_s(s, k_desc(kt));
            issue_pv(pp, v_desc(kt - 1));
            pf3_wg_wait<1>();  // S(kt) landed; P V (kt - 1) still runs
            pf3_reg_fence(s);
            done_k(kt);
            float corr[2], mu[2];
            softmax_e(s, dg, lim, mu, corr);  // P V (kt - 1) runs meanwhile
            pf3_wg_wait<0>();
            pf3_reg_fence(o);
            pf3_reg_fence(s);     // S's registers and pp stayed reserved (untouched) until P V (kt - 1) landed
            pf3_reg_fence_u(pp);
            done_v(kt - 1);
            {  // P again, now into the A fragments: the same products, the same bits as the sums above used
                const bool diag = dg;
#pragma unroll
                for (int kk = 0; kk < NK / 16; kk++)
#pragma unroll
                    for (int h = 0; h < 2; h++)
#pragma unroll
                        for (int i = 0; i < 2; i++) {
                            const int n = 2 * kk + h;
                            float x0 = s[4 * n + 2 * i] * scale_log2, x1 = s[4 * n + 2 * i + 1] * scale_log2;
                            if (diag && n * 8 > lim[i]) x0 = -INFINITY;
                            if (diag && n * 8 + 1 > lim[i]) x1 = -INFINITY;
                            pp[kk][2 * h + i] = pack_bf16x2(exp2f(x0 - mu[i]), exp2f(x1 - mu[i]));
                        }
            }
            rescale(corr);
        }
        if (nact > 0) {  // P V of the last tile
            wait_v(nact - 1);
            pf3_fence_proxy();
            pf3_wg_fence();
            issue_pv(pp, v_desc(nact - 1));
            pf3_wg_wait<0>();
            pf3_reg_fence(o);
            pf3_reg_fence_u(pp);
            done_v(nact - 1);
        }
        for (int kt = nact; kt < ntk; kt++) {  // tiles past this warpgroup's rows: copies and releases only
            load_next(kt);
            wait_k(kt);
            done_k(kt);
            wait_v(kt);
            done_v(kt);
        }
    } else {
        for (int kt = 0; kt < ntk; kt++) {
            if constexpr (WS) {
                if (kt + 1 < ntk) {  // tile kt + 1 into the stage tile kt - 1 left, once every warp released it
                    if (kt >= 1) mbar_wait(bar_empty + 8 * ((kt + 1) & 1), ((kt - 1) >> 1) & 1);
                    load_tile(kt + 1);
                    cp_async_mbar_arrive(bar_full + 8 * ((kt + 1) & 1));
                }
                mbar_wait(bar_full + 8 * (kt & 1), (kt >> 1) & 1);
                pf3_fence_proxy();  // every thread's landed copies (acquired by the wait), for the async proxy
            } else {
                if (kt + 1 < ntk) {
                    load_tile(kt + 1);
                    cp_async_commit();
                    cp_async_wait<1>();
                } else {
                    cp_async_wait<0>();
                }
                pf3_fence_proxy();  // this thread's Q stores and landed cp.async bytes, visible to the async proxy
                __syncthreads();
            }
            const int k0 = kb0 + kt * NK;
            if (g_live && k0 <= gpos_hi) {
                const u64 dk = dk0 + (((kt & 1) * STAGE_BYTES) >> 4), dv = dv0 + (((kt & 1) * STAGE_BYTES) >> 4);
                float s[NT * 4];
                pf3_wg_fence();
                issue_s(s, dk);
                pf3_wg_wait<0>();
                pf3_reg_fence(s);
                u32 p[NK / 16][4];
                float corr[2];
                softmax(s, k0, corr);
                fragment(s, p);
                rescale(corr);
                pf3_reg_fence(o);
                pf3_wg_fence();
                issue_pv(p, dv);
                pf3_wg_wait<0>();
                pf3_reg_fence(o);
            }
            if constexpr (WS) {  // this warp is done reading the stage (its wgmma waited above)
                __syncwarp();
                if (lane == 0) mbar_arrive(bar_empty + 8 * (kt & 1));
            } else {
                __syncthreads();  // both warpgroups are done with this stage before it is refilled
            }
        }
    }

    // epilogue (v2's): full row sums over the quad; direct rows normalize + gate, split rows write partials
#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] += __shfl_xor_sync(FULL_MASK, l[i], 1);
        l[i] += __shfl_xor_sync(FULL_MASK, l[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; i++)
        prefill_attn_row_out<HD>([&](int d, int e) { return o[4 * d + e]; }, i, r0 + warp * 16 + gq + 8 * i, nrows, rep,
                                 g, nq, pos0, kb0, blk, nblk, tq, m, l, qg, ldqg, out, ldo, part);
}
#endif

#define PF3_KERNEL(NAME, FORM, THREADS)                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                                   \
        NAME(const float* q, int ldq, const u16* kc, const u16* vc, int max_pos, int nq, int nkv, int t,         \
             float scale_log2, const int* pos0_dev, int lane0, const float* qg, int ldqg, float* out, int ldo,    \
             float* part) {                                                                                     \
        PF3_CALL(FORM)                                                                                          \
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PF3_CALL(FORM) \
    prefill3_body<FORM>(q, ldq, kc, vc, max_pos, nq, nkv, t, scale_log2, pos0_dev, lane0, qg, ldqg, out, ldo, part);
#else
#define PF3_CALL(FORM) __trap();  // built for sm_90a only (kernels.attention_prefill3_supported)
#endif
PF3_KERNEL(attn_prefill3_bf16_d256, 0, 32 * PF3_WARPS)
PF3_KERNEL(attn_prefill3_bf16_d256_ws, 1, 32 * PF3_WARPS)
PF3_KERNEL(attn_prefill3_bf16_d256_pipe, 2, 32 * PF3_WARPS)
