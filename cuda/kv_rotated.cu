// Rotated Lloyd-Max KV formats (q27py/model/kvformat.py "k5v3" / "k3v3"): the quantizer, the query /
// output rotations, decode / verify split-K attention reading the codes, and the epilogue of the
// rotated prefill kernel (attention_prefill.cu attn_prefill_k*v3_d*). FastModel stores rows with
// rope.cu's qk_norm_rope_store_rot (query rotated there too); tests/gpu/test_kv_rotated.py checks
// each kernel against the numpy specification.
//
// Row layout (one head vector of d = HD dims): codes in planes -- low plane (2 bits x 4 per byte for
// 3-bit, 4 bits x 2 per byte for 5-bit) then the high-bit plane (8 per byte) -- and a fp16 corrected
// norm s, so value_i = s / sqrt(d) * (R^T c)_i with c_i the centroid of code i and R = H D / sqrt(d).
// Attention never leaves the rotated basis: scores are rot(q) . c * s / sqrt(d), the output is
// sum p * s_v / sqrt(d) * c_v, and one inverse rotation per (lane, head) runs before the gate.
#include "common.cuh"

// NSPLIT, REPMAX and ATT_WARPS (the decode attention's splits, q heads per kv head, warps) come
// from the constants table (-D defines): the partials buffer and the combine kernel share them.

// rot_sign, block_fwht, lm_code(s8) and lm_quantize_block live in common.cuh (the store in rope.cu and
// the prefill tiles in attention_prefill.cu use them too).

// grid n_rows, block d (a power of two, 32..1024). x: rows [n][ldx] fp32 (row r at r * ldx);
// codes [n][d * bits / 8]; norms [n] fp16 bits. centroids: 2^bits floats, edges 2^bits - 1.
// inv_sqrt_d = fp32(1 / sqrt(d)), sqrt_d = fp32(sqrt(d)) (the host's constants, as the spec's).
extern "C" __global__ void lm_quantize_rows(const float* __restrict__ x, int ldx, int d, int bits,
                                            const float* __restrict__ centroids, const float* __restrict__ edges,
                                            float inv_sqrt_d, float sqrt_d, u8* __restrict__ codes,
                                            u16* __restrict__ norms) {
    pdl_entry();
    extern __shared__ float xs[];  // d floats, then d bytes of codes
    __shared__ float red[32];
    const int r = blockIdx.x;
    lm_quantize_block(x[(i64)r * ldx + threadIdx.x], d, bits, centroids, edges, inv_sqrt_d, sqrt_d, xs,
                      reinterpret_cast<u8*>(xs + d), red, codes + (i64)r * (d * bits / 8), norms + r);
}

// grid (rows, heads), block d: x[row][h*d ..] <- R x (forward: H D / sqrt(d)) or R^T x (inverse:
// D H / sqrt(d)), in place. The query is rotated before attention; the output after.
extern "C" __global__ void rotate_heads(float* __restrict__ x, int ldx, int d, int inverse, float inv_sqrt_d) {
    pdl_entry();
    extern __shared__ float xs[];
    const int r = blockIdx.x, h = blockIdx.y, i = threadIdx.x;
    float* p = x + (i64)r * ldx + (i64)h * d;
    xs[i] = inverse ? p[i] : p[i] * rot_sign(i);
    block_fwht(xs, d);
    const float y = xs[i] * inv_sqrt_d;
    p[i] = inverse ? y * rot_sign(i) : y;
}

// Split-K attention over rotated codes, as attention.cu's attn_split_body: grid (nkv, NSPLIT,
// nlanes), block 256, smem ATT_WARPS * rep * (HD + 2) floats; q already rotated; partials in the
// rotated basis (attn_combine_rotated finishes). kc / vc rows: [nkv][max_pos][row bytes], kn / vn
// fp16 norms [nkv][max_pos]; ck / cv: the K and V codebooks (2^kbits, 2^vbits floats).
template <int DPL>
__device__ __forceinline__ void rq_split_body(const float* __restrict__ q, int ldq, const u8* __restrict__ kc,
                                              const u8* __restrict__ vc, const u16* __restrict__ kn,
                                              const u16* __restrict__ vn, int kbits, int vbits,
                                              const float* __restrict__ ck, const float* __restrict__ cvb,
                                              int max_pos, int nq, int nkv, float scale, float inv_sqrt_d,
                                              const int* __restrict__ pos0_dev, int span, float* __restrict__ part) {
    extern __shared__ float sm[];
    constexpr int HD = 32 * DPL;
    const int g = blockIdx.x, sp = blockIdx.y, t = blockIdx.z;
    const int pos0 = *pos0_dev, len = pos0 + t + 1;
    const int need = (pos0 + span + NSPLIT - 1) / NSPLIT;
    const int ssz = max(64, (need + 63) / 64 * 64);  // attention.cu's split_size
    const int start = sp * ssz;
    if (start >= len) return;
    const int end = min(start + ssz, len);
    const int rep = nq / nkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kb = HD * kbits / 8, vb = HD * vbits / 8;

    float qv[REPMAX][DPL], acc[REPMAX][DPL], m[REPMAX], l[REPMAX];
#pragma unroll
    for (int j = 0; j < REPMAX; j++) {
        m[j] = -INFINITY;
        l[j] = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            acc[j][i] = 0.f;
            qv[j][i] = j < rep ? q[(i64)t * ldq + (g * rep + j) * HD + lane * DPL + i] : 0.f;
        }
    }
    for (int p = start + warp; p < end; p += ATT_WARPS) {
        const i64 row = (i64)g * max_pos + p;
        const u8* kr = kc + row * kb;
        const u8* vr = vc + row * vb;
        float kv[DPL], vv[DPL];
        if constexpr (DPL == 8) {  // head dim 256: one low-plane word + one high-plane byte per row
            u32 c[8];
            lm_codes8(kr, lane * 8, HD, kbits, c);
#pragma unroll
            for (int i = 0; i < 8; i++) kv[i] = ck[c[i]];
            lm_codes8(vr, lane * 8, HD, vbits, c);
#pragma unroll
            for (int i = 0; i < 8; i++) vv[i] = cvb[c[i]];
        } else {
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                kv[i] = ck[lm_code(kr, lane * DPL + i, HD, kbits)];
                vv[i] = cvb[lm_code(vr, lane * DPL + i, HD, vbits)];
            }
        }
        const float ks = half_to_float(kn[row]) * inv_sqrt_d, vs = half_to_float(vn[row]) * inv_sqrt_d;
