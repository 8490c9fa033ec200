// Quantize and pack weights on the GPU (the layouts of q27py/gpu/layout.py, bit for bit),
// and make seeded random weights in place (no host copy of a 27B model).
//
// Quantization is symmetric per (row, group): scale = fp16(absmax / qmax), code =
// clamp(rint(w / scale), -qmax, qmax), the division in fp32 by the fp16-rounded scale.
#include "common.cuh"


__device__ __forceinline__ float src_at(const void* src, int src_bf16, int nrows, int K, i64 ld, int r, int k) {
    if (r >= nrows || k >= K) return 0.f;
    if (src_bf16) return bf16_to_float(reinterpret_cast<const u16*>(src)[(i64)r * ld + k]);
    return reinterpret_cast<const float*>(src)[(i64)r * ld + k];
}

// One thread per (row, group): fp16 scale into a plain [nrows, ngroups] array.
extern "C" __global__ void quant_scales(const void* src, int src_bf16, int nrows, int K, i64 ld, int group, float qmax,
                                        int ngroups, u16* out) {
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)nrows * ngroups) return;
    const int r = (int)(idx / ngroups), gi = (int)(idx % ngroups);
    float amax = 0.f;
    const int k1 = min(K, (gi + 1) * group);
    for (int k = gi * group; k < k1; k++) amax = fmaxf(amax, fabsf(src_at(src, src_bf16, nrows, K, ld, r, k)));
    out[idx] = float_to_half(fminf(__fdiv_rn(amax, qmax), 65504.f));
}

__device__ __forceinline__ int quant_code(float v, float s, int qmax) {
    if (!(s > 0.f)) return 0;
    const int q = __float2int_rn(__fdiv_rn(v, s));
    return max(-qmax, min(qmax, q));
}

// grid (kchunks, row_tiles), 32 threads: each thread writes its own fragment bytes.
extern "C" __global__ void pack_matrix(const void* src, int src_bf16, int nrows, int K, i64 ld, int fmt, int kch,
                                       int group_chunks, int ngroups, const u16* scales, u8* out, u32* sc_out) {
    const int c = blockIdx.x, rt = blockIdx.y, l = threadIdx.x, g = l >> 2, t = l & 3;
    const int r0 = rt * 16;
    auto val = [&](int r, int k) { return src_at(src, src_bf16, nrows, K, ld, r0 + r, k); };
    auto scale_of = [&](int r, int k) {
        return (r0 + r) < nrows ? half_to_float(scales[(i64)(r0 + r) * ngroups + k / (group_chunks * 64)]) : 0.f;
    };
    const int kb = c * 64 + 2 * t;
    if (fmt == FMT_BF16) {
        u8* dst = out + ((i64)rt * kch + c) * 2048 + l * 16;
        for (int s = 0; s < 4; s++) {
            const int k = kb + 16 * s;
            u32 r[4];
            for (int reg = 0; reg < 4; reg++) {
                const int row = g + 8 * (reg & 1), kk = k + 8 * (reg >> 1);
                u16 lo, hi;
                if (src_bf16) {
                    const u16* sb = reinterpret_cast<const u16*>(src);
                    const bool ok = (r0 + row) < nrows;
                    lo = (ok && kk < K) ? sb[(i64)(r0 + row) * ld + kk] : 0;
                    hi = (ok && kk + 1 < K) ? sb[(i64)(r0 + row) * ld + kk + 1] : 0;
                } else {
                    lo = float_to_bf16(val(row, kk));
                    hi = float_to_bf16(val(row, kk + 1));
                }
                r[reg] = (u32)lo | ((u32)hi << 16);
            }
            *reinterpret_cast<uint4*>(dst + s * 512) = make_uint4(r[0], r[1], r[2], r[3]);
        }
    } else if (fmt == FMT_Q8) {
        for (int jj = 0; jj < 2; jj++) {
            u32 wds[4];
            for (int sub = 0; sub < 2; sub++)
                for (int word = 0; word < 2; word++) {
                    u32 wv = 0;
                    for (int b = 0; b < 4; b++) {
                        const int row = g + 8 * (b & 1), k = kb + 16 * (2 * jj + sub) + 8 * word + (b >> 1);
                        const int q = quant_code(val(row, k), scale_of(row, k), 127);
                        wv |= (u32)(q + 128) << (8 * b);
                    }
                    wds[sub * 2 + word] = wv;
                }
            *reinterpret_cast<uint4*>(out + ((i64)rt * kch + c) * 1024 + jj * 512 + l * 16) =
                make_uint4(wds[0], wds[1], wds[2], wds[3]);
        }
    } else {
        u32 wds[4];
        for (int s = 0; s < 4; s++) {
            u32 wv = 0;
            for (int q = 0; q < 8; q++) {
                const int p = q & 3, e = q >> 2;
                const int row = g + 8 * (p & 1), k = kb + 16 * s + 8 * (p >> 1) + e;
                const int code = quant_code(val(row, k), scale_of(row, k), 7);
                wv |= (u32)(code + 8) << (4 * q);
            }
            wds[s] = wv;
        }
        *reinterpret_cast<uint4*>(out + ((i64)rt * kch + c) * 512 + l * 16) = make_uint4(wds[0], wds[1], wds[2], wds[3]);
    }
    if (fmt != FMT_BF16 && (c % group_chunks) == 0 && l < 8) {
        const int gi = c / group_chunks;
        const u32 lo = (r0 + l) < nrows ? scales[(i64)(r0 + l) * ngroups + gi] : 0;
        const u32 hi = (r0 + l + 8) < nrows ? scales[(i64)(r0 + l + 8) * ngroups + gi] : 0;
        sc_out[((i64)rt * ngroups + gi) * 8 + l] = lo | (hi << 16);
    }
}

