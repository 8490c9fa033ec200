// The GDN decode / verify step of one layer as one kernel: causal conv + SiLU + q/k l2 norm +
// decay/beta gates (cuda/conv.cu gdn_conv), the gated delta rule step (cuda/gdn.cu gdn_step),
// the gated RMSNorm of the output (cuda/norm.cu gated_rmsnorm; given xq, also its a8 activations for the out
// projection, as gated_rmsnorm_a8 writes them) and, when committing, the conv
// window slide (gdn_conv_commit). Why: on the 27B each of those launches costs a few microseconds
// of graph-node overhead for under a microsecond of work, 48 layers per token.
//
// Bits: every value is computed by the same operations in the same order as the kernel chain
// (conv taps with __fmul_rn / __fadd_rn; the block reductions' per-warp xor butterflies over the
// same 32-element groups, then the butterfly over the warp partials with the missing ones +0;
// the recurrence per value column exactly as gdn_body; the norm as gated_rmsnorm), and values
// cross phases only through memory, so fused == chain bit for bit (tests/gpu/test_gdn_fused.py).
// The records the verify / commit machinery replays (qkvn rows, g/beta) are written as gdn_conv
// writes them.
//
// Grid (NB, HV): block (b, h) owns value head h's columns [b*cols, (b+1)*cols), cols = warps x
// GDN_FD_COLS (each warp GDN_FD_COLS columns, as the prefill variant). The head's q/k conv (its key
// head kh, 2*dk channels) is recomputed by each of the HV/H x NB blocks reading kh -- a few KB of
// L2 reads per block beside 16+ KB of state -- because handing it over between blocks would need
// a grid-wide wait. Two cross-block steps remain, each a ticket (atomic counter, reset by the last
// arrival, so a captured graph replays cleanly):
//   norm:   the last of head h's NB blocks to finish its columns normalizes the head (it reads the
//           o columns the others wrote; __threadfence before and after the ticket);
//   window: when committing, the q/k window channels of kh are read by every block of the group,
//           so only the group's last block to finish its conv slides them; v channels are read by
//           their owner alone, which slides them itself.
// tickets[0..H): window tickets per key head; tickets[H..H+HV): norm tickets per value head.
//
// Shared memory (dynamic, floats): sqk [T][2 dk] (q then k, normalized), sv [T][cols], sgb [T][2].
#include "common.cuh"

// Conv taps + SiLU of channel ch for lane t (gdn_conv's inner loop, the same expression order).
__device__ __forceinline__ float fd_conv_silu(const float* __restrict__ raw, int ldr, const float* __restrict__ window,
                                              const float* __restrict__ convw, int C, int KW, int t, int ch) {
    float acc = 0.f;
    for (int j = 0; j < KW; j++) {
        const int idx = t + j;  // position in [window ; raw rows]
        const float xv = idx < KW - 1 ? window[(i64)idx * C + ch] : raw[(i64)(idx - (KW - 1)) * ldr + ch];
        acc = __fadd_rn(acc, __fmul_rn(convw[(i64)ch * KW + j], xv));
    }
    return acc * sigmoid_f(acc);
}

// Slide one channel's window by n raw rows (gdn_conv_commit's body).
__device__ __forceinline__ void fd_window_slide(float* __restrict__ window, const float* __restrict__ raw, int ldr,
                                                int C, int KW, int n, int ch) {
    float keep[8];
    for (int i = 0; i < KW - 1 && i < 8; i++) {
        const int idx = n + i;  // in [window ; raw rows 0..n-1]
        keep[i] = idx < KW - 1 ? window[(i64)idx * C + ch] : raw[(i64)(idx - (KW - 1)) * ldr + ch];
    }
    for (int i = 0; i < KW - 1 && i < 8; i++) window[(i64)i * C + ch] = keep[i];
}

// True in every thread of the block for the ticket's last arrival (of `expect`); resets it then.
__device__ __forceinline__ bool fd_last_arrival(int* ticket, int expect, int* flag) {
    if (expect <= 1) return true;
    __threadfence();  // this block's writes (and completed reads) before its arrival
    __syncthreads();
    if (threadIdx.x == 0) {
        const int prev = atomicAdd(ticket, 1);
        const bool last = prev == expect - 1;
        if (last) *ticket = 0;  // every other arrival is in: ready for the next launch
        *flag = last;
    }
    __syncthreads();
    const bool last = *flag != 0;
    if (last) __threadfence();  // the other blocks' writes before this block's reads
    return last;
}

