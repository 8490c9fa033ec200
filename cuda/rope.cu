// Attention front end, per (lane, head): q/k RMSNorm (zero-centred weight), partial
// rotate-half RoPE on the first rd dims at absolute position pos0 + lane, and the K/V
// store into the cache (fp32, bf16, fp8 e4m3 or rotated Lloyd-Max codes). q goes to a per-lane
// buffer for the attention kernel.
#include "common.cuh"

// grid (nlanes, nq + nkv), block = hd rounded up to 32 (<= 1024).
// qg: lane t row = [head0 q (hd) | head0 gate (hd) | head1 q | ...]; kv: lane t row = [k (nkv*hd) | v (nkv*hd)].
// Cache layout [nkv][max_pos][hd]. inv_freq: fp64 [rd/2] (computed on the host like the reference).
// The body of both entries below: row t of qg / kv / qout, K / V row `pos` of the caches given (one layer's).
__device__ __forceinline__ void rope_store_body(const float* __restrict__ qg, int ldq, const float* __restrict__ kv,
                                                int ldkv, const float* __restrict__ q_norm,
                                                const float* __restrict__ k_norm, float eps, int nq, int nkv, int hd,
                                                int rd, const double* __restrict__ inv_freq, int t, int pos,
                                                float* __restrict__ qout, int ldqo, void* kcache, void* vcache,
                                                int kv_bf16, int max_pos) {
    extern __shared__ float xs[];  // hd floats
    __shared__ float red[32];
    const int slot = blockIdx.y, d = threadIdx.x;
    const bool is_q = slot < nq;
    const int kvh = slot - nq;
    const bool live = d < hd;
    const float x = !live ? 0.f : is_q ? qg[(i64)t * ldq + slot * 2 * hd + d] : kv[(i64)t * ldkv + kvh * hd + d];
    const float ss = block_sum(x * x, red);
    const float* w = is_q ? q_norm : k_norm;
    const float xn = live ? (x / sqrtf(ss / (float)hd + eps)) * (w[d] + 1.0f) : 0.f;
    if (live) xs[d] = xn;
    __syncthreads();
    if (!live) return;
    float y = xn;
    if (d < rd) {
        const int half = rd >> 1;
        const int jf = d < half ? d : d - half;
        const float ang = (float)((double)pos * inv_freq[jf]);
        const float c = cosf(ang), s = sinf(ang);
        const float rot = d < half ? -xs[d + half] : xs[d - half];
        y = fmaf(xn, c, rot * s);  // the contraction NVVM chose for xn * c + rot * s, spelled out (the rows form's too)
    }
    if (is_q) {
        qout[(i64)t * ldqo + slot * hd + d] = y;
    } else {
        const i64 off = ((i64)kvh * max_pos + pos) * hd + d;
        const float v = kv[(i64)t * ldkv + nkv * hd + kvh * hd + d];
        if (kv_bf16) {
            reinterpret_cast<u16*>(kcache)[off] = float_to_bf16(y);
            reinterpret_cast<u16*>(vcache)[off] = float_to_bf16(v);
        } else {
            reinterpret_cast<float*>(kcache)[off] = y;
            reinterpret_cast<float*>(vcache)[off] = v;
        }
    }
}

// One sequence: lane t at position *pos0_dev + t; caches [nkv][max_pos][hd] of one layer.
extern "C" __global__ void qk_norm_rope_store(const float* __restrict__ qg, int ldq, const float* __restrict__ kv, int ldkv,
                                              const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                              float eps, int nq, int nkv, int hd, int rd,
                                              const double* __restrict__ inv_freq, const int* __restrict__ pos0_dev,
                                              float* __restrict__ qout, int ldqo, void* kcache, void* vcache, int kv_bf16,
                                              int max_pos) {
    pdl_entry();
    const int t = blockIdx.x;
    rope_store_body(qg, ldq, kv, ldkv, q_norm, k_norm, eps, nq, nkv, hd, rd, inv_freq, t, *pos0_dev + t, qout, ldqo,
                    kcache, vcache, kv_bf16, max_pos);
}