// Row-major int8 codes (embeddings: one row is gathered per token), scales from quant_scales.
extern "C" __global__ void quant_rows_q8(const void* src, int src_bf16, int nrows, int K, i64 ld, int group, int ngroups,
                                         const u16* scales, signed char* out, i64 ldo) {
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)nrows * ldo) return;
    const int r = (int)(idx / ldo), k = (int)(idx % ldo);
    const float s = half_to_float(scales[(i64)r * ngroups + min(k / group, ngroups - 1)]);
    out[idx] = (signed char)quant_code(src_at(src, src_bf16, nrows, K, ld, r, k), s, 127);
}

// fp32 -> bf16 bits, or bf16 bits copied (row-major tables).
extern "C" __global__ void to_bf16_rows(const void* src, int src_bf16, i64 n, u16* out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = src_bf16 ? reinterpret_cast<const u16*>(src)[i] : float_to_bf16(reinterpret_cast<const float*>(src)[i]);
}

extern "C" __global__ void bf16_to_f32(const u16* src, i64 n, float* out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = bf16_to_float(src[i]);
}

__device__ __forceinline__ u32 rand_at(unsigned long long seed, i64 i) {
    return hash_u32(seed * 0x100000001B3ull + (unsigned long long)i);
}

// Random codes: every byte uniform (q4 nibbles in -8..7, q8 bytes in -128..127).
extern "C" __global__ void fill_random_u32(u32* dst, i64 n, unsigned long long seed) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        dst[i] = rand_at(seed, i);
}

__device__ __forceinline__ float rand_uniform(unsigned long long seed, i64 i, float lo, float hi) {
    return lo + (hi - lo) * (float)(rand_at(seed, i) >> 8) * (1.0f / 16777216.0f);
}

extern "C" __global__ void fill_random_f32(float* dst, i64 n, unsigned long long seed, float lo, float hi) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        dst[i] = rand_uniform(seed, i, lo, hi);
}

// Random fp16 scale pairs in [lo, hi): n is the number of uint32 words (two scales each).
extern "C" __global__ void fill_random_scales(u32* dst, i64 n, unsigned long long seed, float lo, float hi) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const u32 a = float_to_half(rand_uniform(seed, 2 * i, lo, hi));
        const u32 b = float_to_half(rand_uniform(seed, 2 * i + 1, lo, hi));
        dst[i] = a | (b << 16);
    }
}

// Random bf16 values in [lo, hi), row-major (bf16 tables and matrices for the random model).
extern "C" __global__ void fill_random_bf16(u16* dst, i64 n, unsigned long long seed, float lo, float hi) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        dst[i] = float_to_bf16(rand_uniform(seed, i, lo, hi));
}