template <int KPL>
__device__ __forceinline__ void gdn_decode_body(
    const float* __restrict__ raw, int ldr, float* __restrict__ window, const float* __restrict__ convw,
    const float* __restrict__ ab, int ldab, const float* __restrict__ neg_a, const float* __restrict__ dt_bias, int H,
    int HV, int dk, int dv, int KW, float q_scale, float* __restrict__ qkvn, float* __restrict__ gb,
    float* __restrict__ state, float* __restrict__ out, int ldo, const float* __restrict__ normw, float eps,
    float* __restrict__ y, int ldy, u8* __restrict__ xq, int ldq, float* __restrict__ xs, int* __restrict__ tickets,
    int T, int commit) {
    constexpr int NC = GDN_FD_COLS;
    extern __shared__ float smem[];
    __shared__ int flag;
    const int C = 2 * H * dk + HV * dv;
    const int nwarps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int cols = nwarps * NC, nb = gridDim.x, b = blockIdx.x, h = blockIdx.y;
    const int rep = HV / H, kh = h / rep;
    const int nwk = (dk + 31) >> 5, nwv = (dv + 31) >> 5;  // 32-element reduction groups (<= 32: dv <= 1024)
    float* sqk = smem;                  // [T][2 dk]
    float* sv = sqk + T * 2 * dk;       // [T][cols]
    float* sgb = sv + T * cols;         // [T][2]: g, beta
    const bool qk_owner = (h % rep) == 0 && b == 0;  // writes the key head's q/k records
    const int jw = b * cols + warp * NC;              // this warp's first value column
    const bool active = jw < dv;                      // dv % NC == 0: all NC columns or none

    // 0. the state columns first: their loads overlap the conv phase (independent of it)
    float s[NC][KPL];
    bool ok[KPL];
#pragma unroll
    for (int i = 0; i < KPL; i++) ok[i] = lane * KPL + i < dk;
#pragma unroll
    for (int c = 0; c < NC; c++) {
        const float* col = state + (i64)(h * dv + (active ? jw + c : 0)) * dk;
#pragma unroll
        for (int i = 0; i < KPL; i++) s[c][i] = ok[i] && active ? col[lane * KPL + i] : 0.f;
    }

    // 1. conv + SiLU of the key head's q and k channels and of this block's v columns, one element
    //    per thread (independent loads, so a thread's iterations overlap), and the gates
#pragma unroll 4
    for (int e = threadIdx.x; e < T * 2 * dk; e += blockDim.x) {  // e = t * 2dk + sl * dk + cc: sqk's layout
        const int t = e / (2 * dk), r = e - t * 2 * dk, sl = r / dk, cc = r - sl * dk;
        sqk[e] = fd_conv_silu(raw, ldr, window, convw, C, KW, t, (sl * H + kh) * dk + cc);
    }
#pragma unroll 2
    for (int e = threadIdx.x; e < T * cols; e += blockDim.x) {
        const int t = e / cols, jj = e - t * cols, j = b * cols + jj;
        if (j < dv) {
            const int ch = 2 * H * dk + h * dv + j;
            const float yv = fd_conv_silu(raw, ldr, window, convw, C, KW, t, ch);
            sv[t * cols + jj] = yv;
            qkvn[(i64)t * C + ch] = yv;
        }
    }
    for (int t = threadIdx.x; t < T; t += blockDim.x) {
        const float bb = ab[(i64)t * ldab + h], a = ab[(i64)t * ldab + HV + h];
        const float gg = neg_a[h] * softplus_f(a + dt_bias[h]);
        const float beta = sigmoid_f(bb);
        sgb[t * 2] = gg;
        sgb[t * 2 + 1] = beta;
        if (b == 0) {
            gb[(i64)t * 2 * HV + h] = gg;
            gb[(i64)t * 2 * HV + HV + h] = beta;
        }
    }
    __syncthreads();
    // 1b. q/k l2 norm, a warp per (lane, q|k): gdn_conv's block_sum regrouped -- the per-warp
    //     butterfly of y^2 over each 32-channel group g (lane l = channel 32g + l, +0 past dk), its
    //     sum kept by lane g, then the butterfly over those (the chain's warps past dk held +0) --
    //     then y / sqrt(ss + 1e-6), x q_scale for q
    for (int it = warp; it < T * 2; it += nwarps) {
        const int t = it >> 1, sl = it & 1;
        float* row = sqk + t * 2 * dk + sl * dk;
        float p = 0.f;
        for (int g = 0; g < nwk; g++) {
            const int cc = g * 32 + lane;
            const float yv = cc < dk ? row[cc] : 0.f;
            const float part = warp_sum(yv * yv);
            if (lane == g) p = part;
        }
        const float ss = warp_sum(p);
        for (int cc = lane; cc < dk; cc += 32) {
            float yv = row[cc];
            yv = yv / sqrtf(ss + 1e-6f);
            if (sl == 0) yv *= q_scale;
            row[cc] = yv;
            if (qk_owner) qkvn[(i64)t * C + (sl * H + kh) * dk + cc] = yv;
        }
    }
    // 1c. commit: this block's v window channels (nobody else reads them) ...
    if (commit) {
        for (int jj = threadIdx.x; jj < cols; jj += blockDim.x) {
            const int j = b * cols + jj;
            if (j < dv) fd_window_slide(window, raw, ldr, C, KW, T, 2 * H * dk + h * dv + j);
        }
    }
    __syncthreads();
    // ... and the key head's q/k channels, by the last of the rep x nb blocks that read them
    if (commit && fd_last_arrival(tickets + kh, rep * nb, &flag)) {
        for (int e = threadIdx.x; e < 2 * dk; e += blockDim.x) {
            const int sl = e / dk, cc = e - sl * dk;
            fd_window_slide(window, raw, ldr, C, KW, T, (sl * H + kh) * dk + cc);
        }
    }

    // 2. the recurrence, per column exactly as gdn_body (NC independent columns per warp)
    if (active) {
        for (int t = 0; t < T; t++) {
            const float* qrow = sqk + t * 2 * dk;
            float q[KPL], k[KPL], v[NC];
            bool vec = false;
            if constexpr (KPL == 4) {  // one 16-byte shared load each instead of a 4-way bank conflict
                vec = (dk & 3) == 0 && ok[0];  // then all four are in range and the rows 16-byte aligned
                if (vec) {
                    const float4 q4 = *reinterpret_cast<const float4*>(qrow + lane * 4);
                    const float4 k4 = *reinterpret_cast<const float4*>(qrow + dk + lane * 4);
                    q[0] = q4.x, q[1] = q4.y, q[2] = q4.z, q[3] = q4.w;
                    k[0] = k4.x, k[1] = k4.y, k[2] = k4.z, k[3] = k4.w;
                }
            }
            if (!vec) {
#pragma unroll
                for (int i = 0; i < KPL; i++) {
                    const int kk = lane * KPL + i;
                    q[i] = ok[i] ? qrow[kk] : 0.f;
                    k[i] = ok[i] ? qrow[dk + kk] : 0.f;
                }
            }
#pragma unroll
            for (int c = 0; c < NC; c++) v[c] = sv[t * cols + warp * NC + c];
            const float decay = expf(sgb[t * 2]), beta = sgb[t * 2 + 1];
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
                for (int c = 0; c < NC; c++) out[(i64)t * ldo + h * dv + jw + c] = pq[c];
            }
        }
        if (commit) {
#pragma unroll
            for (int c = 0; c < NC; c++) {
                float* col = state + (i64)(h * dv + jw + c) * dk;
#pragma unroll
                for (int i = 0; i < KPL; i++)
                    if (ok[i]) col[lane * KPL + i] = s[c][i];
            }
        }
    }

    // 3. gated RMSNorm of head h (gated_rmsnorm: per-warp sums of o^2 over 32-column groups, the
    //    butterfly over the group partials, y = (o / den) * w * silu(z)), by the head's last block
    if (nb > 1) {
        if (!fd_last_arrival(tickets + H + h, nb, &flag)) return;
    } else {
        __syncthreads();  // this block's o columns are all written
    }
    const float* z = raw + C;  // the z rows of in_proj sit after the C conv channels
    for (int t = warp; t < T; t += nwarps) {  // a warp per lane: gated_rmsnorm's block_sum regrouped as in 1b
        const float* orow = out + (i64)t * ldo + h * dv;
        float p = 0.f;
#pragma unroll 4
        for (int g = 0; g < nwv; g++) {
            const int j = g * 32 + lane;
            const float v = j < dv ? __ldcg(orow + j) : 0.f;
            const float part = warp_sum(v * v);
            if (lane == g) p = part;
        }
        const float ss = warp_sum(p);
        const float den = sqrtf(ss / (float)dv + eps);
        if (xq != nullptr) {
            // the out projection's a8 activations as well (kernels.gated_rmsnorm_fuses: dv % 64 == 0, so the head
            // owns whole 64-k chunks): lane holds k = 2 lane, 2 lane + 1 of each chunk, the same y values (an
            // elementwise product, whichever thread forms it), quantized as quant_act8 quantizes y's row. Why: one
            // launch (and its boundary) fewer before each GDN out projection of a decode / verify step.
            for (int c = 0; c < dv / 64; c++) {
                const int j = c * 64 + 2 * lane;
                float2 yv;
                {
                    const float v = __ldcg(orow + j), zz = z[(i64)t * ldr + h * dv + j];
                    yv.x = (v / den) * normw[j] * (zz * sigmoid_f(zz));
                }
                {
                    const float v = __ldcg(orow + j + 1), zz = z[(i64)t * ldr + h * dv + j + 1];
                    yv.y = (v / den) * normw[j + 1] * (zz * sigmoid_f(zz));
                }
                y[(i64)t * ldy + h * dv + j] = yv.x;
                y[(i64)t * ldy + h * dv + j + 1] = yv.y;
                act8_quantize_pair(yv, (h * dv) / 64 + c, xq + (i64)t * ldq, xs + t, lane);
            }
            continue;
        }
        for (int j = lane; j < dv; j += 32) {
            const float v = __ldcg(orow + j);
            const float zz = z[(i64)t * ldr + h * dv + j];
            y[(i64)t * ldy + h * dv + j] = (v / den) * normw[j] * (zz * sigmoid_f(zz));
        }
    }
}