// qk_norm_rope_store for prefill chunks: a warp per (token, head) instead of a block of hd threads. Why: the block
// form is (nlanes x (nq + nkv)) blocks of 256 threads, each one load, two barriers and one store per thread --
// 229K blocks for a 4,096-token chunk of the 27B, 7.0 ms of an 8K prefill (device run q1, H100) for ~0.5 GB of
// bytes a layer. Same bits as the block form: lane l holds dims l + 32 j (what warp j's lane l holds there), so
// warp_sum of its squares per j is that warp's sum, and the warp_sum of those sums (lane j < DPL holding sum j,
// the rest 0) is block_sum's last step; the norm, angle and rotation are the block form's expressions. The
// rotation partner of dim d < rd is d +- rd / 2, in the same lane when rd / 2 is a multiple of 32
// (kernels.rope_rows_fits). grid (nlanes, ceil((nq + nkv) / 4)), block 128 (4 heads of one token).
template <int DPL>
__device__ __forceinline__ void rope_store_warp(const float* __restrict__ qg, int ldq, const float* __restrict__ kv,
                                                int ldkv, const float* __restrict__ q_norm,
                                                const float* __restrict__ k_norm, float eps, int nq, int nkv, int rd,
                                                const double* __restrict__ inv_freq, int t, int pos, int slot,
                                                float* __restrict__ qout, int ldqo, void* kcache, void* vcache,
                                                int kv_bf16, int max_pos) {
    constexpr int hd = 32 * DPL;
    const int lane = threadIdx.x & 31;
    const bool is_q = slot < nq;
    const int kvh = slot - nq;
    const float* src = is_q ? qg + (i64)t * ldq + slot * 2 * hd : kv + (i64)t * ldkv + kvh * hd;
    float x[DPL];
#pragma unroll
    for (int j = 0; j < DPL; j++) x[j] = src[32 * j + lane];
    float tl = 0.f;
#pragma unroll
    for (int j = 0; j < DPL; j++) {
        const float sj = warp_sum(x[j] * x[j]);  // block_sum: warp j's sum
        if (lane == j) tl = sj;
    }
    const float ss = warp_sum(tl);  // block_sum: the warp sums, lanes past the warps adding 0
    const float* w = is_q ? q_norm : k_norm;
    float xn[DPL];
#pragma unroll
    for (int j = 0; j < DPL; j++) xn[j] = (x[j] / sqrtf(ss / (float)hd + eps)) * (w[32 * j + lane] + 1.0f);
    const int half = rd >> 1, hj = half >> 5;  // the partner of dim d < rd is 32 (j +- hj) + lane
    float c = 0.f, s = 0.f;
    if (lane < half) {
        const float ang = (float)((double)pos * inv_freq[lane]);  // jf of dims lane + 32 j < rd: (32 j + lane) % half
        c = cosf(ang), s = sinf(ang);
    }
    float y[DPL];
#pragma unroll
    for (int j = 0; j < DPL; j++) {
        y[j] = xn[j];
        if (32 * j < rd) {
            const int jf = (32 * j) % half + lane;  // dims of one lane share jf mod 32: recomputed where half > 32
            float cj = c, sj2 = s;
            if (half > 32) {
                const float ang = (float)((double)pos * inv_freq[jf]);
                cj = cosf(ang), sj2 = sinf(ang);
            }
            const float rot = j < hj ? -xn[j + hj < DPL ? j + hj : 0] : xn[j >= hj ? j - hj : 0];
            y[j] = fmaf(xn[j], cj, rot * sj2);  // rope_store_body's expression and contraction
        }
    }
    if (is_q) {
        float* qo = qout + (i64)t * ldqo + slot * hd;
#pragma unroll
        for (int j = 0; j < DPL; j++) qo[32 * j + lane] = y[j];
        return;
    }
    const i64 off = ((i64)kvh * max_pos + pos) * hd;
    const float* vr = kv + (i64)t * ldkv + nkv * hd + kvh * hd;
#pragma unroll
    for (int j = 0; j < DPL; j++) {
        const int d = 32 * j + lane;
        const float v = vr[d];
        if (kv_bf16) {
            reinterpret_cast<u16*>(kcache)[off + d] = float_to_bf16(y[j]);
            reinterpret_cast<u16*>(vcache)[off + d] = float_to_bf16(v);
        } else {
            reinterpret_cast<float*>(kcache)[off + d] = y[j];
            reinterpret_cast<float*>(vcache)[off + d] = v;
        }
    }
}

