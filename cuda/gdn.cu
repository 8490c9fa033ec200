// Gated DeltaNet recurrence, per value column j of a v-head's state S[:, j] (dk floats, K-last
// layout [HV][dv][dk]), walking the lanes (tokens) in order:
//     S = e^g S;  u = beta (v_j - S.k);  S += k u;  o_j = S.q
// The same body is the decode step (write_state=1), the verify lanes (write_state=0: outputs only,
// committed S untouched), the commit (emit=0, write_state=1, n lanes replayed from the recorded
// rows) and the sequential prefill: so a commit of n lanes gives the bits of n decode steps.
//
// The arithmetic is defined by the original one-warp-per-column form (and gdn_decode.cu keeps it):
// "virtual lane" l in 0..31 holds k indices l*KPL + i, accumulates its partial dot product with a
// KPL-long fmaf chain, and a 32-wide xor butterfly (offsets 16, 8, 4, 2, 1) sums the partials. Here
// LPC = GDN_ST_LPC real lanes share a column: real lane g = lane % LPC holds the virtual lanes
// g + LPC m (m < 32 / LPC), so the butterfly's offsets 16 .. LPC pair partials inside one thread
// (an add tree in registers) and only offsets LPC / 2 .. 1 are shuffles. Same pairs, same order,
// same bits (fadd is commutative); a warp carries 32 / LPC columns and each shuffle serves them all.
//
// Why: one warp per column (6,144 warps for 27B) spent each token on 2 x 5 dependent shuffle levels
// per column (~0.75-1.4 us per token per layer, measured), and waited on each token's global loads.
// A CTA here is GDN_ST_WARPS warps on consecutive columns of one head, so they share the head's
// q / k rows: the CTA copies up to GDN_ST_TILE tokens' inputs (q, k of its key head, v of its
// columns, g, beta) into shared memory in one burst of independent loads, then runs the chain.
#include "common.cuh"

static_assert(GDN_ST_LPC == 1 || GDN_ST_LPC == 2 || GDN_ST_LPC == 4 || GDN_ST_LPC == 8 || GDN_ST_LPC == 16 ||
                  GDN_ST_LPC == 32, "lanes per column: a power of two dividing the warp");
constexpr int GDN_ST_V = 32 / GDN_ST_LPC;                // virtual lanes per thread = columns per warp
constexpr int GDN_ST_CB = GDN_ST_V * GDN_ST_WARPS;       // columns per CTA

// Copy tokens t0 .. t0 + nt - 1's inputs into shared memory (cp.async: every copy in flight at
// once, no register round trip): q / k rows of key head kh (KS floats per row, zero past dk: the
// chain reads the whole row), v of the block's ncols columns, g, beta. Each thread has fixed
// (element, first token) coordinates, so the loops carry no divisions.
template <int KS>
__device__ __forceinline__ void gdn_stage_tile(const float* __restrict__ qkvn, const float* __restrict__ gb, int H,
                                               int HV, int dk, int dv, int h, int kh, int jb, int ncols, int t0,
                                               int nt, float* sq, float* sk, float* sv, float* sg, float* sb) {
    const int C = 2 * H * dk + HV * dv;
    const int tid = threadIdx.x, nth = blockDim.x;
    const float* base = qkvn + (i64)t0 * C;
    const bool vec = ((dk | C) & 3) == 0 && (((unsigned long long)base) & 15) == 0;
    const int unit = vec ? 4 : 1, per = dk / unit, per2 = 2 * per;  // copies per token: q then k
    const int rs = nth >= per2 ? nth / per2 : 1, r0 = tid / per2;
    if (r0 < rs) {
        for (int x = tid % per2; x < per2; x += nth) {
            const bool isk = x >= per;
            const int e = (isk ? x - per : x) * unit;
            const float* src = base + (isk ? H * dk : 0) + kh * dk + e;
            float* dst = (isk ? sk : sq) + e;
            for (int tt = r0; tt < nt; tt += rs) {
                if (vec)
                    cp_async_ca16((u32)__cvta_generic_to_shared(dst + tt * KS), src + (i64)tt * C);
                else
                    cp_async_ca4((u32)__cvta_generic_to_shared(dst + tt * KS), src + (i64)tt * C);
            }
        }
    }
    for (int x = tid; x < 2 * (KS - dk); x += nth) {  // zero pad past dk (plain stores: disjoint from the copies)
        const bool isk = x >= KS - dk;
        const int e = dk + (isk ? x - (KS - dk) : x);
        for (int tt = 0; tt < nt; tt++) (isk ? sk : sq)[tt * KS + e] = 0.f;
    }
    {
        const int c = tid % GDN_ST_CB, vr = tid / GDN_ST_CB, vrs = nth / GDN_ST_CB;
        if (c < ncols)
            for (int tt = vr; tt < nt; tt += vrs)
                cp_async_ca4((u32)__cvta_generic_to_shared(sv + tt * GDN_ST_CB + c),
                             base + (i64)tt * C + 2 * H * dk + h * dv + jb + c);
    }
    if (tid < nt) {
        cp_async_ca4((u32)__cvta_generic_to_shared(sg + tid), gb + (i64)(t0 + tid) * 2 * HV + h);
        cp_async_ca4((u32)__cvta_generic_to_shared(sb + tid), gb + (i64)(t0 + tid) * 2 * HV + HV + h);
    }
    cp_async_wait_all_mem();
}