// grid (ceil(dv / (warps * GDN_FD_COLS)), HV), block 32 x warps (<= 32 x GDN_FD_MAX_WARPS),
// dynamic shared memory gdn_fused_shared_floats() x 4 bytes (q27py/gpu/kernels.py).
#define GDN_DECODE_KERNEL(NAME, KPL)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * GDN_FD_MAX_WARPS) NAME(                                       \
        const float* raw, int ldr, float* window, const float* convw, const float* ab, int ldab, const float* neg_a,  \
        const float* dt_bias, int H, int HV, int dk, int dv, int KW, float q_scale, float* qkvn, float* gb,          \
        float* state, float* out, int ldo, const float* normw, float eps, float* y, int ldy, u8* xq, int ldq,         \
        float* xs, int* tickets, int T, int commit) {                                                                 \
        pdl_entry();                                                                                                  \
        gdn_decode_body<KPL>(raw, ldr, window, convw, ab, ldab, neg_a, dt_bias, H, HV, dk, dv, KW, q_scale, qkvn, gb, \
                             state, out, ldo, normw, eps, y, ldy, xq, ldq, xs, tickets, T, commit);                   \
    }

GDN_DECODE_KERNEL(gdn_decode_k1, 1)
GDN_DECODE_KERNEL(gdn_decode_k2, 2)
GDN_DECODE_KERNEL(gdn_decode_k4, 4)

