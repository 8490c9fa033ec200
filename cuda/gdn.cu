// Gated DeltaNet recurrence, one warp per (v-head, value column j): the warp keeps column
// j of the head's state S[:, j] (dk floats, K-last layout [HV][dv][dk]) in registers and
// walks the lanes (tokens) in order:
//     S = e^g S;  u = beta (v_j - S.k);  S += k u;  o_j = S.q
// The same kernel is the decode step (write_state=1), the verify lanes (write_state=0:
// outputs only, committed S untouched) and the commit (emit=0, write_state=1, n lanes
// replayed from the recorded rows): one body, so a commit of n lanes gives the bits of n
// decode steps. Reductions are xor-butterflies, which leave every lane the same sum.
#include "common.cuh"

template <int KPL>
__device__ __forceinline__ void gdn_body(float* __restrict__ state, const float* __restrict__ qkvn,
                                         const float* __restrict__ gb, float* __restrict__ out, int ldo, int H, int HV,
                                         int dk, int dv, int nlanes, int emit, int write_state) {
    const int wid = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (wid >= HV * dv) return;
    const int h = wid / dv, j = wid - h * dv, kh = h / (HV / H);
    const int C = 2 * H * dk + HV * dv;
    float* col = state + (i64)(h * dv + j) * dk;
    float s[KPL];
    bool ok[KPL];
#pragma unroll
    for (int i = 0; i < KPL; i++) {
        const int kk = lane * KPL + i;
        ok[i] = kk < dk;
        s[i] = ok[i] ? col[kk] : 0.f;
    }
    for (int t = 0; t < nlanes; t++) {
        const float* row = qkvn + (i64)t * C;
        float q[KPL], k[KPL];
#pragma unroll
        for (int i = 0; i < KPL; i++) {
            const int kk = lane * KPL + i;
            q[i] = ok[i] ? row[kh * dk + kk] : 0.f;
            k[i] = ok[i] ? row[H * dk + kh * dk + kk] : 0.f;
        }
        const float v = row[2 * H * dk + h * dv + j];
        const float g = gb[(i64)t * 2 * HV + h], beta = gb[(i64)t * 2 * HV + HV + h];
        const float decay = expf(g);
        float pk = 0.f;
#pragma unroll
        for (int i = 0; i < KPL; i++) {
            s[i] = s[i] * decay;
            pk = fmaf(s[i], k[i], pk);
        }
        const float pred = warp_sum(pk);
        const float u = beta * (v - pred);
        float pq = 0.f;
#pragma unroll
        for (int i = 0; i < KPL; i++) {
            s[i] = fmaf(k[i], u, s[i]);
            pq = fmaf(s[i], q[i], pq);
        }
        const float o = warp_sum(pq);
        if (emit && lane == 0) out[(i64)t * ldo + h * dv + j] = o;
    }
    if (write_state) {
#pragma unroll
        for (int i = 0; i < KPL; i++)
            if (ok[i]) col[lane * KPL + i] = s[i];
    }
}

// grid (ceil(HV*dv/4), layers), block 128. Per-layer strides let the commit run every GDN
// layer in one launch; n_dev (if non-null) overrides nlanes from device memory.
#define GDN_KERNEL(NAME, KPL)                                                                                         \
    extern "C" __global__ void NAME(float* state, i64 state_stride, const float* qkvn, i64 qkvn_stride,              \
                                    const float* gb, i64 gb_stride, float* out, int ldo, int H, int HV, int dk, int dv, \
                                    int nlanes, const int* n_dev, int emit, int write_state) {                        \
        pdl_entry();                                                                                                  \
        const int L = blockIdx.y;                                                                                     \
        gdn_body<KPL>(state + L * state_stride, qkvn + L * qkvn_stride, gb + L * gb_stride, out, ldo, H, HV, dk, dv,  \
                      n_dev ? *n_dev : nlanes, emit, write_state);                                                    \
    }

GDN_KERNEL(gdn_step_k1, 1)
GDN_KERNEL(gdn_step_k2, 2)
GDN_KERNEL(gdn_step_k4, 4)

// decode_batch (common.cuh lane table): grid (ceil(HV*dv/4), lanes), block 128. Lane b is its own
// sequence's one-token decode step: its state's S (+ state_off bytes: this layer) and its rows b of
// qkvn / gb / out -- gdn_body exactly as a one-lane gdn_step runs it. nlanes / emit / write_state
// stay arguments (the caller passes 1, 1, 1) so the body compiles as the one-sequence entry's does.
#define GDN_LANES_KERNEL(NAME, KPL)                                                                                   \
    extern "C" __global__ void NAME(const i64* lanes, i64 state_off, const float* qkvn, const float* gb, float* out,  \
                                    int ldo, int H, int HV, int dk, int dv, int nlanes, int emit, int write_state) {  \
        pdl_entry();                                                                                                  \
        const int b = blockIdx.y;                                                                                     \
        gdn_body<KPL>(lane_ptr<float>(lanes, b, LT_GDN, state_off), qkvn + (i64)b * (2 * H * dk + HV * dv),           \
                      gb + (i64)b * 2 * HV, out + (i64)b * ldo, ldo, H, HV, dk, dv, nlanes, emit, write_state);        \
    }