// The 32-wide xor butterfly of virtual lanes g + LPC m (p[m]): offsets 16 .. LPC in registers (m
// paired with m + half), LPC / 2 .. 1 across the real lanes of the column. Every lane of the
// column ends with the same sum.
__device__ __forceinline__ float gdn_butterfly(float (&p)[GDN_ST_V]) {
#pragma unroll
    for (int half = GDN_ST_V / 2; half >= 1; half >>= 1)
#pragma unroll
        for (int m = 0; m < half; m++) p[m] = p[m] + p[m + half];
    float c = p[0];
#pragma unroll
    for (int o = GDN_ST_LPC / 2; o >= 1; o >>= 1) c += __shfl_xor_sync(FULL_MASK, c, o);
    return c;
}

// One CTA = columns [jb, jb + GDN_ST_CB) of head h (cb: the column block); warp w carries columns
// jb + V w .. jb + V w + V - 1, lane = LPC * column + g.
template <int KPL>
__device__ __forceinline__ void gdn_body(float* __restrict__ state, const float* __restrict__ qkvn,
                                         const float* __restrict__ gb, float* __restrict__ out, int ldo, int H, int HV,
                                         int dk, int dv, int nlanes, int emit, int write_state, int cb) {
    constexpr int CB = GDN_ST_CB, KS = 32 * KPL;
    __shared__ __align__(16) float sq[GDN_ST_TILE * KS];
    __shared__ __align__(16) float sk[GDN_ST_TILE * KS];
    __shared__ float sv[GDN_ST_TILE * CB], sg[GDN_ST_TILE], sb[GDN_ST_TILE];
    const int nblk = (dv + CB - 1) / CB;
    const int h = cb / nblk, jb = (cb - h * nblk) * CB, kh = h / (HV / H);
    const int ncols = min(CB, dv - jb);
    constexpr int V = GDN_ST_V, LPC = GDN_ST_LPC;
    const int lane = threadIdx.x & 31, g = lane % LPC;
    const int jc = (threadIdx.x >> 5) * V + lane / LPC;  // this thread's column in the block
    const bool cok = jc < ncols;
    // s[m][i]: virtual lane g + LPC m's element i, k index (g + LPC m) * KPL + i
    float s[V][KPL];
    float* col = state + (i64)(h * dv + jb + jc) * dk;
    // KPL = 4: a virtual lane's four elements are one aligned float4 (16 B loads / stores)
    const bool vec4 = KPL == 4 && (dk & 3) == 0 && (((unsigned long long)col) & 15) == 0;
#pragma unroll
    for (int m = 0; m < V; m++) {
        const int k0 = (g + LPC * m) * KPL;
        if (vec4) {
            const float4 v = (cok && k0 < dk) ? *reinterpret_cast<const float4*>(col + k0) : make_float4(0.f, 0.f, 0.f, 0.f);
            s[m][0] = v.x, s[m][1 % KPL] = v.y, s[m][2 % KPL] = v.z, s[m][3 % KPL] = v.w;
        } else {
#pragma unroll
            for (int i = 0; i < KPL; i++) s[m][i] = (cok && k0 + i < dk) ? col[k0 + i] : 0.f;
        }
    }
    for (int t0 = 0; t0 < nlanes; t0 += GDN_ST_TILE) {
        const int nt = min(GDN_ST_TILE, nlanes - t0);
        __syncthreads();  // the previous tile is consumed
        gdn_stage_tile<KS>(qkvn, gb, H, HV, dk, dv, h, kh, jb, ncols, t0, nt, sq, sk, sv, sg, sb);
        __syncthreads();
        for (int tt = 0; tt < nt; tt++) {
            const float* kr = sk + tt * KS;  // zero-padded past dk by the stager
            const float* qr = sq + tt * KS;
            float k[V][KPL];
#pragma unroll
            for (int m = 0; m < V; m++)
#pragma unroll
                for (int i = 0; i < KPL; i++) k[m][i] = kr[(g + LPC * m) * KPL + i];
            const float decay = expf(sg[tt]), beta = sb[tt];
            float p[V];
#pragma unroll
            for (int m = 0; m < V; m++) {
                p[m] = 0.f;
#pragma unroll
                for (int i = 0; i < KPL; i++) {
                    s[m][i] = s[m][i] * decay;
                    p[m] = fmaf(s[m][i], k[m][i], p[m]);
                }
            }
            const float pred = gdn_butterfly(p);
            const float v = cok ? sv[tt * CB + jc] : 0.f;
            const float u = beta * (v - pred);
#pragma unroll
            for (int m = 0; m < V; m++) {
                p[m] = 0.f;
#pragma unroll
                for (int i = 0; i < KPL; i++) {
                    s[m][i] = fmaf(k[m][i], u, s[m][i]);
                    p[m] = fmaf(s[m][i], qr[(g + LPC * m) * KPL + i], p[m]);
                }
            }
            const float o = gdn_butterfly(p);
            if (emit && g == 0 && cok) out[(i64)(t0 + tt) * ldo + h * dv + jb + jc] = o;
        }
    }
    if (write_state && cok) {
#pragma unroll
        for (int m = 0; m < V; m++) {
            const int k0 = (g + LPC * m) * KPL;
            if (vec4) {
                if (k0 < dk)
                    *reinterpret_cast<float4*>(col + k0) = make_float4(s[m][0], s[m][1 % KPL], s[m][2 % KPL], s[m][3 % KPL]);
            } else {
#pragma unroll
                for (int i = 0; i < KPL; i++)
                    if (k0 + i < dk) col[k0 + i] = s[m][i];
            }
        }
    }
}

