// Helpers shared by every kernel file in cuda/. Header-only, no CUDA headers needed:
// NVRTC under CuPy compiles these sources without a toolkit include path, so the few
// half/bf16 conversions we need are written as inline PTX on plain integer types.
// Named kernel constants (formats, modes, tile sizes, warps, stages, descriptor fields) are not
// defined in cuda/: they come from the table in q27py/gpu/constants.py as -D compile options
// (runtime.compile_options), so Python and CUDA never hold two copies of a number.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define FULL_MASK 0xffffffffu
#ifndef INFINITY  // NVRTC has no math.h
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over a block whose size is a multiple of 32 (<= 1024). Fixed shuffle/smem order, so
// the result is the same bits on every run. `red` needs 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // red may still be read by a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = lane < nw ? red[lane] : 0.f;
    return warp_sum(t);
}

// fp16 bits -> float
__device__ __forceinline__ float half_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// float -> fp16 bits, round to nearest even
__device__ __forceinline__ u16 float_to_half(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// bf16 bits -> float (exact)
__device__ __forceinline__ float bf16_to_float(u16 b) { return __uint_as_float(((u32)b) << 16); }

// float -> bf16 bits, round to nearest even (NaN stays NaN)
__device__ __forceinline__ u16 float_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// Two floats -> packed bf16x2 (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float bf16x2_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16x2_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }

// d = a * b + c on packed bf16x2 (exact whenever the true result is a bf16 value).
__device__ __forceinline__ u32 fma_bf16x2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// D = A(16x16 bf16, row) * B(16x8 bf16, col) + C (fp32). Fragment layout: PTX ISA, mma.m16n8k16.
__device__ __forceinline__ void mma_bf16_16816(float& d0, float& d1, float& d2, float& d3, u32 a0, u32 a1, u32 a2,
                                               u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
// torch softplus (beta 1, threshold 20)
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Stateless 32-bit hash (for seeded random weights made on the GPU): splitmix-style finalizer.
__device__ __forceinline__ u32 hash_u32(unsigned long long x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return (u32)(x ^ (x >> 32));
}
