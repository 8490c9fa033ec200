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

// Kernel boundaries (tools/boundary_probe.py; never the engine): what a small producer -> wide
// consumer hand-over costs when the consumer waits on the producer grid (griddepcontrol.wait, what every engine
// kernel does) against waiting on a ready word the producer releases after its writes, and against no wait at all
// (the bound; its results are wrong). A chain of pairs: bnd_produce (one CTA, the engine's norm / quant launches)
// writes n words, then bnd_consume (many CTAs, a GEMV's shape: each streams its own slice of a large buffer) reads
// them and counts words that are not this pair's tag -- 0 under both waits, the check that the ready word publishes
// the data. Producers always wait on their predecessor grid (the engine's small kernels keep their waits).

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

// mode 0 / 1: wait on the predecessor grid (1 also releases *flag = tag after the writes); 2: no wait, no flag. The
// trigger first, as the engine's small kernels do (pdl_entry under PDL_EARLY, the default): the consumer's CTAs
// launch while this one waits.
extern "C" __global__ void bnd_produce(u32* __restrict__ data, int n, u32* __restrict__ flag, u32 tag, int mode) {
    bnd_trigger();
    if (mode != 2) bnd_grid_wait();
    for (int i = threadIdx.x; i < n; i += blockDim.x) data[i] = tag;
    if (mode == 1) {
        __syncthreads();  // every thread's words are written (the CTA's order) ...
        if (threadIdx.x == 0) {
            __threadfence();  // ... and visible device-wide before the word that says so
            asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flag), "r"(tag) : "memory");
        }
    }
}

// mode 0: wait on the producer grid; 1: thread 0 spins on ld.acquire of *flag until it holds tag, then the CTA's
// barrier; 2: no wait. Then the data check and the CTA's slice of w (per 16-byte words from w + blockIdx.x * per),
// four loads in flight a thread as cuda/probe.cu's read_bw.
extern "C" __global__ void bnd_consume(const u32* __restrict__ data, int n, const u32* __restrict__ flag, u32 tag,
                                       int mode, const uint4* __restrict__ w, i64 per, u32* __restrict__ bad) {
    if (mode == 0) {
        bnd_grid_wait();
    } else if (mode == 1) {
        if (threadIdx.x == 0) {
            u32 v;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
            } while (v != tag);
        }
        __syncthreads();
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
        for (int j = 0; j < 4; j++) {
            const uint4* p = src + i + j * blockDim.x;
            asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w)
                         : "l"(p));
        }
#pragma unroll
        for (int j = 0; j < 4; j++) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    for (; i < per; i += blockDim.x) {
        const uint4 v = src[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) miss += 1u << 30;  // keeps the loads alive (random data: never in practice)
    if (miss) atomicAdd(bad, miss);
}
