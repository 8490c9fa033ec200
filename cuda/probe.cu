// Bandwidth probes: the physical ceilings the benchmarks state their numbers against.
#include "common.cuh"

// Streaming read of n16 16-byte words, four independent loads in flight per thread.
extern "C" __global__ void read_bw(const uint4* __restrict__ src, i64 n16, u32* __restrict__ sink) {
    u32 acc = 0;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint4* p = src + i + j * stride;
            asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w)
                         : "l"(p));
        }
#pragma unroll
        for (int j = 0; j < 4; j++) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    for (; i < n16; i += stride) {
        const uint4 v = src[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads alive
}

// Kernel boundaries (tools/boundary_probe.py; never the engine): what a small producer -> wide consumer hand-over
// costs, each side waiting either on its predecessor grid (griddepcontrol.wait, what every engine kernel does) or on
// a ready word its predecessor releases after its writes, against no wait at all (the bound; its results are wrong).
// A chain of pairs: bnd_produce (one CTA, the engine's norm / quant launches) writes n words, then bnd_consume (many
// CTAs, a GEMV's shape: each streams its own slice of a large buffer) reads them and counts words that are not this
// pair's tag -- 0 under every wait, the check that a ready word publishes the data. Measured slower than the grid wait
// in both directions (docs/PERF.md, 2026-12-07 sixteenth session).

__device__ __forceinline__ void bnd_grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void bnd_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// thread 0 spins on ld.acquire of *word until it holds tag, then the CTA's barrier
__device__ __forceinline__ void bnd_spin(const u32* word, u32 tag) {
    if (threadIdx.x == 0) {
        u32 v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(word) : "memory");
        } while (v != tag);
    }
    __syncthreads();
}

// after the CTA's writes: thread 0 publishes them and, as the last CTA of the grid to arrive (a ticket), releases
// *word = tag (one CTA: releases at once)
__device__ __forceinline__ void bnd_release(u32* ticket, u32* word, u32 tag) {
    __syncthreads();  // every thread's writes are done (the CTA's order) ...
    if (threadIdx.x == 0) {
        __threadfence();  // ... and visible device-wide before the ticket / the word that says so
        if (gridDim.x == 1 || atomicAdd(ticket, 1u) == gridDim.x - 1) {
            __threadfence();  // the other CTAs' fenced writes, seen through the ticket, before the word
            asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(word), "r"(tag) : "memory");
        }
    }
}

// mode bits: 1 releases *flag = tag after the writes (for a consumer spinning on it); 2 waits on *done == ptag (the
// previous consumer's ticket release; ptag 0: the first pair, whose predecessor grid is waited on) instead of the
// grid; 4 no wait at all. The trigger first, as the engine's small kernels do (pdl_entry under PDL_EARLY, the
// default): the consumer's CTAs launch while this one waits.
extern "C" __global__ void bnd_produce(u32* __restrict__ data, int n, u32* __restrict__ flag, u32 tag, int mode,
                                       const u32* __restrict__ done, u32 ptag) {
    bnd_trigger();
    if (mode & 4) {
    } else if ((mode & 2) && ptag) {
        bnd_spin(done, ptag);
    } else {
        bnd_grid_wait();
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) data[i] = tag;
    if (mode & 1) bnd_release(nullptr, flag, tag);
}

// mode bits: 1 spins on *flag == tag instead of waiting on the producer grid; 2 releases *done = tag once every CTA
// has finished (ticket); 4 no wait. Then the data check and the CTA's slice of w (per 16-byte words from
// w + blockIdx.x * per), four loads in flight a thread as read_bw.
extern "C" __global__ void bnd_consume(const u32* __restrict__ data, int n, const u32* __restrict__ flag, u32 tag,
                                       int mode, const uint4* __restrict__ w, i64 per, u32* __restrict__ bad,
                                       u32* __restrict__ ticket, u32* __restrict__ done) {
    if (mode & 4) {
    } else if (mode & 1) {
        bnd_spin(flag, tag);
    } else {
        bnd_grid_wait();
    }
    bnd_trigger();
    u32 miss = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        u32 v;
        asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(data + i));
        miss += v != tag;
    }
    const uint4* src = w + (i64)blockIdx.x * per;
    u32 acc = 0;
    i64 i = threadIdx.x;
    for (; i + 3 * blockDim.x < per; i += 4 * blockDim.x) {
        uint4 v[4];
#pragma unroll
        for (int j = 0; j < 4; j++) v[j] = ld_stream16(src + i + j * blockDim.x);
#pragma unroll
        for (int j = 0; j < 4; j++) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    for (; i < per; i += blockDim.x) {
        const uint4 v = src[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) miss += 1u << 30;  // keeps the loads alive (random data: never in practice)
    if (miss) atomicAdd(bad, miss);
    if (mode & 2) bnd_release(ticket, done, tag);
}