GDN_LANES_KERNEL(gdn_step_lanes_k1, 1)
GDN_LANES_KERNEL(gdn_step_lanes_k2, 2)
GDN_LANES_KERNEL(gdn_step_lanes_k4, 4)

// Prefill variant: the same recurrence, bit for bit (the same operations per column in the same
// order, the same butterflies), but one warp owns NC consecutive value columns of a head. Why:
// the decode kernel's 48 x 128 = 6144 warps (27B) run in ~3 waves on 132 SMs and each token step
// is a dependent chain (two 5-shuffle reductions plus the next token's loads), so a long prefill
// costs ~1.4 us per token per layer. With NC = 4 the warps fit one wave, the NC reductions of a
// step are independent (ILP), q/k loads are shared by the NC columns, and the next token's inputs
// are loaded before the current step's math (register double buffering). dv % NC == 0.
template <int KPL, int NC>
__device__ __forceinline__ void gdn_prefill_body(float* __restrict__ state, const float* __restrict__ qkvn,
                                                 const float* __restrict__ gb, float* __restrict__ out, int ldo, int H,
                                                 int HV, int dk, int dv, int nlanes) {
    const int wid = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const int per_head = dv / NC;
    if (wid >= HV * per_head) return;
    const int h = wid / per_head, j0 = (wid - h * per_head) * NC, kh = h / (HV / H);
    const int C = 2 * H * dk + HV * dv;
    float s[NC][KPL];
    bool ok[KPL];
#pragma unroll
    for (int i = 0; i < KPL; i++) ok[i] = lane * KPL + i < dk;
#pragma unroll
    for (int c = 0; c < NC; c++) {
        const float* col = state + (i64)(h * dv + j0 + c) * dk;
#pragma unroll
        for (int i = 0; i < KPL; i++) s[c][i] = ok[i] ? col[lane * KPL + i] : 0.f;
    }
    float qn[KPL], kn[KPL], vn[NC], gn = 0.f, bn = 0.f;
    auto load = [&](int t) {
        const float* row = qkvn + (i64)t * C;
#pragma unroll
        for (int i = 0; i < KPL; i++) {
            const int kk = lane * KPL + i;
            qn[i] = ok[i] ? __ldg(row + kh * dk + kk) : 0.f;
            kn[i] = ok[i] ? __ldg(row + H * dk + kh * dk + kk) : 0.f;
        }
#pragma unroll
        for (int c = 0; c < NC; c++) vn[c] = __ldg(row + 2 * H * dk + h * dv + j0 + c);
        gn = __ldg(gb + (i64)t * 2 * HV + h);
        bn = __ldg(gb + (i64)t * 2 * HV + HV + h);
    };
    if (nlanes > 0) load(0);
    for (int t = 0; t < nlanes; t++) {
        float q[KPL], k[KPL], v[NC];
#pragma unroll
        for (int i = 0; i < KPL; i++) { q[i] = qn[i]; k[i] = kn[i]; }
#pragma unroll
        for (int c = 0; c < NC; c++) v[c] = vn[c];
        const float decay = expf(gn), beta = bn;
        if (t + 1 < nlanes) load(t + 1);
        float pk[NC];
#pragma unroll
        for (int c = 0; c < NC; c++) {
            pk[c] = 0.f;
#pragma unroll
            for (int i = 0; i < KPL; i++) {
                s[c][i] = s[c][i] * decay;
                pk[c] = fmaf(s[c][i], k[i], pk[c]);
            }
        }
#pragma unroll
        for (int c = 0; c < NC; c++) pk[c] = warp_sum(pk[c]);
        float pq[NC];
#pragma unroll
        for (int c = 0; c < NC; c++) {
            const float u = beta * (v[c] - pk[c]);
            pq[c] = 0.f;
#pragma unroll
            for (int i = 0; i < KPL; i++) {
                s[c][i] = fmaf(k[i], u, s[c][i]);
                pq[c] = fmaf(s[c][i], q[i], pq[c]);
            }
        }
#pragma unroll
        for (int c = 0; c < NC; c++) pq[c] = warp_sum(pq[c]);
        if (lane == 0) {
#pragma unroll
            for (int c = 0; c < NC; c++) out[(i64)t * ldo + h * dv + j0 + c] = pq[c];
        }
    }
#pragma unroll
    for (int c = 0; c < NC; c++) {
        float* col = state + (i64)(h * dv + j0 + c) * dk;
#pragma unroll
        for (int i = 0; i < KPL; i++)
            if (ok[i]) col[lane * KPL + i] = s[c][i];
    }
}

// grid ceil(HV * dv / GDN_PF_COLS / GDN_PF_WARPS), block 32 * GDN_PF_WARPS: emits outputs and
// writes the state (a prefill chunk).
#define GDN_PREFILL_KERNEL(NAME, KPL)                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * GDN_PF_WARPS)                                         \
        NAME(float* state, const float* qkvn, const float* gb, float* out, int ldo, int H, int HV, int dk,  \
             int dv, int nlanes) {                                                                          \
        pdl_entry();                                                                                        \
        gdn_prefill_body<KPL, GDN_PF_COLS>(state, qkvn, gb, out, ldo, H, HV, dk, dv, nlanes);               \
    }

GDN_PREFILL_KERNEL(gdn_prefill_k1, 1)
GDN_PREFILL_KERNEL(gdn_prefill_k2, 2)
GDN_PREFILL_KERNEL(gdn_prefill_k4, 4)