#define ROPE_ROWS_KERNEL(NAME, DPL)                                                                                   \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                           \
        const float* __restrict__ qg, int ldq, const float* __restrict__ kv, int ldkv,                                \
        const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps, int nq, int nkv, int rd,       \
        const double* __restrict__ inv_freq, const int* __restrict__ pos0_dev, float* __restrict__ qout, int ldqo,    \
        void* kcache, void* vcache, int kv_bf16, int max_pos) {                                                       \
        pdl_entry();                                                                                                  \
        const int t = blockIdx.x, slot = blockIdx.y * 4 + (threadIdx.x >> 5);                                         \
        if (slot >= nq + nkv) return;                                                                                 \
        rope_store_warp<DPL>(qg, ldq, kv, ldkv, q_norm, k_norm, eps, nq, nkv, rd, inv_freq, t, *pos0_dev + t, slot,   \
                             qout, ldqo, kcache, vcache, kv_bf16, max_pos);                                           \
    }
ROPE_ROWS_KERNEL(qk_norm_rope_store_rows_d2, 2)
ROPE_ROWS_KERNEL(qk_norm_rope_store_rows_d4, 4)
ROPE_ROWS_KERNEL(qk_norm_rope_store_rows_d8, 8)

// decode_batch: lane b is its own sequence's next token (common.cuh lane table): its position and
// its state's K / V caches, plus kv_off bytes to this layer. Same grid and block as above.
extern "C" __global__ void qk_norm_rope_store_lanes(const float* __restrict__ qg, int ldq, const float* __restrict__ kv,
                                                    int ldkv, const float* __restrict__ q_norm,
                                                    const float* __restrict__ k_norm, float eps, int nq, int nkv,
                                                    int hd, int rd, const double* __restrict__ inv_freq,
                                                    const i64* __restrict__ lanes, i64 kv_off,
                                                    float* __restrict__ qout, int ldqo, int kv_bf16, int max_pos) {
    pdl_entry();
    const int b = blockIdx.x;
    rope_store_body(qg, ldq, kv, ldkv, q_norm, k_norm, eps, nq, nkv, hd, rd, inv_freq, b, lane_positions(lanes)[b],
                    qout, ldqo, lane_ptr<void>(lanes, b, LT_K, kv_off), lane_ptr<void>(lanes, b, LT_V, kv_off), kv_bf16,
                    max_pos);
}