// grid (HV * ceil(dv / GDN_ST_CB), layers), block 32 * GDN_ST_WARPS. Per-layer
// strides let the commit run every GDN layer in one launch; n_dev (if non-null) overrides nlanes
// from device memory.
#define GDN_KERNEL(NAME, KPL)                                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * GDN_ST_WARPS)                                                  \
        NAME(float* state, i64 state_stride, const float* qkvn, i64 qkvn_stride, const float* gb, i64 gb_stride,     \
             float* out, int ldo, int H, int HV, int dk, int dv, int nlanes, const int* n_dev, int emit,             \
             int write_state) {                                                                                       \
        pdl_entry();                                                                                                  \
        const int L = blockIdx.y;                                                                                     \
        gdn_body<KPL>(state + L * state_stride, qkvn + L * qkvn_stride, gb + L * gb_stride, out, ldo, H, HV, dk, dv,  \
                      n_dev ? *n_dev : nlanes, emit, write_state, blockIdx.x);                                        \
    }

GDN_KERNEL(gdn_step_k1, 1)
GDN_KERNEL(gdn_step_k2, 2)
GDN_KERNEL(gdn_step_k4, 4)

// decode_batch (common.cuh lane table): grid (HV * column blocks, lanes), block 32 * GDN_ST_WARPS.
// Lane b is its own sequence's one-token decode step: its state's S (+ state_off bytes: this
// layer) and its rows b of qkvn / gb / out -- gdn_body exactly as a one-lane gdn_step runs it.
// nlanes / emit / write_state stay arguments (the caller passes 1, 1, 1) so the body compiles as
// the one-sequence entry's does.
#define GDN_LANES_KERNEL(NAME, KPL)                                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * GDN_ST_WARPS)                                                  \
        NAME(const i64* lanes, i64 state_off, const float* qkvn, const float* gb, float* out, int ldo, int H, int HV, \
             int dk, int dv, int nlanes, int emit, int write_state) {                                                 \
        pdl_entry();                                                                                                  \
        const int b = blockIdx.y;                                                                                     \
        gdn_body<KPL>(lane_ptr<float>(lanes, b, LT_GDN, state_off), qkvn + (i64)b * (2 * H * dk + HV * dv),           \
                      gb + (i64)b * 2 * HV, out + (i64)b * ldo, ldo, H, HV, dk, dv, nlanes, emit, write_state,        \
                      blockIdx.x);                                                                                    \
    }