// decode_batch (common.cuh lane table): grid (ceil(dv / (warps * GDN_FD_COLS)), HV, lanes). Lane b is
// its own sequence's one-token committing step (T = 1): its state's window and S (+ win_off /
// state_off bytes: this layer), its rows b of raw / ab / qkvn / gb / out / y and its own tickets
// (h + hv per lane) -- the body exactly as a one-lane launch of that sequence runs it. Bounds: at most
// GDN_FD_LANES_MAX_WARPS warps, one block per SM guaranteed (~96 registers): the lane pointers live in
// registers (the one-sequence entry reads them from its parameters) and spilled at 64.
#define GDN_DECODE_LANES_KERNEL(NAME, KPL)                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * GDN_FD_LANES_MAX_WARPS, 1) NAME(                              \
        const float* raw, int ldr, const i64* lanes, i64 win_off, i64 state_off, const float* convw, const float* ab, \
        int ldab, const float* neg_a, const float* dt_bias, int H, int HV, int dk, int dv, int KW, float q_scale,     \
        float* qkvn, float* gb, float* out, int ldo, const float* normw, float eps, float* y, int ldy, u8* xq,        \
        int ldq, float* xs, int* tickets) {                                                                           \
        pdl_entry();                                                                                                  \
        const int b = blockIdx.z;                                                                                     \
        const i64 C = 2 * H * dk + HV * dv;                                                                           \
        gdn_decode_body<KPL>(raw + (i64)b * ldr, ldr, lane_ptr<float>(lanes, b, LT_WIN, win_off), convw,              \
                             ab + (i64)b * ldab, ldab, neg_a, dt_bias, H, HV, dk, dv, KW, q_scale, qkvn + b * C,      \
                             gb + (i64)b * 2 * HV, lane_ptr<float>(lanes, b, LT_GDN, state_off), out + (i64)b * ldo,  \
                             ldo, normw, eps, y + (i64)b * ldy, ldy, xq ? xq + (i64)b * ldq : nullptr, ldq, xs + b,   \
                             tickets + (i64)b * (H + HV), 1, 1);                                                      \
    }

GDN_DECODE_LANES_KERNEL(gdn_decode_lanes_k1, 1)
GDN_DECODE_LANES_KERNEL(gdn_decode_lanes_k2, 2)
GDN_DECODE_LANES_KERNEL(gdn_decode_lanes_k4, 4)