// The same front end storing fp8 e4m3 KV (q27py/model/kvformat.py "fp8"): codes [nkv][max_pos][hd]
// (u8) and one int8 exponent per (kv head, position) in kexp / vexp [nkv][max_pos], so the row's
// absolute max lands in [128, 256) and value = e4m3(code) * 2^e. Same grid and block as above;
// no thread leaves before the row max reductions.
__device__ __forceinline__ void rope_store_fp8_body(const float* __restrict__ qg, int ldq, const float* __restrict__ kv,
                                                    int ldkv, const float* __restrict__ q_norm,
                                                    const float* __restrict__ k_norm, float eps, int nq, int nkv,
                                                    int hd, int rd, const double* __restrict__ inv_freq, int t, int pos,
                                                    float* __restrict__ qout, int ldqo, u8* __restrict__ kcache,
                                                    u8* __restrict__ vcache, signed char* __restrict__ kexp,
                                                    signed char* __restrict__ vexp, int max_pos) {
    extern __shared__ float xs[];  // hd floats
    __shared__ float red[32];
    const int slot = blockIdx.y, d = threadIdx.x;
    const bool is_q = slot < nq;
    const int kvh = slot - nq;
    const bool live = d < hd;
    const float x = !live ? 0.f : is_q ? qg[(i64)t * ldq + slot * 2 * hd + d] : kv[(i64)t * ldkv + kvh * hd + d];
    const float ss = block_sum(x * x, red);
    const float* w = is_q ? q_norm : k_norm;
    const float xn = live ? (x / sqrtf(ss / (float)hd + eps)) * (w[d] + 1.0f) : 0.f;
    if (live) xs[d] = xn;
    __syncthreads();
    float y = xn;
    if (live && d < rd) {
        const int half = rd >> 1;
        const int jf = d < half ? d : d - half;
        const float ang = (float)((double)pos * inv_freq[jf]);
        const float c = cosf(ang), s = sinf(ang);
        const float rot = d < half ? -xs[d + half] : xs[d - half];
        y = xn * c + rot * s;
    }
    if (is_q) {
        if (live) qout[(i64)t * ldqo + slot * hd + d] = y;
        return;  // the whole block is a q head: uniform exit
    }
    const float v = live ? kv[(i64)t * ldkv + nkv * hd + kvh * hd + d] : 0.f;
    const int ek = fp8_row_exponent(block_max(live ? fabsf(y) : 0.f, red));
    const int ev = fp8_row_exponent(block_max(live ? fabsf(v) : 0.f, red));
    if (!live) return;
    const i64 row = (i64)kvh * max_pos + pos;
    kcache[row * hd + d] = float_to_e4m3(y * exp2_int(-ek));  // a power of two: exact
    vcache[row * hd + d] = float_to_e4m3(v * exp2_int(-ev));
    if (d == 0) {
        kexp[row] = (signed char)ek;
        vexp[row] = (signed char)ev;
    }
}

extern "C" __global__ void qk_norm_rope_store_fp8(const float* __restrict__ qg, int ldq, const float* __restrict__ kv,
                                                  int ldkv, const float* __restrict__ q_norm,
                                                  const float* __restrict__ k_norm, float eps, int nq, int nkv, int hd,
                                                  int rd, const double* __restrict__ inv_freq,
                                                  const int* __restrict__ pos0_dev, float* __restrict__ qout, int ldqo,
                                                  u8* __restrict__ kcache, u8* __restrict__ vcache,
                                                  signed char* __restrict__ kexp, signed char* __restrict__ vexp,
                                                  int max_pos) {
    pdl_entry();
    const int t = blockIdx.x;
    rope_store_fp8_body(qg, ldq, kv, ldkv, q_norm, k_norm, eps, nq, nkv, hd, rd, inv_freq, t, *pos0_dev + t, qout, ldqo,
                        kcache, vcache, kexp, vexp, max_pos);
}

// decode_batch (see qk_norm_rope_store_lanes): codes at kv_off bytes into the lane's K / V, exponents
// at x_off bytes into its exponent arrays.
extern "C" __global__ void qk_norm_rope_store_fp8_lanes(const float* __restrict__ qg, int ldq,
                                                        const float* __restrict__ kv, int ldkv,
                                                        const float* __restrict__ q_norm,
                                                        const float* __restrict__ k_norm, float eps, int nq, int nkv,
                                                        int hd, int rd, const double* __restrict__ inv_freq,
                                                        const i64* __restrict__ lanes, i64 kv_off, i64 x_off,
                                                        float* __restrict__ qout, int ldqo, int max_pos) {
    pdl_entry();
    const int b = blockIdx.x;
    rope_store_fp8_body(qg, ldq, kv, ldkv, q_norm, k_norm, eps, nq, nkv, hd, rd, inv_freq, b,
                        lane_positions(lanes)[b], qout, ldqo, lane_ptr<u8>(lanes, b, LT_K, kv_off),
                        lane_ptr<u8>(lanes, b, LT_V, kv_off), lane_ptr<signed char>(lanes, b, LT_KX, x_off),
                        lane_ptr<signed char>(lanes, b, LT_VX, x_off), max_pos);
}