GDN_LANES_KERNEL(gdn_step_lanes_k1, 1)
GDN_LANES_KERNEL(gdn_step_lanes_k2, 2)
GDN_LANES_KERNEL(gdn_step_lanes_k4, 4)

// verify_batch / commit_batch (common.cuh group table): grid (HV * column blocks, layers, groups), block
// 32 * GDN_ST_WARPS. Group g is one sequence's verify run as gdn_step runs it alone: its state's S
// (lane row r0 = GT_FIRST[g]; + state_off + layer x state_layer_bytes), its rows r0 .. of qkvn / gb
// (+ layer x *_stride floats) and of out, nlanes = the group table's count_field entry -- GT_COUNT for
// the verify (emit 1, write_state 0, one layer), GT_KEEP for the commit replay (emit 0, write_state 1,
// every GDN layer; 0 kept: the group is left alone). gdn_body exactly as the one-sequence launch runs it.
#define GDN_GROUPS_KERNEL(NAME, KPL)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * GDN_ST_WARPS)                                                  \
        NAME(const i64* lanes, const int* groups, int count_field, i64 state_off, i64 state_layer_bytes,            \
             const float* qkvn, i64 qkvn_stride, const float* gb, i64 gb_stride, float* out, int ldo, int H, int HV,  \
             int dk, int dv, int emit, int write_state) {                                                             \
        pdl_entry();                                                                                                  \
        const int L = blockIdx.y, g = blockIdx.z;                                                                     \
        const int n = group_field(groups, count_field, g);                                                            \
        if (n == 0) return;                                                                                           \
        const i64 r0 = group_field(groups, GT_FIRST, g);                                                              \
        gdn_body<KPL>(lane_ptr<float>(lanes, (int)r0, LT_GDN, state_off + L * state_layer_bytes),                     \
                      qkvn + L * qkvn_stride + r0 * (2 * H * dk + HV * dv), gb + L * gb_stride + r0 * 2 * HV,         \
                      emit ? out + r0 * ldo : out, ldo, H, HV, dk, dv, n, emit, write_state, blockIdx.x);             \
    }

GDN_GROUPS_KERNEL(gdn_step_groups_k1, 1)
GDN_GROUPS_KERNEL(gdn_step_groups_k2, 2)
GDN_GROUPS_KERNEL(gdn_step_groups_k4, 4)
