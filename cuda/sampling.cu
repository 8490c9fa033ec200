// Per-row argmax with the top1 - top2 margin (the drafter's confidence signal), and
// Gumbel-max sampling at a temperature, over full-vocabulary logits.
//
// Candidates are compared as 64-bit keys: a monotone map of the float in the high word and
// the inverted index in the low word, so max() is exact, order-free and breaks ties toward
// the lowest index like numpy.argmax. Two launches: NB partial blocks per row, then a final
// merge -- no float atomics, the same bits every run.
#include "common.cuh"

typedef unsigned long long u64;

__device__ __forceinline__ u64 make_key(float v, int i) {
    if (v == 0.f) v = 0.f;  // -0 == +0
    u32 u = __float_as_uint(v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    if (v != v) u = 0;  // NaN ranks last
    return ((u64)u << 32) | (u64)(0xffffffffu - (u32)i);
}

__device__ __forceinline__ float key_value(u64 k) {
    u32 u = (u32)(k >> 32);
    u = (u & 0x80000000u) ? (u & 0x7fffffffu) : ~u;
    return __uint_as_float(u);
}

__device__ __forceinline__ void top2_push(u64& k1, u64& k2, u64 k) {
    if (k > k1) {
        k2 = k1;
        k1 = k;
    } else if (k > k2) {
        k2 = k;
    }
}

__device__ __forceinline__ void top2_merge(u64& a1, u64& a2, u64 b1, u64 b2) {
    const u64 n1 = a1 > b1 ? a1 : b1;
    const u64 lo = a1 > b1 ? b1 : a1;
    const u64 m2 = a2 > b2 ? a2 : b2;
    a1 = n1;
    a2 = lo > m2 ? lo : m2;
}

__device__ __forceinline__ void warp_top2(u64& k1, u64& k2) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 b1 = __shfl_xor_sync(FULL_MASK, k1, o), b2 = __shfl_xor_sync(FULL_MASK, k2, o);
        top2_merge(k1, k2, b1, b2);
    }
}

__device__ __forceinline__ float gumbel_noise(u64 seed, long long pos, int i) {
    // uniform in (0, 1) exclusive, keyed by (seed, absolute position, vocab index) only
    const u32 h = hash_u32(seed ^ ((u64)pos * 0x9E3779B97F4A7C15ull) ^ ((u64)i << 32 | (u64)i));
    const float u = ((float)(h >> 8) + 0.5f) * (1.0f / 16777216.0f);
    return -logf(-logf(u));
}

// grid (rows, NB), block 256. part: [rows][NB][2] keys. inv_temp <= 0: plain argmax;
// else keys are logits * inv_temp + Gumbel noise at position pos0_dev[0] + row.
// The block's top-2 keys (each thread's pair in k1 >= k2) -> dst[0], dst[1]: warps first, then warp 0
// over the warp winners (block <= 256 threads). Shared by the plain and the masked partial passes.
__device__ __forceinline__ void block_top2_store(u64 k1, u64 k2, unsigned long long* dst) {
    __shared__ u64 s1[8], s2[8];
    warp_top2(k1, k2);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        s1[warp] = k1;
        s2[warp] = k2;
    }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        k1 = lane < nw ? s1[lane] : 0;
        k2 = lane < nw ? s2[lane] : 0;
        warp_top2(k1, k2);
        if (lane == 0) {
            dst[0] = k1;
            dst[1] = k2;
        }
    }
}

extern "C" __global__ void top2_partial(const float* __restrict__ logits, int ld, int V, float inv_temp,
                                        unsigned long long seed, const int* __restrict__ pos0_dev,
                                        unsigned long long* __restrict__ part) {
    pdl_entry();
    const int row = blockIdx.x, nb = gridDim.y, b = blockIdx.y;
    const float* x = logits + (i64)row * ld;
    const long long pos = inv_temp > 0.f ? (long long)(*pos0_dev) + row : 0;
    u64 k1 = 0, k2 = 0;
    // four loads in flight a thread before their pushes: one dependent load a push held the 27B's 248K-logit
    // row at ~26 us on 16 blocks (tools/step_trace.py, docs/PERF.md thirteenth session). The keys carry their
    // ids, so the top two are the same whatever order they are pushed in.
    const int step = nb * blockDim.x;
    int i = b * blockDim.x + threadIdx.x;
    for (; i + 3 * step < V; i += 4 * step) {
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; j++) v[j] = x[i + j * step];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int k = i + j * step;
            const float w = inv_temp > 0.f ? v[j] * inv_temp + gumbel_noise(seed, pos, k) : v[j];
            top2_push(k1, k2, make_key(w, k));
        }
    }
    for (; i < V; i += step) {
        float v = x[i];
        if (inv_temp > 0.f) v = v * inv_temp + gumbel_noise(seed, pos, i);
        top2_push(k1, k2, make_key(v, i));
    }
    block_top2_store(k1, k2, part + ((i64)row * nb + b) * 2);
}

// grid (rows), block 32 (NB <= 32). ids[row], top1[row] (the key's value), margin[row] = top1 - top2.
extern "C" __global__ void top2_final(const unsigned long long* __restrict__ part, int nb, int* __restrict__ ids,
                                      float* __restrict__ top1, float* __restrict__ margin) {
    pdl_entry();
    const int row = blockIdx.x, lane = threadIdx.x;
    u64 k1 = lane < nb ? part[((i64)row * nb + lane) * 2] : 0;
    u64 k2 = lane < nb ? part[((i64)row * nb + lane) * 2 + 1] : 0;
    warp_top2(k1, k2);
    if (lane == 0) {
        ids[row] = (int)(0xffffffffu - (u32)(k1 & 0xffffffffull));
        const float v1 = key_value(k1);
        top1[row] = v1;
        margin[row] = v1 - key_value(k2);
    }
}

// The argmax of each row over the ids its output constraint allows (issue 16): mask is one bit per
// vocabulary id, little-endian within 32-bit words (bit i & 31 of word i >> 5; 1 = allowed), one
// row of mask_ld words per picked row. A refused id never becomes a candidate, so the pick is
// numpy.argmax of the row with refused ids at -inf (ties to the lowest allowed id) and the host
// downloads one id per row instead of the logits row. row_idx[row]: the logits row to read (the
// compact rows of the last forward), so a verify round picks all its lanes in one launch.
// grid (rows, NB), block 256; top2_final then merges part as for top2_partial. A row with no
// allowed id ends with key 0: top2_final's id is then -1 (the host never uploads an empty mask).
extern "C" __global__ void top2_partial_masked(const float* __restrict__ logits, int ld, int V,
                                               const int* __restrict__ row_idx, const unsigned* __restrict__ mask,
                                               int mask_ld, unsigned long long* __restrict__ part) {
    pdl_entry();
    const int row = blockIdx.x, nb = gridDim.y, b = blockIdx.y;
    const float* x = logits + (i64)row_idx[row] * ld;
    const unsigned* m = mask + (i64)row * mask_ld;
    u64 k1 = 0, k2 = 0;
    for (int i = b * blockDim.x + threadIdx.x; i < V; i += nb * blockDim.x) {
        if ((m[i >> 5] >> (i & 31)) & 1u) top2_push(k1, k2, make_key(x[i], i));
    }
    block_top2_store(k1, k2, part + ((i64)row * nb + b) * 2);
}