#pragma unroll
        for (int j = 0; j < REPMAX; j++) {
            if (j >= rep) break;
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < DPL; i++) dot = fmaf(qv[j][i], kv[i], dot);
            const float sc = warp_sum(dot) * ks * scale;
            const float mn = fmaxf(m[j], sc);
            const float corr = expf(m[j] - mn);
            const float pj = expf(sc - mn);
            l[j] = l[j] * corr + pj;
            const float pv = pj * vs;
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[j][i] = fmaf(pv, vv[i], acc[j][i] * corr);
            m[j] = mn;
        }
    }
    float* wsm = sm + warp * rep * (HD + 2);
#pragma unroll
    for (int j = 0; j < REPMAX; j++) {
        if (j >= rep) break;
#pragma unroll
        for (int i = 0; i < DPL; i++) wsm[j * (HD + 2) + 2 + lane * DPL + i] = acc[j][i];
        if (lane == 0) {
            wsm[j * (HD + 2)] = m[j];
            wsm[j * (HD + 2) + 1] = l[j];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < rep * HD; idx += blockDim.x) {
        const int j = idx / HD, dd = idx - j * HD;
        float M = -INFINITY;
        for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, sm[(w * rep + j) * (HD + 2)]);
        float L = 0.f, A = 0.f;
        for (int w = 0; w < ATT_WARPS; w++) {
            const float* b = sm + (w * rep + j) * (HD + 2);
            const float e = expf(b[0] - M);
            L = fmaf(b[1], e, L);
            A = fmaf(b[2 + dd], e, A);
        }
        float* dst = part + ((i64)(t * nq + g * rep + j) * NSPLIT + sp) * (HD + 2);
        dst[2 + dd] = A;
        if (dd == 0) {
            dst[0] = M;
            dst[1] = L;
        }
    }
}

#define RQ_KERNEL(NAME, DPL)                                                                                         \
    extern "C" __global__ void __launch_bounds__(256)                                                               \
        NAME(const float* q, int ldq, const u8* kc, const u8* vc, const u16* kn, const u16* vn, int kbits,          \
             int vbits, const float* ck, const float* cvb, int max_pos, int nq, int nkv, float scale,               \
             float inv_sqrt_d, const int* pos0_dev, int span, float* part) {                                        \
        pdl_entry();                                                                                                \
        rq_split_body<DPL>(q, ldq, kc, vc, kn, vn, kbits, vbits, ck, cvb, max_pos, nq, nkv, scale, inv_sqrt_d,      \
                           pos0_dev, span, part);                                                                   \
    }

RQ_KERNEL(attn_split_rot_d1, 1)
RQ_KERNEL(attn_split_rot_d2, 2)
RQ_KERNEL(attn_split_rot_d4, 4)
RQ_KERNEL(attn_split_rot_d8, 8)

// grid (nlanes, nq), block hd (a power of two): merge the splits (attention.cu's attn_combine), rotate
// the head's output back (R^T), then the sigmoid gate (which does not commute with the rotation).
extern "C" __global__ void attn_combine_rotated(const float* __restrict__ part, int nq, int hd,
                                                const int* __restrict__ pos0_dev, int span,
                                                const float* __restrict__ qg, int ldq, float inv_sqrt_d,
                                                float* __restrict__ out, int ldo) {
    pdl_entry();
    extern __shared__ float xs[];
    const int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    const int pos0 = *pos0_dev, len = pos0 + t + 1;
    const int need = (pos0 + span + NSPLIT - 1) / NSPLIT;
    const int ssz = max(64, (need + 63) / 64 * 64);
    const int ns = (len + ssz - 1) / ssz;
    xs[d] = split_merge(part + (i64)(t * nq + h) * NSPLIT * (hd + 2), ns, hd, d);
    block_fwht(xs, hd);
    const float y = xs[d] * inv_sqrt_d * rot_sign(d);
    const float gate = qg[(i64)t * ldq + h * 2 * hd + hd + d];
    out[(i64)t * ldo + h * hd + d] = y * sigmoid_f(gate);
}

// grid (nlanes, nq), block hd (a power of two): the rotated prefill kernel's epilogue. out[t][h*hd ..]
// holds the head's attention output in the rotated basis (ungated); rotate it back (R^T) and apply
// the sigmoid gate, in place -- attn_combine_rotated's tail, so prefill and decode finish alike.
extern "C" __global__ void unrotate_gate(float* __restrict__ out, int ldo, const float* __restrict__ qg, int ldq,
                                         int hd, float inv_sqrt_d) {
    pdl_entry();
    extern __shared__ float xs[];
    const int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    float* p = out + (i64)t * ldo + (i64)h * hd;
    xs[d] = p[d];
    block_fwht(xs, hd);
    const float y = xs[d] * inv_sqrt_d * rot_sign(d);
    p[d] = y * sigmoid_f(qg[(i64)t * ldq + h * 2 * hd + hd + d]);
}
