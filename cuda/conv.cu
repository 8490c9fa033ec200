// Gated DeltaNet front end: causal depthwise conv1d + SiLU + per-head l2norm of q and k,
// and the decay/beta gates, for W lanes (tokens) at once; plus the conv-window commit.
//
// Lane t's conv taps are [window (K-1 committed raw rows), raw rows of lanes 0..t]: lanes
// never write the window, so a verify round leaves committed state untouched, and the
// commit (gdn_conv_commit) later slides the window by the n accepted raw rows. Raw rows are
// the in_proj_qkv outputs, kept per layer until the commit.
#include "common.cuh"

// grid (nlanes, 2H + HV [, layers]), block >= max(dk, dv) rounded to 32.
// slot < H: q head; slot < 2H: k head; else v head (also computes g and beta of that head).
extern "C" __global__ void gdn_conv(const float* __restrict__ raw, int ldr,  // lane t raw row: raw + t*ldr, C channels
                                    const float* __restrict__ window,       // [K-1, C], oldest first
                                    const float* __restrict__ convw,        // [C, K]
                                    const float* __restrict__ ab, int ldab,  // lane t: b [HV] then a [HV]
                                    const float* __restrict__ neg_a, const float* __restrict__ dt_bias, int H, int HV,
                                    int dk, int dv, int KW, float q_scale, float* __restrict__ qkvn,  // [lane][C]
                                    float* __restrict__ gb)                                              // [lane][2HV]
{
    pdl_entry();
    __shared__ float red[32];
    const int t = blockIdx.x, slot = blockIdx.y, c = threadIdx.x;
    const int C = 2 * H * dk + HV * dv;
    const bool is_qk = slot < 2 * H;
    const int d = is_qk ? dk : dv;
    const int ch = is_qk ? slot * dk + c : 2 * H * dk + (slot - 2 * H) * dv + c;
    float y = 0.f;
    if (c < d) {
        float acc = 0.f;
        for (int j = 0; j < KW; j++) {
            const int idx = t + j;  // position in [window ; raw rows]
            const float xv = idx < KW - 1 ? window[(i64)idx * C + ch] : raw[(i64)(idx - (KW - 1)) * ldr + ch];
            acc = __fadd_rn(acc, __fmul_rn(convw[(i64)ch * KW + j], xv));
        }
        y = acc * sigmoid_f(acc);
    }
    if (is_qk) {
        const float ss = block_sum(y * y, red);
        y = y / sqrtf(ss + 1e-6f);
        if (slot < H) y *= q_scale;
    }
    if (c < d) qkvn[(i64)t * C + ch] = y;
    if (!is_qk && c == 0) {
        const int h = slot - 2 * H;
        const float b = ab[(i64)t * ldab + h], a = ab[(i64)t * ldab + HV + h];
        gb[(i64)t * 2 * HV + h] = neg_a[h] * softplus_f(a + dt_bias[h]);
        gb[(i64)t * 2 * HV + HV + h] = sigmoid_f(b);
    }
}

// Slide the window of every layer by n accepted raw rows (n from the device when n_dev is
// given, so the launch can be captured once). grid (ceil(C/256), layers), block 256.
extern "C" __global__ void gdn_conv_commit(float* __restrict__ window, i64 window_layer_stride,
                                           const float* __restrict__ raw, int ldr, i64 raw_layer_stride, int C, int KW,
                                           const int* __restrict__ n_dev, int n_const) {
    pdl_entry();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C) return;
    const int n = n_dev ? *n_dev : n_const;
    float* win = window + blockIdx.y * window_layer_stride;
    const float* rw = raw + blockIdx.y * raw_layer_stride;
    float keep[8];
    for (int i = 0; i < KW - 1 && i < 8; i++) {
        const int idx = n + i;  // in [window ; raw rows 0..n-1]
        keep[i] = idx < KW - 1 ? win[(i64)idx * C + ch] : rw[(i64)(idx - (KW - 1)) * ldr + ch];
    }
    for (int i = 0; i < KW - 1 && i < 8; i++) win[(i64)i * C + ch] = keep[i];
}
