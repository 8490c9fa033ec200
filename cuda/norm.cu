// RMSNorm variants. Sums of squares use a fixed block-reduction order (bitwise repeatable).
#include "common.cuh"

// y = x / sqrt(mean(x^2) + eps) * (w + add_one)   per row; add_one = 1 for the zero-centred
// Qwen norms (input/post-attention/final/MTP), 0 for a plain weight.
// grid (rows), block 256..1024. A thread keeps its (up to 8) elements in registers between
// the two passes, so the row is read once and every load is issued before the first use.
__device__ __forceinline__ void rmsnorm_row(const float* __restrict__ x, int ldx, const float* __restrict__ w,
                                            float add_one, float eps, int H, float* __restrict__ y, int ldy,
                                            float* red) {
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
        if (k < H) yr[k] = (v[i] / den) * (w[k] + add_one);
    }
    for (int k = threadIdx.x + NORM_PER_THREAD * blockDim.x; k < H; k += blockDim.x) yr[k] = (xr[k] / den) * (w[k] + add_one);
}

extern "C" __global__ void rmsnorm_rows(const float* __restrict__ x, int ldx, const float* __restrict__ w, float add_one,
                                        float eps, int H, float* __restrict__ y, int ldy) {
    pdl_entry();
    __shared__ float red[32];
    rmsnorm_row(x, ldx, w, add_one, eps, H, y, ldy, red);
}

// rmsnorm_rows, then the row's a8 GEMV input (act8_quantize_chunk over its kch chunks, from the
// fp32 row just written: the same bytes quant_act8 would make). Why: one launch instead of two
// before each a8 GEMV that reads a normed row (the layers' input and MLP norms).
extern "C" __global__ void rmsnorm_rows_a8(const float* __restrict__ x, int ldx, const float* __restrict__ w,
                                           float add_one, float eps, int H, float* __restrict__ y, int ldy, int kch,
                                           u8* __restrict__ xq, int ldq, float* __restrict__ xs) {
    pdl_entry();
    __shared__ float red[32];
    rmsnorm_row(x, ldx, w, add_one, eps, H, y, ldy, red);
    __syncthreads();  // the block's row writes are visible to the block after the barrier
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row = blockIdx.x;
    for (int c = warp; c < kch; c += blockDim.x >> 5)
        act8_quantize_chunk(y + (i64)row * ldy, c, xq + (i64)row * ldq, xs + row, lane);
}

// The GDN output norm, per (lane, v-head): y = o / sqrt(mean(o^2) + eps) * w * silu(z).
// grid (nlanes, HV), block = dv rounded up to 32 (dv <= 1024).
extern "C" __global__ void gated_rmsnorm(const float* __restrict__ o, int ldo, const float* __restrict__ z, int ldz,
                                         const float* __restrict__ w, float eps, int dv, float* __restrict__ y, int ldy) {
    pdl_entry();
    __shared__ float red[32];
    const int t = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
    const float v = j < dv ? o[(i64)t * ldo + h * dv + j] : 0.f;
    const float ss = block_sum(v * v, red);
    if (j >= dv) return;
    const float den = sqrtf(ss / (float)dv + eps);
    const float zz = z[(i64)t * ldz + h * dv + j];
    y[(i64)t * ldy + h * dv + j] = (v / den) * w[j] * (zz * sigmoid_f(zz));
}
