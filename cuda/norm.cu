// RMSNorm variants. Sums of squares use a fixed block-reduction order (bitwise repeatable).
#include "common.cuh"

// y = x / sqrt(mean(x^2) + eps) * (w + add_one)   per row; add_one = 1 for the zero-centred
// Qwen norms (input/post-attention/final/MTP), 0 for a plain weight.
// grid (rows), block 256..1024. A thread keeps its (up to 8) elements in registers between
// the two passes, so the row is read once and every load is issued before the first use.
// ys (optional, shared): the normed row is also kept there (the a8 variant quantizes from it).
// The norm weights are constants: a kernel loads this thread's (w + add_one) into registers
// before its PDL wait, so a norm launched early beside the GEMV before it (programmatic dependent
// launch) has them when that GEMV's output lands, and its critical path is the row alone. Same
// fp32 sum as before, so the same bits.
__device__ __forceinline__ void norm_weights_preload(const float* __restrict__ w, float add_one, int H,
                                                     float (&wv)[NORM_PER_THREAD]) {
#pragma unroll
    for (int i = 0; i < NORM_PER_THREAD; i++) {
        const int k = threadIdx.x + i * blockDim.x;
        wv[i] = k < H ? w[k] + add_one : 0.f;
    }
}
// gated norms: one weight per thread (a value column of the head)
__device__ __forceinline__ float gated_weight_preload(const float* __restrict__ w, int dv) {
    return (int)threadIdx.x < dv ? w[threadIdx.x] : 0.f;
}

__device__ __forceinline__ void rmsnorm_row(const float* __restrict__ x, int ldx, const float* __restrict__ w,
                                            const float (&wv)[NORM_PER_THREAD], float add_one, float eps, int H,
                                            float* __restrict__ y, int ldy, float* red, float* ys = nullptr) {
    const float* xr = x + (i64)blockIdx.x * ldx;
    float v[NORM_PER_THREAD];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < NORM_PER_THREAD; i++) {
        const int k = threadIdx.x + i * blockDim.x;
        v[i] = k < H ? xr[k] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < NORM_PER_THREAD; i++) ss = fmaf(v[i], v[i], ss);
    for (int k = threadIdx.x + NORM_PER_THREAD * blockDim.x; k < H; k += blockDim.x) ss = fmaf(xr[k], xr[k], ss);
    ss = block_sum(ss, red);
    const float den = sqrtf(ss / (float)H + eps);
    float* yr = y + (i64)blockIdx.x * ldy;
#pragma unroll
    for (int i = 0; i < NORM_PER_THREAD; i++) {
        const int k = threadIdx.x + i * blockDim.x;
        if (k < H) {
            const float o = (v[i] / den) * wv[i];
            yr[k] = o;
            if (ys) ys[k] = o;
        }
    }
    for (int k = threadIdx.x + NORM_PER_THREAD * blockDim.x; k < H; k += blockDim.x) {
        const float o = (xr[k] / den) * (w[k] + add_one);
        yr[k] = o;
        if (ys) ys[k] = o;
    }
}

extern "C" __global__ void rmsnorm_rows(const float* __restrict__ x, int ldx, const float* __restrict__ w, float add_one,
                                        float eps, int H, float* __restrict__ y, int ldy) {
    float wv[NORM_PER_THREAD];
    norm_weights_preload(w, add_one, H, wv);
    pdl_entry();
    __shared__ float red[32];
    rmsnorm_row(x, ldx, w, wv, add_one, eps, H, y, ldy, red);
}

// rmsnorm_rows, then the row's a8 GEMV input (act8_quantize_chunk over its kch chunks, from the
// fp32 row just written: the same bytes quant_act8 would make). Why: one launch instead of two
// before each a8 GEMV that reads a normed row (the layers' input and MLP norms).
// The chunks quantize from a shared copy of the normed row when it fits (NORM_A8_MAX_K): reading
// the row back from global memory was one more L2 round trip on this one-CTA-per-lane kernel's
// critical path. Same values, same bytes.
extern "C" __global__ void rmsnorm_rows_a8(const float* __restrict__ x, int ldx, const float* __restrict__ w,
                                           float add_one, float eps, int H, float* __restrict__ y, int ldy, int kch,
                                           u8* __restrict__ xq, int ldq, float* __restrict__ xs) {
    float wv[NORM_PER_THREAD];
    norm_weights_preload(w, add_one, H, wv);
    pdl_entry();
    __shared__ float red[32];
    __shared__ __align__(16) float ys[NORM_A8_MAX_K];
    const bool staged = kch * 64 <= NORM_A8_MAX_K;
    rmsnorm_row(x, ldx, w, wv, add_one, eps, H, y, ldy, red, staged ? ys : nullptr);
    if (staged)  // the padded tail of the last chunk reads as zero, as the fp32 rows' pads do
        for (int k = H + threadIdx.x; k < kch * 64; k += blockDim.x) ys[k] = 0.f;
    __syncthreads();  // the block's row writes are visible to the block after the barrier
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row = blockIdx.x;
    const float* src = staged ? ys : y + (i64)row * ldy;
    for (int c = warp; c < kch; c += blockDim.x >> 5) act8_quantize_chunk(src, c, xq + (i64)row * ldq, xs + row, lane);
}

