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

// ---------------------------------------------------------------- fp8 e4m3 KV (q27py/model/kvformat.py)
// Codes: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; max 448; S.1111.111 = NaN. Each
// (position, kv head) row carries an int8 exponent e: value = e4m3(code) * 2^e, chosen so the row's
// absolute max lands in [128, 256) (never saturates; the power of two makes the scaling exact).

// float -> e4m3 code, round to nearest even, saturating to +-448 (NaN -> 0x7F | sign).
__device__ __forceinline__ u8 float_to_e4m3(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    // hardware conversion (sm_89+): cvt packs two codes, the first source in the high byte
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.f), "f"(x));
    return (u8)(r & 0xff);
#else
    // portable path: the same rounding done on the fp32 bits
    const u32 u = __float_as_uint(x);
    const u8 s = (u8)((u >> 24) & 0x80);
    const float a = fabsf(x);
    if (a != a) return (u8)(s | 0x7f);
    if (a >= 464.f) return (u8)(s | 0x7e);  // 448 < a < 464 rounds to 448 below; beyond saturates
    if (a < 0.015625f) return (u8)(s | (u8)__float2int_rn(a * 512.f));  // subnormal step 2^-9 (8 = 2^-6)
    u32 b = __float_as_uint(a);
    b += 0x7ffffu + ((b >> 20) & 1u);  // round the 23-bit mantissa to 3 bits, ties to even
    const int e = (int)(b >> 23) - 127 + 7;
    const u32 code = ((u32)e << 3) | ((b >> 20) & 7u);
    return (u8)(s | (code > 0x7eu ? 0x7eu : code));
#endif
}

// e4m3 code -> float / 256 (exact): the code's bits are an fp16 with the exponent re-biased by 8
// (subnormals included), so the row scale 2^(e+8) restores the value.
__device__ __forceinline__ float e4m3_to_float_div256(u32 c) {
    return half_to_float((u16)(((c & 0x80u) << 8) | ((c & 0x7fu) << 7)));
}

// Two codes (lo byte, hi byte) -> two floats / 256.
__device__ __forceinline__ void e4m3x2_to_float_div256(u32 c2, float& lo, float& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    u32 h2;  // hardware: e4m3x2 -> f16x2 (exact), then scale by 2^-8 (exact: an exponent shift)
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)(c2 & 0xffffu)));
    lo = half_to_float((u16)(h2 & 0xffffu)) * 0.00390625f;
    hi = half_to_float((u16)(h2 >> 16)) * 0.00390625f;
#else
    lo = e4m3_to_float_div256(c2 & 0xffu);
    hi = e4m3_to_float_div256((c2 >> 8) & 0xffu);
#endif
}

// 2^e for the int8 row exponent (|e| <= 120: a normal float).
__device__ __forceinline__ float exp2_int(int e) { return __int_as_float((127 + e) << 23); }

// The row exponent for a row whose absolute max is amax: amax * 2^-e in [128, 256).
__device__ __forceinline__ int fp8_row_exponent(float amax) {
    if (!(amax > 0.f) || __float_as_uint(amax) >= 0x7f800000u) return 0;  // zero, NaN or inf: scale 1
    int ex;
    frexpf(amax, &ex);  // amax = m 2^ex, m in [0.5, 1)
    const int e = ex - 8;
    return e < -120 ? -120 : (e > 120 ? 120 : e);
}

__device__ __forceinline__ float block_max(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = lane < nw ? red[lane] : 0.f;
    return warp_max(t);
}