// The same front end storing rotated Lloyd-Max KV (kvformat "k5v3" / "k3v3"): K after q/k norm and
// RoPE, V as projected (the reference's order), each quantized by lm_quantize_block into codes
// kc [nkv][max_pos][hd * kbits / 8], vc [nkv][max_pos][hd * vbits / 8] and fp16 corrected norms
// kn / vn [nkv][max_pos]. The query goes out rotated (R q, rotate_heads' bits): the attention kernels
// score it against the codes in the rotated basis. grid (nlanes, nq + nkv), block hd (a power of
// two, 32..1024: every thread is live), dynamic smem 5 * hd bytes. ck / ek, cv / ev: the K and V
// codebooks' centroids and edges (kvformat.CODEBOOKS / codebook_edges).
extern "C" __global__ void qk_norm_rope_store_rot(const float* __restrict__ qg, int ldq, const float* __restrict__ kv,
                                                  int ldkv, const float* __restrict__ q_norm,
                                                  const float* __restrict__ k_norm, float eps, int nq, int nkv, int hd,
                                                  int rd, const double* __restrict__ inv_freq,
                                                  const int* __restrict__ pos0_dev, float* __restrict__ qout, int ldqo,
                                                  u8* __restrict__ kc, u8* __restrict__ vc, u16* __restrict__ kn,
                                                  u16* __restrict__ vn, int kbits, int vbits,
                                                  const float* __restrict__ ck, const float* __restrict__ ek,
                                                  const float* __restrict__ cv, const float* __restrict__ ev,
                                                  float inv_sqrt_d, float sqrt_d, int max_pos) {
    pdl_entry();
    extern __shared__ float xs[];  // hd floats, then hd bytes of codes
    __shared__ float red[32];
    const int t = blockIdx.x, slot = blockIdx.y, d = threadIdx.x;
    const bool is_q = slot < nq;
    const int kvh = slot - nq;
    const float x = is_q ? qg[(i64)t * ldq + slot * 2 * hd + d] : kv[(i64)t * ldkv + kvh * hd + d];
    const float ss = block_sum(x * x, red);
    const float* w = is_q ? q_norm : k_norm;
    const float xn = (x / sqrtf(ss / (float)hd + eps)) * (w[d] + 1.0f);
    xs[d] = xn;
    __syncthreads();
    const int pos = *pos0_dev + t;
    float y = xn;
    if (d < rd) {
        const int half = rd >> 1;
        const int jf = d < half ? d : d - half;
        const float ang = (float)((double)pos * inv_freq[jf]);
        const float c = cosf(ang), s = sinf(ang);
        const float rot = d < half ? -xs[d + half] : xs[d - half];
        y = xn * c + rot * s;
    }
    if (is_q) {  // the whole block is a q head: uniform branch
        __syncthreads();  // RoPE's reads of xs are done
        xs[d] = y * rot_sign(d);
        block_fwht(xs, hd);
        qout[(i64)t * ldqo + slot * hd + d] = xs[d] * inv_sqrt_d;
        return;
    }
    const float v = kv[(i64)t * ldkv + nkv * hd + kvh * hd + d];
    const i64 row = (i64)kvh * max_pos + pos;
    u8* cs = reinterpret_cast<u8*>(xs + hd);
    lm_quantize_block(y, hd, kbits, ck, ek, inv_sqrt_d, sqrt_d, xs, cs, red, kc + row * (hd * kbits / 8), kn + row);
    lm_quantize_block(v, hd, vbits, cv, ev, inv_sqrt_d, sqrt_d, xs, cs, red, vc + row * (hd * vbits / 8), vn + row);
}

// Test probe for the e4m3 conversions (tests/gpu/test_kv_fp8.py): out[i] = code of x[i], and
// back[i] = decode(code) / 256 through the two-code path the attention kernel uses.
extern "C" __global__ void fp8_convert_probe(const float* __restrict__ x, u8* __restrict__ out, float* __restrict__ back,
                                             int n) {
    pdl_entry();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (2 * i >= n) return;
    const u8 a = float_to_e4m3(x[2 * i]);
    const u8 b = 2 * i + 1 < n ? float_to_e4m3(x[2 * i + 1]) : (u8)0;
    out[2 * i] = a;
    if (2 * i + 1 < n) out[2 * i + 1] = b;
    float lo, hi;
    e4m3x2_to_float_div256((u32)a | ((u32)b << 8), lo, hi);
    back[2 * i] = lo;
    if (2 * i + 1 < n) back[2 * i + 1] = hi;
}