// The GDN output norm, per (lane, v-head): y = o / sqrt(mean(o^2) + eps) * w * silu(z).
// grid (nlanes, HV), block = dv rounded up to 32 (dv <= 1024).
extern "C" __global__ void gated_rmsnorm(const float* __restrict__ o, int ldo, const float* __restrict__ z, int ldz,
                                         const float* __restrict__ w, float eps, int dv, float* __restrict__ y, int ldy) {
    const float wj = gated_weight_preload(w, dv);
    pdl_entry();
    __shared__ float red[32];
    const int t = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
    const float v = j < dv ? o[(i64)t * ldo + h * dv + j] : 0.f;
    const float ss = block_sum(v * v, red);
    if (j >= dv) return;
    const float den = sqrtf(ss / (float)dv + eps);
    const float zz = z[(i64)t * ldz + h * dv + j];
    y[(i64)t * ldy + h * dv + j] = (v / den) * wj * (zz * sigmoid_f(zz));
}

// gated_rmsnorm, then the row's a8 GEMV input for this head's chunks (dv % 64 == 0: a head owns
// whole 64-k chunks), quantized from a shared copy: the bytes quant_act8 would make from y, one
// launch fewer before each GDN output projection. block = dv threads, dv <= GATED_A8_MAX_DV.
extern "C" __global__ void gated_rmsnorm_a8(const float* __restrict__ o, int ldo, const float* __restrict__ z, int ldz,
                                            const float* __restrict__ w, float eps, int dv, float* __restrict__ y,
                                            int ldy, u8* __restrict__ xq, int ldq, float* __restrict__ xs) {
    const float wj = gated_weight_preload(w, dv);
    pdl_entry();
    __shared__ float red[32];
    __shared__ __align__(16) float ys[GATED_A8_MAX_DV];
    const int t = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
    const float v = j < dv ? o[(i64)t * ldo + h * dv + j] : 0.f;
    const float ss = block_sum(v * v, red);
    if (j < dv) {
        const float den = sqrtf(ss / (float)dv + eps);
        const float zz = z[(i64)t * ldz + h * dv + j];
        const float out = (v / den) * wj * (zz * sigmoid_f(zz));
        y[(i64)t * ldy + h * dv + j] = out;
        ys[j] = out;
    }
    __syncthreads();
    const int warp = j >> 5, lane = j & 31;
    if (warp < dv / 64) {
        const float2 pv = *reinterpret_cast<const float2*>(ys + warp * 64 + 2 * lane);
        act8_quantize_pair(pv, (h * dv) / 64 + warp, xq + (i64)t * ldq, xs + t, lane);
    }
}

// ---------------------------------------------------------------- prefill rows (many tokens per launch)
// Both kernels below compute exactly what their one-row / one-(token, head) forms above compute, with the
// same products and the same reduction tree, so the same bits; they only hold more rows per SM, and
// they can write the bf16 copy of their output (the cuBLAS route's input: f32_to_bf16_rows' bytes of
// the fp32 rows) instead of, or beside, the fp32 rows. Either output pointer may be null.

// rmsnorm_rows for prefill chunks: the arithmetic of rmsnorm_rows at a block of 256 R threads
// (kernels.rmsnorm: 1024 for rows of >= 2048, else 256) run by 256 threads. Why: rmsnorm_rows keeps
// 48 registers per thread (its preloaded weights), so a 1024-thread block is one row per SM in
// flight, and a prefill chunk's thousands of rows moved ~1.6 of the card's 4.5 TB/s (device run g5:
// 26 ms of an 8K prefill). Thread tid plays the wide block's threads tid + 256 r (r < R): their
// elements tid + 256 r + 256 R i in the same fmaf order, and warp w's lanes hold exactly the wide
// block's warp w + 8 r, so each warp_sum, and the final warp_sum over the wide block's 8 R warp sums,
// are the wide block's. grid rows, block 256.
template <int R>
__device__ __forceinline__ void rmsnorm_row_wide(const float* __restrict__ x, int ldx, const float* __restrict__ w,
                                                 float add_one, float eps, int H, float* __restrict__ y, int ldy,
                                                 u16* __restrict__ yb, int ldyb) {
    constexpr int VB = 256 * R;  // the wide block's threads
    __shared__ float red[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* xr = x + (i64)blockIdx.x * ldx;
    float v[R][NORM_PER_THREAD];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int i = 0; i < NORM_PER_THREAD; i++) {
            const int k = tid + 256 * r + VB * i;
            v[r][i] = k < H ? xr[k] : 0.f;
        }
#pragma unroll
    for (int r = 0; r < R; r++) {
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < NORM_PER_THREAD; i++) ss = fmaf(v[r][i], v[r][i], ss);
        for (int k = tid + 256 * r + NORM_PER_THREAD * VB; k < H; k += VB) ss = fmaf(xr[k], xr[k], ss);
        ss = warp_sum(ss);
        if (lane == 0) red[warp + 8 * r] = ss;
    }
    __syncthreads();
    const float ss = warp_sum(lane < VB / 32 ? red[lane] : 0.f);
    const float den = sqrtf(ss / (float)H + eps);
    float* yr = y ? y + (i64)blockIdx.x * ldy : nullptr;
    u16* br = yb ? yb + (i64)blockIdx.x * ldyb : nullptr;
