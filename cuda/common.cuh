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

// Programmatic dependent launch (sm_90+; q27py/gpu/runtime.py Runtime.launch, docs/PERF.md "PDL").
// Captured decode graphs may launch a kernel with the programmatic-serialization attribute: it
// then starts while the kernel before it is still running, and must not touch that kernel's
// outputs (nor anything it reads) before griddepcontrol.wait, which returns once every
// predecessor has completed and its memory is visible. launch_dependents lets the next kernel
// start early. Below sm_90 (and in launches without the attribute) both are no-ops.
// PDL_NOWAIT (constants table, 0; a timing probe only, never the engine: the results are wrong) compiles the
// wait out, so a captured graph's kernels run with no dependency on one another, as far as the SMs hold them.
// What a step takes then is what it would take if no launch boundary cost anything (no ramp, no wave tail
// between dependent launches): the bound on what a persistent, dataflow-ordered step could gain.
// PDL_NOWAIT 2 / 3 split it: 2 drops the waits of the kernels that enter through pdl_entry (every kernel but the
// GEMVs), 3 the GEMVs' own (gemv.cu / gemv_wg.cu call pdl_wait directly).
// STEP_TRACE (constants table, 0; tools/step_trace.py): thread 0 of every CTA of every kernel that waits here (each
// kernel of runtime.PDL_MODULES) records [%gridid, %globaltimer before the wait, after it, %smid] into this
// module's q27_trace. %gridid tells the launches apart; a launch's first release is when its predecessor completed.
#if STEP_TRACE
__device__ unsigned long long q27_trace[STEP_TRACE_CAP * 4];
__device__ unsigned int q27_trace_n;
__device__ __forceinline__ unsigned long long trace_clock() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ int trace_open() {
    if (threadIdx.x | threadIdx.y | threadIdx.z) return -1;
    const unsigned int i = atomicAdd(&q27_trace_n, 1u);
    if (i >= STEP_TRACE_CAP) return -1;
    unsigned long long gid;
    unsigned int sm;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(gid));
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    q27_trace[4 * i] = gid;
    q27_trace[4 * i + 1] = trace_clock();
    q27_trace[4 * i + 3] = sm;
    return (int)i;
}
#endif
__device__ __forceinline__ void pdl_wait_if(bool keep) {
#if STEP_TRACE
    const int ti = trace_open();
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (keep) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if STEP_TRACE
    if (ti >= 0) q27_trace[4 * ti + 2] = trace_clock();
#endif
}
__device__ __forceinline__ void pdl_wait() { pdl_wait_if(PDL_NOWAIT != 1 && PDL_NOWAIT != 3); }

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The first statement of every kernel a captured graph may launch with the attribute (a test
// checks each one). PDL_EARLY (compile option, EngineConfig.pdl "early"): let the next kernel
// launch before this one's own wait -- these kernels are short, so the next (often a GEMV, which
// streams weights before its wait) gets resident during the tail of the kernel two back. A GEMV
// triggers only after its wait (gemv_loop), so early launches never chain past one GEMV.
__device__ __forceinline__ void pdl_entry() {
#if PDL_EARLY
    pdl_trigger();
    pdl_wait_if(PDL_NOWAIT == 0 || PDL_NOWAIT == 3);
#else
    pdl_wait_if(PDL_NOWAIT == 0 || PDL_NOWAIT == 3);
    pdl_trigger();
#endif
}

// decode_batch lane table (q27py/gpu/forward.py FastModel.decode_batch): lane b of a batched launch is
// the next token of its own sequence. Row b holds LT_NFIELDS int64 base addresses of that sequence's
// state arrays (layer 0); a kernel adds its layer's byte offset (64-bit: one state's KV exceeds 2^31
// bytes). The positions (int32) follow the LANES_MAX rows, then the token ids. Written by the host
// before the launch, so one captured graph per lane count serves any set of states.
template <typename T>
__device__ __forceinline__ T* lane_ptr(const i64* __restrict__ lanes, int b, int field, i64 byte_off) {
    // through the global window: loads and stores derived from it stay global ones (ld.global.nc where
    // read-only), as from a kernel pointer argument, instead of generic ones
    return reinterpret_cast<T*>(__cvta_global_to_generic((size_t)(lanes[(i64)b * LT_NFIELDS + field] + byte_off)));
}
__device__ __forceinline__ const int* lane_positions(const i64* __restrict__ lanes) {
    return reinterpret_cast<const int*>(lanes + LANES_MAX * LT_NFIELDS);
}
// verify_batch group table (q27py/gpu/constants.py GT_*): group g = lane rows GT_FIRST[g] .. + GT_COUNT[g] - 1, one
// sequence's verify lanes (row r0 + j at that sequence's position + j); GT_KEEP[g]: the lanes commit_batch keeps;
// GT_GROUP[b]: lane b's group. Entry i of field f at word f * LANES_MAX + i.
__device__ __forceinline__ int group_field(const int* __restrict__ groups, int field, int i) {
    return groups[field * LANES_MAX + i];
}
// first lane row of lane b's group (b - that: b's offset in its group, the solo verify's lane index)
__device__ __forceinline__ int group_first_of_lane(const int* __restrict__ groups, int b) {
    return group_field(groups, GT_FIRST, group_field(groups, GT_GROUP, b));
}

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

// A warp's GEMV accumulators (GEMV_R 16-row tiles x NT 8-lane column tiles of mma.m16n8 fragments: thread (g, t)
// holds rows g, g + 8 and columns 2t, 2t + 1 of each) into slot `slot` of a reduction tile, row-major with NT * 8
// columns: the partial every GEMV unit (gemv.cu / gemv_wg.cu through gemv_v1.cuh, gemv2.cu) reduces in warp order.
template <int NT>
__device__ __forceinline__ void gemv_store_partial(float (*red)[GEMV_R * 16 * NT * 8], int slot,
                                                   const float (&acc)[GEMV_R][NT][4], int g, int t) {
    constexpr int COLS = NT * 8;
#pragma unroll
    for (int i = 0; i < GEMV_R; i++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int q = 0; q < 4; q++) red[slot][(i * 16 + g + 8 * (q >> 1)) * COLS + nt * 8 + 2 * t + (q & 1)] = acc[i][nt][q];
}

// The attention combines' merge of one (lane, head)'s ns split partials {m, l, acc[hd]} (hd + 2 floats a split from
// base), by a block of >= hd threads, thread d its column: (sum_s acc_s[d] e^(m_s - M)) / (sum_s l_s e^(m_s - M)),
// M = max m_s, the sums in split order. The splits' (m, l) land in shared memory in one parallel round trip, and each
// thread's acc loads go out 8 at a time ahead of their sums: the loop of one dependent L2 load (then three) a split
// held the combine at ~9.7 us at 2K context (32 splits; tools/step_trace.py, docs/PERF.md thirteenth session). The
// same bits as that loop (attention.cu attn_combine_seq_ref keeps it for the test): M is a max (exact in any order),
// e_s = expf(m_s - M) from the same operands, and L / A add in split order by the same fmaf chains.
constexpr int COMBINE_MAX_SPLITS = NSPLIT > ATTD_NSPLIT_MAX ? NSPLIT : ATTD_NSPLIT_MAX;  // both kernels' split counts
__device__ __forceinline__ float split_merge(const float* __restrict__ base, int ns, int hd, int d) {
    __shared__ float sm_e[COMBINE_MAX_SPLITS], sm_l[COMBINE_MAX_SPLITS];
    for (int s = d; s < ns; s += blockDim.x) {
        sm_e[s] = base[(i64)s * (hd + 2)];
        sm_l[s] = base[(i64)s * (hd + 2) + 1];
    }
    __syncthreads();
    float M = -INFINITY;
    for (int s = 0; s < ns; s++) M = fmaxf(M, sm_e[s]);
    __syncthreads();  // every thread has its M before the m_s are overwritten by their weights
    for (int s = d; s < ns; s += blockDim.x) sm_e[s] = expf(sm_e[s] - M);
    __syncthreads();
    float L = 0.f, A = 0.f;
    for (int s0 = 0; s0 < ns; s0 += 8) {
        // unpredicated loads (past the last split: its slot again, unused), so all 8 issue before the first product
        float a[8];
#pragma unroll
        for (int i = 0; i < 8; i++) a[i] = base[(i64)min(s0 + i, ns - 1) * (hd + 2) + 2 + d];
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (s0 + i < ns) {
                const float e = sm_e[s0 + i];
                L = fmaf(sm_l[s0 + i], e, L);
                A = fmaf(a[i], e, A);
            }
    }
    return A / L;
}

// block_sum of R values per thread at once, with one barrier for all of them: block_sums_post writes each
// warp's warp_sum of x[r] to red[r][warp] and waits; block_total(red[r]) is then block_sum(x[r]) -- the
// same warp_sum of the warp sums (lanes past the warps add 0), so the same bits as R block_sum calls.
// red: R rows of 32 floats of shared memory (not reused before every thread has read its totals).
template <int R>
__device__ __forceinline__ void block_sums_post(const float (&x)[R], float (*red)[32]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < R; r++) {
        const float s = warp_sum(x[r]);
        if (lane == 0) red[r][warp] = s;
    }
    __syncthreads();
}
__device__ __forceinline__ float block_total(const float* red_row) {
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    return warp_sum(lane < nw ? red_row[lane] : 0.f);
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

// float -> bf16 bits, round to nearest even: pack_bf16x2's conversion of one value, so a producer that
// writes the bf16 copy of its output element by element gives f32_to_bf16_rows' bytes (dequant.cu)
__device__ __forceinline__ u16 bf16_rn(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
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

// The prefill attention epilogue of attention_prefill2.cu (mma.sync) and attention_prefill3.cu (wgmma): both
// keep O in m16n8 C-fragment order, od(d, e) = dims 8 d + 2 tq + e of this thread's row half i (rows gq, gq + 8 of
// its warp's 16: CTA row R). l[] must already be summed over the quad. A row whose keys all lie in block 0
// (position < PF2_SPLIT_KEYS) is normalized and gated into out; any other writes this block's partial
// {O, m, l} at part for attn_prefill2_combine; a row whose keys end before the block writes nothing.
template <int HD, typename OD>
__device__ __forceinline__ void prefill_attn_row_out(OD od, int i, int R, int nrows, int rep, int g, int nq, int pos0,
                                                     int kb0, int blk, int nblk, int tq, const float (&m)[2],
                                                     const float (&l)[2], const float* __restrict__ qg, int ldqg,
                                                     float* __restrict__ out, int ldo, float* __restrict__ part) {
    constexpr int DT = HD / 8;
    if (R >= nrows) return;
    const int ln = R / rep, h = g * rep + (R - ln * rep);
    const int pos = pos0 + ln;
    if (pos < kb0) return;  // the row's keys end before this block
    if (pos < PF2_SPLIT_KEYS) {  // one block: the final output
        const float* gate = qg + (i64)ln * ldqg + h * 2 * HD + HD;
        float* dst = out + (i64)ln * ldo + h * HD;
#pragma unroll
        for (int d = 0; d < DT; d++) {
            const int dd = d * 8 + 2 * tq;
            const float2 gv = *reinterpret_cast<const float2*>(gate + dd);
            dst[dd] = (od(d, 2 * i) / l[i]) * sigmoid_f(gv.x);
            dst[dd + 1] = (od(d, 2 * i + 1) / l[i]) * sigmoid_f(gv.y);
        }
    } else {
        float* dst = part + ((i64)(ln * nq + h) * nblk + blk) * (HD + 4);
#pragma unroll
        for (int d = 0; d < DT; d++)
            *reinterpret_cast<float2*>(dst + d * 8 + 2 * tq) = make_float2(od(d, 2 * i), od(d, 2 * i + 1));
        if (tq == 0) *reinterpret_cast<float2*>(dst + HD) = make_float2(m[i], l[i]);
    }
}
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

// ---------------------------------------------------------------- cp.async (sm_80+)
// Asynchronous global -> shared copies, one set for every kernel file. dst is a 32-bit shared-memory
// address: smem_addr (inline PTX) or (u32)__cvta_generic_to_shared (the builtin, in gdn.cu and
// attention_prefill2.cu) -- the same value, not always the same schedule, so each file keeps the
// conversion it had. .cg caches in L2 only (16 bytes only); .ca in L1 too (4, 8 or 16 bytes).
// commit closes the copies issued so far into a group; wait<N> returns once at most N groups are
// still in flight, wait_all once none is. The plain forms carry no "memory" clobber (the compiler
// may move ordinary loads and stores across them); the _mem forms add one (attention.cu's decode
// ring, gdn.cu's staging). Each kernel keeps the forms it was built and measured with.
// Streaming 16-byte load, not kept in L1 (each weight byte is used once: gemv2, gemv_dp)
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async_cg16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
// 16 bytes with the first src_bytes read and the rest zero-filled (0: nothing is read, but src must
// still be a valid address)
__device__ __forceinline__ void cp_async_cg16_zfill(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_ca4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_ca8(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_ca16(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
// the same with dst a pointer into shared memory (converted after the arguments are evaluated)
__device__ __forceinline__ void cp_async_cg16(void* dst, const void* src) { cp_async_cg16(smem_addr(dst), src); }
__device__ __forceinline__ void cp_async_cg16_zfill(void* dst, const void* src, int src_bytes) {
    cp_async_cg16_zfill(smem_addr(dst), src, src_bytes);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;"); }
// the same with a "memory" clobber
__device__ __forceinline__ void cp_async_cg16_zfill_mem(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit_mem() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_mem() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all_mem() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// ---------------------------------------------------------------- mbarriers (sm_90)
// The warp-specialized kernels' stage handshakes (attention_prefill3.cu): init, arrive, parity wait, and the
// arrive a thread's cp.async copies trigger when they land (.noinc: it is one of the barrier's expected arrivals).
// bar: a 32-bit shared address (smem_addr).
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, int parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}
__device__ __forceinline__ void cp_async_mbar_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
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

// Two codes (lo byte, hi byte) -> f16x2 of their exact values (lo in the low half): one
// instruction on sm_89+; elsewhere the value / 256 form (the code's bits re-biased into an f16)
// times 256, exact for every finite code (|value| <= 448, subnormals included).
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 c2) {
    u32 h2;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)(c2 & 0xffffu)));
#else
    const u32 lo = ((c2 & 0x80u) << 8) | ((c2 & 0x7fu) << 7);
    const u32 hi = ((c2 & 0x8000u) << 8) | ((c2 & 0x7f00u) << 7);
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(h2) : "r"(lo | (hi << 16)), "r"(0x5c005c00u));  // x 256
#endif
    return h2;
}

// Two floats -> packed f16x2 (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float f16x2_lo(u32 v) { return half_to_float((u16)(v & 0xffffu)); }
__device__ __forceinline__ float f16x2_hi(u32 v) { return half_to_float((u16)(v >> 16)); }

// D (16x8, f32) += A (16x16, f16, row) * B (16x8, f16, col)
__device__ __forceinline__ void mma_f16_16816(float& d0, float& d1, float& d2, float& d3, u32 a0, u32 a1, u32 a2,
                                              u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
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

// ---------------------------------------------------------------- rotated Lloyd-Max KV (kvformat "k5v3" / "k3v3")
// Shared by the store (rope.cu), the decode / verify attention (kv_rotated.cu) and the prefill
// tiles (attention_prefill.cu), so every path reads and writes one layout with one set of bits.
// A row (one head vector, d = a power of two) is its codes in planes -- the low plane (2 bits x 4
// per byte for 3-bit codes, 4 bits x 2 per byte for 5-bit) then the high-bit plane (8 per byte) --
// plus a fp16 corrected norm s: value = s / sqrt(d) * (R^T c), R = H D / sqrt(d), c the centroids.

// sign diagonal D: bit 0 of murmur3 fmix32(i + 0x9E3779B9) set -> -1 (kvformat.rotation_signs)
__device__ __forceinline__ float rot_sign(u32 i) {
    u32 h = i + 0x9E3779B9u;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return (h & 1u) ? -1.f : 1.f;
}

// In-place unnormalized Walsh-Hadamard transform of xs[0..d) by a block of >= d threads
// (butterfly order of kvformat.fwht: stage h pairs i and i + h within blocks of 2h; fp32 adds,
// so the same bits as the spec). Starts and ends with a barrier.
__device__ __forceinline__ void block_fwht(float* xs, int d) {
    const int i = threadIdx.x;
    for (int h = 1; h < d; h <<= 1) {
        __syncthreads();
        float a = 0.f, b = 0.f;
        const bool top = i < d && (i & h) == 0;
        if (top) {
            a = xs[i];
            b = xs[i + h];
        }
        __syncthreads();
        if (top) {
            xs[i] = a + b;
            xs[i + h] = a - b;
        }
    }
    __syncthreads();
}

__device__ __forceinline__ int lm_lo_bits(int bits) { return bits == 3 ? 2 : 4; }

// code i of a packed row of d codes
__device__ __forceinline__ u32 lm_code(const u8* row, int i, int d, int bits) {
    const int lw = lm_lo_bits(bits), per = 8 / lw;
    const u32 lo = (row[i / per] >> (lw * (i % per))) & ((1u << lw) - 1u);
    const u32 hi = (row[d * lw / 8 + i / 8] >> (i % 8)) & 1u;
    return lo | (hi << lw);
}

// codes i0 .. i0 + 7 (i0 % 8 == 0) with one low-plane word and one high-plane byte. Aligned: a
// row is d * bits / 8 bytes (a multiple of 4 for d >= 32), the 3-bit low plane's word sits at
// an even offset (i0 / 4) and the 5-bit one at a multiple of 4 (i0 / 2).
__device__ __forceinline__ void lm_codes8(const u8* row, int i0, int d, int bits, u32 (&c)[8]) {
    const u32 hb = row[d * lm_lo_bits(bits) / 8 + i0 / 8];
    if (bits == 3) {
        const u32 w = *reinterpret_cast<const u16*>(row + i0 / 4);
#pragma unroll
        for (int k = 0; k < 8; k++) c[k] = ((w >> (2 * k)) & 3u) | (((hb >> k) & 1u) << 2);
    } else {
        const u32 w = *reinterpret_cast<const u32*>(row + i0 / 2);
#pragma unroll
        for (int k = 0; k < 8; k++) c[k] = ((w >> (4 * k)) & 15u) | (((hb >> k) & 1u) << 4);
    }
}

// kvformat.lm_quantize of one head vector held by a block of exactly d threads (thread i holds
// x_i): rotate, scale to unit variance, nearest centroid (searchsorted "left" on the edges),
// pack the planes into row[0 .. d*bits/8), corrected fp16 norm into *norm. Scratch: xs d
// floats, cs d bytes, red 32 floats. Every thread must call it (block barriers inside); it may
// follow other uses of xs / cs / red directly (it starts with a barrier).
__device__ __forceinline__ void lm_quantize_block(float x, int d, int bits, const float* __restrict__ centroids,
                                                  const float* __restrict__ edges, float inv_sqrt_d, float sqrt_d,
                                                  float* xs, u8* cs, float* red, u8* __restrict__ row,
                                                  u16* __restrict__ norm) {
    const int i = threadIdx.x;
    const float n = sqrtf(block_sum(x * x, red));  // block_sum's barriers order earlier xs reads
    xs[i] = x * rot_sign(i);
    block_fwht(xs, d);
    const float safe = n > 0.f ? n : 1.f;
    const float z = (xs[i] * inv_sqrt_d) * (sqrt_d / safe);
    const int nl = 1 << bits;
    u32 c = 0;
    for (int e = 0; e < nl - 1; e++) c += z > edges[e] ? 1u : 0u;
    cs[i] = (u8)c;
    const float cv = centroids[c];
    const float cn = sqrtf(block_sum(cv * cv, red));  // its barriers publish cs
    const int lw = lm_lo_bits(bits), per = 8 / lw;
    if (i < d / per) {  // low plane byte i
        u32 b = 0;
        for (int k = 0; k < per; k++) b |= ((u32)cs[i * per + k] & ((1u << lw) - 1u)) << (lw * k);
        row[i] = (u8)b;
    }
    if (i < d / 8) {  // high plane byte i
        u32 b = 0;
        for (int k = 0; k < 8; k++) b |= (((u32)cs[i * 8 + k] >> lw) & 1u) << k;
        row[d * lw / 8 + i] = (u8)b;
    }
    if (i == 0) {
        const float s = n > 0.f ? n * sqrt_d / cn : 0.f;
        *norm = float_to_half(fminf(s, 65504.f));
    }
}

// ---- a8 activations (cuda/gemv.cu gemv8_*): one 64-k chunk c of a fp32 row -> int8 codes in
// fragment order + the chunk's scale, by one warp (2 values per lane). scale = amax / 127,
// code = rint(x * (127 / amax)) (IEEE divisions, no contraction: q27py/gpu/layout.py
// quantize_act8 gives the same bits); an all-zero chunk has scale 0. Shared by quant_act8 and the
// fused producers (norm.cu rmsnorm_rows_a8), so both give the a8 GEMV the same bytes.
// dst_row: the row's code bytes; xs_col: &xs[0][row] of the [chunk][GEMV_MAX_LANES] scales.
__device__ __forceinline__ void act8_quantize_pair(float2 v, int c, u8* dst_row, float* xs_col, int lane);
__device__ __forceinline__ void act8_quantize_chunk(const float* row, int c, u8* dst_row, float* xs_col, int lane) {
    act8_quantize_pair(*reinterpret_cast<const float2*>(row + c * 64 + 2 * lane), c, dst_row, xs_col, lane);
}
// the same, from the lane's two values (k = 64 c + 2 lane, + 1) already at hand
__device__ __forceinline__ void act8_quantize_pair(float2 v, int c, u8* dst_row, float* xs_col, int lane) {
    const float amax = warp_max(fmaxf(fabsf(v.x), fabsf(v.y)));
    const float inv = amax > 0.f ? __fdiv_rn(127.f, amax) : 0.f;
    const int q0 = max(-127, min(127, __float2int_rn(__fmul_rn(v.x, inv))));
    const int q1 = max(-127, min(127, __float2int_rn(__fmul_rn(v.y, inv))));
    // k = 2 lane, 2 lane + 1 -> s = k / 16, t = (k % 8) / 2, h = (k % 16) / 8; j = h (even k), 2 + h (odd)
    const int k = 2 * lane, s = k >> 4, t = (k & 7) >> 1, h = (k >> 3) & 1;
    u8* dst = dst_row + c * 64 + t * 16 + s * 4;
    dst[h] = (u8)(signed char)q0;
    dst[2 + h] = (u8)(signed char)q1;
    if (lane == 0) xs_col[c * GEMV_MAX_LANES] = __fdiv_rn(amax, 127.f);
}