#pragma unroll
    for (int r = 0; r < R; r++) {
#pragma unroll
        for (int i = 0; i < NORM_PER_THREAD; i++) {
            const int k = tid + 256 * r + VB * i;
            if (k < H) {
                const float o = (v[r][i] / den) * (w[k] + add_one);
                if (yr) yr[k] = o;
                if (br) br[k] = bf16_rn(o);
            }
        }
        for (int k = tid + 256 * r + NORM_PER_THREAD * VB; k < H; k += VB) {
            const float o = (xr[k] / den) * (w[k] + add_one);
            if (yr) yr[k] = o;
            if (br) br[k] = bf16_rn(o);
        }
    }
}

// wide: the block size rmsnorm_rows would run this row length with (1024 or 256)
extern "C" __global__ void __launch_bounds__(256) rmsnorm_rows_wide(const float* __restrict__ x, int ldx,
                                                                    const float* __restrict__ w, float add_one,
                                                                    float eps, int H, int wide, float* __restrict__ y,
                                                                    int ldy, u16* __restrict__ yb, int ldyb) {
    pdl_entry();
    if (wide == 1024)
        rmsnorm_row_wide<4>(x, ldx, w, add_one, eps, H, y, ldy, yb, ldyb);
    else
        rmsnorm_row_wide<1>(x, ldx, w, add_one, eps, H, y, ldy, yb, ldyb);
}

// gated_rmsnorm for prefill chunks: GATED_ROWS tokens of one value head per block. Why: gated_rmsnorm is
// one block per (token, head), 196,608 blocks of 128 threads for a 4,096-token chunk of the 27B, each a
// load, two barriers and a store (device run g5: 23 ms of an 8K prefill, ~3.6x its bytes). Per token
// the same block-wide sum as gated_rmsnorm at this block size (each warp's warp_sum of its lanes'
// squares, then the warp_sum of the warp sums) and the same expression: the same bits.
// grid (ceil(T / GATED_ROWS), HV), block = dv rounded up to 32.
extern "C" __global__ void gated_rmsnorm_rows(const float* __restrict__ o, int ldo, const float* __restrict__ z,
                                              int ldz, const float* __restrict__ w, float eps, int dv, int T,
                                              float* __restrict__ y, int ldy, u16* __restrict__ yb, int ldyb) {
    pdl_entry();
    __shared__ float red[GATED_ROWS][32];
    const int h = blockIdx.y, j = threadIdx.x;
    const int t0 = blockIdx.x * GATED_ROWS;
    const float wj = j < dv ? w[j] : 0.f;
    float v[GATED_ROWS], zz[GATED_ROWS];
#pragma unroll
    for (int r = 0; r < GATED_ROWS; r++) {
        const bool ok = t0 + r < T && j < dv;
        v[r] = ok ? o[(i64)(t0 + r) * ldo + h * dv + j] : 0.f;
        zz[r] = ok ? z[(i64)(t0 + r) * ldz + h * dv + j] : 0.f;
    }
    float sq[GATED_ROWS];
#pragma unroll
    for (int r = 0; r < GATED_ROWS; r++) sq[r] = v[r] * v[r];
    block_sums_post<GATED_ROWS>(sq, red);
#pragma unroll
    for (int r = 0; r < GATED_ROWS; r++) {
        const float ss = block_total(red[r]);
        if (t0 + r < T && j < dv) {
            const float den = sqrtf(ss / (float)dv + eps);
            const float out = (v[r] / den) * wj * (zz[r] * sigmoid_f(zz[r]));
            const i64 t = t0 + r;
            if (y) y[t * ldy + h * dv + j] = out;
            if (yb) yb[t * ldyb + h * dv + j] = bf16_rn(out);
        }
    }
}
