// Prefill through cuBLAS: packed weights -> row-major bf16 scratch, activations fp32 -> bf16,
// and the SwiGLU epilogue the GEMV fuses but a library GEMM cannot.
//
// Why: on the H200 cuBLAS bf16 runs the model's linear shapes at ~650 TFLOP/s while our
// mma.sync GEMM reaches ~120. For a prefill chunk of T tokens, expanding a layer's packed
// matrix to bf16 costs one read of the packed bytes and one write of 2 bytes per weight
// (~20 ms for the whole 27B), against 2 * 27e9 * T FLOP of matrix work (~85 ms at T = 1024,
// ~340 ms at T = 4096): the expansion is amortized over the chunk. The dequantized value is
// bf16(code * scale): the fp32 product is exact (<= 8-bit code x 11-bit fp16 scale), then one
// round to nearest even, so it differs from the GEMV's "exact code, scale applied per chunk in
// fp32" by at most half a bf16 ulp per weight: the prefill tolerance class (docs/PERF.md).
//
// Packed layout (q27py/gpu/layout.py is the spec): blocks of 16 rows x 64 k, tile-major, each
// a warp's mma.m16n8k16 A fragments; lane l: g = l / 4, t = l % 4, k = 16 s + 2 t.
#include "common.cuh"

// FMT_*, DQ_WARPS and DQ_LD come from the constants table (q27py/gpu/constants.py, -D defines).

// One warp expands one (tile, chunk) block into shared memory, then the warp writes the 16 x 64
// block out as 16-byte row segments (each row's 128 bytes are contiguous in the output).
// grid.x = ceil(row_tiles * kchunks / DQ_WARPS), block = 32 * DQ_WARPS.
template <int FMT>
__device__ __forceinline__ void dequant_body(const u8* __restrict__ codes, const u32* __restrict__ scales, int row_tiles,
                                             int kchunks, int ngroups, int group_chunks, u16* __restrict__ out,
                                             i64 ldo) {
    __shared__ __align__(16) u16 blk[DQ_WARPS][16 * DQ_LD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const i64 b = (i64)blockIdx.x * DQ_WARPS + warp;
    if (b >= (i64)row_tiles * kchunks) return;  // whole warp exits together (no block barrier below)
    const int tile = (int)(b / kchunks), chunk = (int)(b - (i64)tile * kchunks);
    u16* s = blk[warp];
    float s_lo = 1.f, s_hi = 1.f;  // scales of rows g and g + 8 for this chunk's group
    if (FMT != FMT_BF16) {
        const u32 pair = __ldg(scales + ((i64)tile * ngroups + chunk / group_chunks) * 8 + g);
        s_lo = half_to_float((u16)(pair & 0xffffu));
        s_hi = half_to_float((u16)(pair >> 16));
    }
    if (FMT == FMT_Q4) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(codes + b * 512) + lane);
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int st = 0; st < 4; st++) {
#pragma unroll
            for (int q = 0; q < 8; q++) {  // nibble slot q: pair p = q % 4, element e = q / 4
                const int p = q & 3, e = q >> 2;
                const int row = g + 8 * (p & 1), k = 16 * st + 2 * t + 8 * (p >> 1) + e;
                const float c = (float)((int)((w[st] >> (4 * q)) & 15u) - 8);
                s[row * DQ_LD + k] = float_to_bf16(c * (row < 8 ? s_lo : s_hi));
            }
        }
    } else if (FMT == FMT_Q8) {
#pragma unroll
        for (int jj = 0; jj < 2; jj++) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(codes + b * 1024 + jj * 512) + lane);
            const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int wi = 0; wi < 4; wi++) {  // (sub, word) = (wi / 2, wi % 2); byte bb: row g + 8 (bb % 2), k + bb / 2
                const int step = 2 * jj + (wi >> 1), word = wi & 1;
#pragma unroll
                for (int bb = 0; bb < 4; bb++) {
                    const int row = g + 8 * (bb & 1), k = 16 * step + 2 * t + 8 * word + (bb >> 1);
                    const float c = (float)((int)((w[wi] >> (8 * bb)) & 255u) - 128);
                    s[row * DQ_LD + k] = float_to_bf16(c * (row < 8 ? s_lo : s_hi));
                }
            }
        }
    } else {
#pragma unroll
        for (int st = 0; st < 4; st++) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(codes + b * 2048 + st * 512) + lane);
            const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int reg = 0; reg < 4; reg++) {  // a0..a3: row g + 8 (reg % 2), k + 8 (reg / 2), low half first
                const int row = g + 8 * (reg & 1), k = 16 * st + 2 * t + 8 * (reg >> 1);
                s[row * DQ_LD + k] = (u16)(w[reg] & 0xffffu);
                s[row * DQ_LD + k + 1] = (u16)(w[reg] >> 16);
            }
        }
    }
    __syncwarp();
    // 16 rows x 128 bytes = 128 uint4; lane moves 4 of them (8 lanes per row: 128 contiguous bytes)
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int idx = i * 32 + lane, row = idx >> 3, seg = idx & 7;
        const uint4 val = *reinterpret_cast<const uint4*>(s + row * DQ_LD + seg * 8);
        *reinterpret_cast<uint4*>(out + ((i64)tile * 16 + row) * ldo + (i64)chunk * 64 + seg * 8) = val;
    }
}

#define DQ_KERNEL(NAME, FMT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * DQ_WARPS)                                             \
        NAME(const u8* __restrict__ codes, const u32* __restrict__ scales, int row_tiles, int kchunks,      \
             int ngroups, int group_chunks, u16* __restrict__ out, long long ldo) {                        \
        dequant_body<FMT>(codes, scales, row_tiles, kchunks, ngroups, group_chunks, out, ldo);             \
    }

DQ_KERNEL(dequant_q4, FMT_Q4)
DQ_KERNEL(dequant_q8, FMT_Q8)
DQ_KERNEL(dequant_bf16, FMT_BF16)

// x fp32 [rows][ldx] (first `cols` columns) -> bf16 bits [rows][ldo], round to nearest even.
// cols must be a multiple of 4 (the packed K is a multiple of 64). grid (ceil(cols / 1024), rows), block 256.
extern "C" __global__ void f32_to_bf16_rows(const float* __restrict__ x, int ldx, int cols, u16* __restrict__ out,
                                            int ldo) {
    const int row = blockIdx.y, c = (blockIdx.x * 256 + threadIdx.x) * 4;
    if (c >= cols) return;
    const float4 v = *reinterpret_cast<const float4*>(x + (i64)row * ldx + c);
    uint2 o;
    o.x = pack_bf16x2(v.x, v.y);
    o.y = pack_bf16x2(v.z, v.w);
    *reinterpret_cast<uint2*>(out + (i64)row * ldo + c) = o;
}

// ---------------------------------------------------------------- small bf16 matrices: three bf16 terms
// (blas.prefill_gemm_split3, the GDN gates' ab for prefill chunks when EngineConfig.prefill_small_gemm is "bf16x3").
// Each fp32 value x becomes hi + mid + lo, three bf16 values: hi = bf16_rn(x) (f32_to_bf16_rows' conversion, so the
// bf16 rows a producer wrote for the cuBLAS route serve as hi), mid = bf16_rn(x - hi), lo = bf16_rn(x - hi - mid),
// each difference exact (the numpy spec, tests/gpu/test_prefill_split3.py split3_spec, computes them as IEEE fp32
// subtractions, subnormals kept). lo IS x - hi - mid whenever x's last significand bit is >= 2^-133, bf16's
// smallest subnormal (every |x| >= 2^-110; below that the split drops < 2^-134 per value): x = hi + mid + lo
// exactly, so W x = W hi + W mid + W lo with every bf16 x bf16 product exact. Inf / NaN: hi carries them,
// mid = lo = 0 for an infinite hi (y gets what a GEMM of x gives: Inf or NaN); a finite x that rounds to Inf in
// bf16 (|x| >= 2^128 (1 - 2^-9)) too; NaN x: all three NaN.
//
// The differences are integer arithmetic on the fp32 bit patterns, never fp32 subtractions: NVRTC compiles with
// -ftz=true (CuPy adds it; runtime.nvrtc_cubin too), which flushes every subnormal input and result of an fp32
// add / sub to zero -- the remainders of values below ~2^-103 can be subnormal, and device run j6 found 3,622 of
// 110,782 plane values of random fp32 inputs zeroed that way (the fp32 subtractions this replaced). The only
// floating-point instruction left is hi's cvt.rn.bf16x2.f32 (inline PTX, no .ftz: subnormals converted as IEEE
// says; the remainders are taken from the hi it actually gave). tests/gpu/test_prefill_split3.py checks the PTX
// of a -ftz=true build for that, and runs these helpers (__host__ __device__) in a CPU build against the numpy
// spec bit for bit.

// bf16 bits of finite fp32 bits f, round to nearest even (cvt.rn.bf16.f32 without .ftz, subnormals included);
// a finite f past bf16's range becomes Inf.
__host__ __device__ __forceinline__ u32 split3_rne_bits(u32 f) { return (f + 0x7fffu + ((f >> 16) & 1u)) >> 16; }

__host__ __device__ __forceinline__ int split3_msb(u32 n) {  // n > 0
#ifdef __CUDA_ARCH__
    return 31 - __clz((int)n);
#else
    return 31 - __builtin_clz(n);
#endif
}

// v - h as fp32 bits, exactly, for finite fp32 bits v and h = bf16 bits of v rounded to nearest (finite): +0 when
// equal (IEEE's x - x). Their magnitudes are in the same binade or h is the next power of two up (or 0 below
// bf16's subnormals), so the difference of the magnitude patterns counts v's ulps, 2^(max(E, 1) - 150) for v's
// biased exponent E: |v - h| = n 2^(e - 150), n <= 2^15, which fp32 holds exactly (normal or subnormal).
__host__ __device__ __forceinline__ u32 split3_residual_bits(u32 v, u32 h) {
    const u32 av = v & 0x7fffffffu, ah = (h & 0x7fffu) << 16;
    if (av == ah) return 0u;
    const u32 sign = (v & 0x80000000u) ^ (av < ah ? 0x80000000u : 0u);
    const u32 n = av > ah ? av - ah : ah - av;
    const int e = av >> 23 ? (int)(av >> 23) : 1;
    const int p = split3_msb(n);  // <= 15
    const int eb = p + e - 23;     // the result's biased exponent when normal
    if (eb >= 1) return sign | ((u32)eb << 23) | ((n << (23 - p)) & 0x7fffffu);
    return sign | (n << (e - 1));  // subnormal: n 2^(e - 150) = (n 2^(e - 1)) 2^-149
}

// x's fp32 bits and hi's bf16 bits (hi = bf16_rn(x)) -> mid / lo bf16 bits.
__host__ __device__ __forceinline__ void split3_tail_bits(u32 x, u32 hi, u32& mid, u32& lo) {
    if ((hi & 0x7f80u) == 0x7f80u) {  // hi Inf (x infinite or past bf16's range): 0; hi NaN (x NaN): NaN
        mid = lo = (hi & 0x7fu) ? 0x7fffu : 0u;
        return;
    }
    const u32 r = split3_residual_bits(x, hi);  // x - hi
    mid = split3_rne_bits(r);
    lo = split3_rne_bits(split3_residual_bits(r, mid));  // x - hi - mid
}

// Two values (fp32 bits) -> their hi / mid / lo bf16x2 words (low half = the first value).
__device__ __forceinline__ void split3_pair(u32 a, u32 b, u32& hi, u32& mid, u32& lo) {
    hi = pack_bf16x2(__uint_as_float(a), __uint_as_float(b));
    u32 ma, la, mb, lb;
    split3_tail_bits(a, hi & 0xffffu, ma, la);
    split3_tail_bits(b, hi >> 16, mb, lb);
    mid = ma | (mb << 16);
    lo = la | (lb << 16);
}

// fp32 rows [ntok][ldx] -> bf16 planes hi / mid / lo, each [ntok][ldo], columns [0, cols). hi may be null (the
// producer's bf16 rows are hi: then only mid and lo are written). cols % 4 == 0, 16-byte aligned rows (the
// kpad rows every GEMM input has). grid (ceil(cols / 1024), ntok), block 256: four columns per thread.
extern "C" __global__ void f32_split3_bf16_rows(const float* __restrict__ x, int ldx, int cols, u16* __restrict__ hi,
                                                u16* __restrict__ mid, u16* __restrict__ lo, int ldo) {
    const int row = blockIdx.y, c = (blockIdx.x * 256 + threadIdx.x) * 4;
    if (c >= cols) return;
    const uint4 v = *reinterpret_cast<const uint4*>(x + (i64)row * ldx + c);  // the bits: no fp32 op on them
    uint2 h, m, l;
    split3_pair(v.x, v.y, h.x, m.x, l.x);
    split3_pair(v.z, v.w, h.y, m.y, l.y);
    const i64 o = (i64)row * ldo + c;
    if (hi != nullptr) *reinterpret_cast<uint2*>(hi + o) = h;
    *reinterpret_cast<uint2*>(mid + o) = m;
    *reinterpret_cast<uint2*>(lo + o) = l;
}

// ---- the same three terms fused into one kernel (prefill_small_gemm "bf16x3f", blas.prefill_gemm_bf16x3f): each CTA
// splits its tokens' fp32 rows in registers and runs W hi / mid / lo on mma.sync, so no plane and no partial
// touches global memory. Why: the cuBLAS form reads x, writes mid / lo, reads them back and writes 18 partial
// products (~350 MB a 4,096-token chunk of the 27B) and its split pass is a launch of its own; the pedantic SGEMM
// runs at ~32 TFLOP/s (12 ms of an 8K prefill, device run q1, H100). Here x is read once (84 MB) and W (983 KB)
// comes from L2.
// Numerics: the split of the kernel above (hi = bf16_rn(x), mid = bf16_rn(x - hi), lo = bf16_rn(x - hi - mid),
// the differences exact), with the two subtractions as PTX sub.rn.f32 -- no .ftz, so subnormal remainders are
// kept whatever NVRTC's -ftz=true does to C++ arithmetic: the same planes as f32_split3_bf16_rows for every finite
// x whose hi is finite (an infinite hi gives NaN terms here, where the plane kernel writes 0). The products and
// their grouping follow the cuBLAS form: W hi accumulated in pieces of SPLIT3 columns (blas.SPLIT3_PIECE_CHUNKS 64-
// column chunks), the pieces added in K order, W mid and W lo each over the whole K, y = h + (lo + mid). The
// tensor cores' fp32 accumulation order differs from cuBLAS's, so the bits differ from "bf16x3"; the same error
// class (tests/gpu/test_prefill_split3.py holds both to the SGEMM's error against float64).
// Layout: W bf16 [MT * 16][kpad] (blas.weights_bf16_small), x fp32 [ntok][ldx], y fp32 [ntok][ldy]. CTA = 4 warps,
// 16 NTW tokens (C.GEMM3_NTW n8 tiles a warp): warp = (8 NTW tokens; row half: tiles rp, rp + 2, ...), each x value
// split by the two warps of its token group; per k16 step a warp runs 3 NTW ceil(MT / 2) mma.m16n8k16, one ldmatrix
// per row tile for its NTW tiles. Every CTA reads all of W (from L2): NTW = 2 halves that traffic against NTW = 1
// (126 against 252 MB a 4,096-token chunk of the 27B) for half the CTAs, and measured 0.4% slower on a whole 8K
// prefill (run q7, H100): NTW = 1, 1,024 warps a 4,096-token chunk (two a scheduler). Ring: GEMM3_STAGES stages of [MT * 16
// rows][64] bf16 W (16-byte granule c of row r at c ^ (r & 7): ldmatrix conflict-free) and [16 NTW tokens][64] fp32 x
// (granule c of token row r at c ^ (r & 7): a warp's float2 fragment reads take the minimum two wavefronts). Tokens
// past ntok load the last row and are not stored. grid ceil(ntok / (16 NTW)), block 128, dynamic smem GEMM3_STAGES *
// (MT * 2048 + 16 NTW * 256).
__device__ __forceinline__ float sub_rn_noftz(float a, float b) {
    float r;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// two fp32 values -> hi / mid / lo bf16x2 words (low half = the first value)
__device__ __forceinline__ void split3_regs(float a, float b, u32& hi, u32& mid, u32& lo) {
    hi = pack_bf16x2(a, b);
    const float ra = sub_rn_noftz(a, bf16x2_lo(hi)), rb = sub_rn_noftz(b, bf16x2_hi(hi));
    mid = pack_bf16x2(ra, rb);
    lo = pack_bf16x2(sub_rn_noftz(ra, bf16x2_lo(mid)), sub_rn_noftz(rb, bf16x2_hi(mid)));
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

template <int MT, int NTW>
__device__ __forceinline__ void gemm3_body(const u16* __restrict__ w, int kpad, const float* __restrict__ x, int ldx,
                                           int ntok, int nout, int add, float* __restrict__ y, int ldy, int piece) {
    // warp = (token group of 8 NTW tokens: warp >> 1, row half: warp & 1); the half takes row tiles rp, rp + 2, ...
    constexpr int TOK = 16 * NTW, MW = (MT + 1) / 2, WB = MT * 16 * 128, XB = TOK * 256, SB = WB + XB,
                  S = GEMM3_STAGES;
    extern __shared__ __align__(128) u8 g3_smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3, rp = warp & 1;
    const int tok0 = blockIdx.x * TOK;
    const u32 base = smem_addr(g3_smem);
    const int nst = kpad >> 6;
    auto issue = [&](int st, int slot) {
        const u32 sb = base + slot * SB;
        const int k0 = st << 6;
        for (int i = tid; i < MT * 16 * 8; i += 128) {  // W: row r, granule c
            const int r = i >> 3, c = i & 7;
            cp_async_cg16(sb + r * 128 + ((c ^ (r & 7)) << 4), w + (i64)r * kpad + k0 + c * 8);
        }
#pragma unroll
        for (int i = tid; i < TOK * 16; i += 128) {  // x: token row r, granule c
            const int r = i >> 4, c = i & 15;
            const int tk = min(tok0 + r, ntok - 1);
            cp_async_cg16(sb + WB + r * 256 + ((c ^ (r & 7)) << 4), x + (i64)tk * ldx + k0 + c * 4);
        }
    };
#pragma unroll
    for (int s = 0; s < S - 1; s++) {
        if (s < nst) issue(s, s);
        cp_async_commit();
    }
    float ph[MW][NTW][4], th[MW][NTW][4], pm[MW][NTW][4], pl[MW][NTW][4];
#pragma unroll
    for (int m = 0; m < MW; m++)
#pragma unroll
        for (int n = 0; n < NTW; n++)
#pragma unroll
            for (int q = 0; q < 4; q++) ph[m][n][q] = th[m][n][q] = pm[m][n][q] = pl[m][n][q] = 0.f;
    // ldmatrix.x4 row address of this lane: matrix lane / 8 = (row half, k half), row lane % 8
    const int arow = (lane & 7) + ((lane >> 3) & 1) * 8, akh = lane >> 4;
    const int xrow0 = (warp >> 1) * 8 * NTW + g;  // token row of n-tile n: xrow0 + 8 n (its row & 7 is g)
    int done = 0;  // W hi's k16 steps in the open piece
    for (int st = 0; st < nst; st++) {
        cp_async_wait<S - 2>();
        __syncthreads();  // stage st landed everywhere; every warp is past stage st - 1's slot
        if (st + S - 1 < nst) issue(st + S - 1, (st + S - 1) % S);
        cp_async_commit();
        const u32 sb = base + (st % S) * SB;
        const u8* xs = g3_smem + (st % S) * SB + WB + xrow0 * 256;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            // x[token][16 kk + 2t, +1] and [16 kk + 2t + 8, +9]: granules 4 kk + (t >> 1) (+2), float2 t & 1
            const int c0 = 4 * kk + (t >> 1), c1 = c0 + 2;
            u32 bh[NTW][2], bm[NTW][2], bl[NTW][2];
#pragma unroll
            for (int n = 0; n < NTW; n++) {
                const u8* xr = xs + n * 8 * 256;
                const float2 v0 = *reinterpret_cast<const float2*>(xr + ((c0 ^ g) << 4) + (t & 1) * 8);
                const float2 v1 = *reinterpret_cast<const float2*>(xr + ((c1 ^ g) << 4) + (t & 1) * 8);
                split3_regs(v0.x, v0.y, bh[n][0], bm[n][0], bl[n][0]);
                split3_regs(v1.x, v1.y, bh[n][1], bm[n][1], bl[n][1]);
            }
#pragma unroll
            for (int mi = 0; mi < MW; mi++) {
                const int m = rp + 2 * mi;
                if (m < MT) {  // warp-uniform
                    const int r = m * 16 + arow, c = 2 * kk + akh;
                    u32 a0, a1, a2, a3;
                    ldsm_x4(sb + r * 128 + ((c ^ (r & 7)) << 4), a0, a1, a2, a3);
#pragma unroll
                    for (int n = 0; n < NTW; n++) {
                        float* q0 = ph[mi][n];
                        float* q1 = pm[mi][n];
                        float* q2 = pl[mi][n];
                        mma_bf16_16816(q0[0], q0[1], q0[2], q0[3], a0, a1, a2, a3, bh[n][0], bh[n][1]);
                        mma_bf16_16816(q1[0], q1[1], q1[2], q1[3], a0, a1, a2, a3, bm[n][0], bm[n][1]);
                        mma_bf16_16816(q2[0], q2[1], q2[2], q2[3], a0, a1, a2, a3, bl[n][0], bl[n][1]);
                    }
                }
            }
        }
        done += 4;
        if (done == piece || st + 1 == nst) {  // a piece of W hi ends: h += piece (the first: 0 + piece, exact)
#pragma unroll
            for (int m = 0; m < MW; m++)
#pragma unroll
                for (int n = 0; n < NTW; n++)
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        th[m][n][q] += ph[m][n][q];
                        ph[m][n][q] = 0.f;
                    }
            done = 0;
        }
    }
    cp_async_wait<0>();
    // thread (g, t): rows 16 m + g (+8), tokens tok0 + 8 NTW (warp >> 1) + 8 n + 2t (+1)
#pragma unroll
    for (int mi = 0; mi < MW; mi++)
#pragma unroll
        for (int n = 0; n < NTW; n++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int r = (rp + 2 * mi) * 16 + g + 8 * (q >> 1);
                const int tk = tok0 + (warp >> 1) * 8 * NTW + 8 * n + 2 * t + (q & 1);
                if (rp + 2 * mi < MT && r < nout && tk < ntok) {
                    const float v = th[mi][n][q] + (pl[mi][n][q] + pm[mi][n][q]);
                    float* yr = y + (i64)tk * ldy + r;
                    *yr = add ? *yr + v : v;
                }
            }
}

// gemm3_small_m<MT>: MT row tiles, GEMM3_NTW n8 token tiles a warp (1 measured faster than 2 end to end: run q7)
#define GEMM3_KERNEL(MT)                                                                                               \
    extern "C" __global__ void __launch_bounds__(128) gemm3_small_m##MT(                                             \
        const u16* __restrict__ w, int kpad, const float* __restrict__ x, int ldx, int ntok, int nout, int add,       \
        float* __restrict__ y, int ldy, int piece) {                                                                  \
        gemm3_body<MT, GEMM3_NTW>(w, kpad, x, ldx, ntok, nout, add, y, ldy, piece);                                   \
    }
GEMM3_KERNEL(1)
GEMM3_KERNEL(2)
GEMM3_KERNEL(3)
GEMM3_KERNEL(4)
GEMM3_KERNEL(5)
GEMM3_KERNEL(6)
GEMM3_KERNEL(7)
GEMM3_KERNEL(8)

// y[t][r] (MODE_ADD: +)= the three-term route's fp32 partial products, t < ntok, r < nout. part holds
// npieces + 2 blocks of [ntok][ldp] (pstride floats apart; cuBLAS's column-major nout x ntok outputs):
// W hi over the K pieces in K order, then W mid, then W lo. Summed smallest first, round to nearest:
// s = lo + mid; h = the hi pieces in order; y = h + s (add: y + (h + s)). grid ceil(ntok * nout / 256), block 256.
extern "C" __global__ void split3_combine(const float* __restrict__ part, int ldp, long long pstride, int npieces,
                                          int nout, int ntok, int add, float* __restrict__ y, int ldy) {
    const int i = blockIdx.x * 256 + threadIdx.x;
    if (i >= ntok * nout) return;
    const int t = i / nout, r = i - t * nout;
    const float* p = part + (i64)t * ldp + r;
    const float s = p[(i64)(npieces + 1) * pstride] + p[(i64)npieces * pstride];
    float h = p[0];
    for (int k = 1; k < npieces; k++) h += p[(i64)k * pstride];
    float* yr = y + (i64)t * ldy + r;
    *yr = add ? *yr + (h + s) : h + s;
}

// SwiGLU over a GEMM output whose 16-row tiles are 8 gate rows then the matching 8 up rows
// (layout.interleave_gate_up): y[t][o] = silu(g) * u for o < nout, g = z[t][16 (o/8) + o%8],
// u = z[t][16 (o/8) + 8 + o%8]. grid (ceil(nout / 256), ntok), block 256.
extern "C" __global__ void swiglu_tiles(const float* __restrict__ z, int ldz, int nout, float* __restrict__ y,
                                        int ldy) {
    const int tok = blockIdx.y, o = blockIdx.x * 256 + threadIdx.x;
    if (o >= nout) return;
    const float* zr = z + (i64)tok * ldz + (o >> 3) * 16 + (o & 7);
    const float gt = zr[0], up = zr[8];
    y[(i64)tok * ldy + o] = gt * sigmoid_f(gt) * up;
}

// swiglu_tiles writing the bf16 copy of its rows only (the down projection's cuBLAS input): the same
// product per output, rounded as f32_to_bf16_rows rounds swiglu_tiles' fp32 rows. Why: the fp32 rows
// were written, read back and converted for nothing else (device run g5: SwiGLU + conversions 65 ms of
// an 8K prefill). Two outputs per thread (o even: both in one 8-row group, float2 loads).
// grid (ceil(nout / 512), ntok), block 256.
extern "C" __global__ void swiglu_tiles_bf16(const float* __restrict__ z, int ldz, int nout, u16* __restrict__ y,
                                             int ldy) {
    const int tok = blockIdx.y, o = (blockIdx.x * 256 + threadIdx.x) * 2;
    if (o >= nout) return;
    const float* zr = z + (i64)tok * ldz + (o >> 3) * 16 + (o & 7);
    const float2 gt = *reinterpret_cast<const float2*>(zr), up = *reinterpret_cast<const float2*>(zr + 8);
    const float a = gt.x * sigmoid_f(gt.x) * up.x;
    u16* yr = y + (i64)tok * ldy + o;
    if (o + 1 < nout)
        *reinterpret_cast<u32*>(yr) = pack_bf16x2(a, gt.y * sigmoid_f(gt.y) * up.y);
    else
        yr[0] = bf16_rn(a);
}

// SwiGLU over a gate_up GEMM output that cuBLAS wrote as bf16 (EngineConfig.prefill_gate_up_bf16, off by default:
// the GEMM keeps fp32 accumulation and rounds each gate / up value to bf16, nearest even, once). Same tiles as
// swiglu_tiles (8 gate rows, then the matching 8 up rows), each value widened exactly, then swiglu_tiles' product
// per output in fp32, g * sigmoid_f(g) * u: so the output is bitwise swiglu_tiles / swiglu_tiles_bf16 run on fp32
// rows holding those bf16 values (tests/gpu/test_gate_up_bf16_gpu.py). Why: the fp32 rows were twice this pass's
// input bytes (27B, 8K tokens: 1.14 -> 0.57 GB per layer; docs/QUANT.md "bf16 gate_up before SwiGLU").
// One thread per 8-row group: its 8 gate and 8 up values are two 16-byte loads (z 16-byte aligned, ldz a multiple
// of 8: the GEMM's rows are row_tiles * 16), its 8 outputs one store where aligned and inside nout, else one by one.
__device__ __forceinline__ void swiglu_group_bf16(const u16* __restrict__ z, int ldz, int tok, int grp, float (&a)[8]) {
    const uint4* zr = reinterpret_cast<const uint4*>(z + (i64)tok * ldz + (i64)grp * 16);
    const uint4 g = zr[0], u = zr[1];
    const u32 gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float g0 = bf16x2_lo(gw[j]), g1 = bf16x2_hi(gw[j]);
        a[2 * j] = g0 * sigmoid_f(g0) * bf16x2_lo(uw[j]);
        a[2 * j + 1] = g1 * sigmoid_f(g1) * bf16x2_hi(uw[j]);
    }
}

// fp32 outputs (swiglu_tiles' rows). grid (ceil(nout / 2048), ntok), block 256.
extern "C" __global__ void swiglu_tiles_zbf16(const u16* __restrict__ z, int ldz, int nout, float* __restrict__ y,
                                              int ldy) {
    const int tok = blockIdx.y, grp = blockIdx.x * 256 + threadIdx.x, o = grp * 8;
    if (o >= nout) return;
    float a[8];
    swiglu_group_bf16(z, ldz, tok, grp, a);
    float* yr = y + (i64)tok * ldy + o;
    if (o + 8 <= nout && (reinterpret_cast<size_t>(yr) & 15) == 0) {
        reinterpret_cast<float4*>(yr)[0] = make_float4(a[0], a[1], a[2], a[3]);
        reinterpret_cast<float4*>(yr)[1] = make_float4(a[4], a[5], a[6], a[7]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (o + i < nout) yr[i] = a[i];
    }
}

// bf16 outputs (swiglu_tiles_bf16's rows: the down projection's cuBLAS input, each product rounded once).
// grid (ceil(nout / 2048), ntok), block 256.
extern "C" __global__ void swiglu_tiles_zbf16_bf16(const u16* __restrict__ z, int ldz, int nout, u16* __restrict__ y,
                                                   int ldy) {
    const int tok = blockIdx.y, grp = blockIdx.x * 256 + threadIdx.x, o = grp * 8;
    if (o >= nout) return;
    float a[8];
    swiglu_group_bf16(z, ldz, tok, grp, a);
    u16* yr = y + (i64)tok * ldy + o;
    if (o + 8 <= nout && (reinterpret_cast<size_t>(yr) & 15) == 0) {
        *reinterpret_cast<uint4*>(yr) = make_uint4(pack_bf16x2(a[0], a[1]), pack_bf16x2(a[2], a[3]),
                                                   pack_bf16x2(a[4], a[5]), pack_bf16x2(a[6], a[7]));
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (o + i < nout) yr[i] = bf16_rn(a[i]);
    }
}

// ---------------------------------------------------------------- fp8 prefill route (blas.prefill_gemm_fp8)
// The 8-bit activation path of issue 14: weights and activations as e4m3 codes, multiplied by
// cuBLASLt's fp8 tensor-core GEMM (fp32 accumulate and output). Every scale is a power of two, so
// scaling is exact and only the two e4m3 roundings (3 mantissa bits, relative <= 2^-4) differ from
// the bf16 route: its own tolerance class (docs/QUANT.md "fp8 prefill"), gated on the trained model.
// Weights: value = e4m3(code * scale * 2^-ew), one exponent ew per matrix (its max |code * scale|
// lands in [128, 256): fp8_row_exponent); e4m3 keeps 2^-4 relative precision over ~2^15 of range
// below that, wider than any q4 / q8 matrix's spread of group scales.
// Activations: value = e4m3(x * 2^-e_t), one exponent per token row (outlier tokens do not squash
// the others into subnormals), applied back after the GEMM (fp8_scale_rows / swiglu_tiles_scaled).

// One warp turns one (tile, chunk) block into e4m3 bytes of a row-major [row_tiles * 16][ldo] u8
// scratch. grid.x = ceil(row_tiles * kchunks / DQ_WARPS), block = 32 * DQ_WARPS.
template <int FMT>
__device__ __forceinline__ void dequant_fp8_body(const u8* __restrict__ codes, const u32* __restrict__ scales,
                                                 int row_tiles, int kchunks, int ngroups, int group_chunks,
                                                 float inv_pow2, u8* __restrict__ out, i64 ldo) {
    __shared__ __align__(16) u8 blk[DQ_WARPS][16 * 80];  // 64 bytes per row + 16 pad (bank spread)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const i64 b = (i64)blockIdx.x * DQ_WARPS + warp;
    if (b >= (i64)row_tiles * kchunks) return;
    const int tile = (int)(b / kchunks), chunk = (int)(b - (i64)tile * kchunks);
    u8* s = blk[warp];
    const u32 pair = __ldg(scales + ((i64)tile * ngroups + chunk / group_chunks) * 8 + g);
    const float s_lo = half_to_float((u16)(pair & 0xffffu)) * inv_pow2;  // exact: a power of two
    const float s_hi = half_to_float((u16)(pair >> 16)) * inv_pow2;
    if (FMT == FMT_Q4) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(codes + b * 512) + lane);
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int st = 0; st < 4; st++) {
#pragma unroll
            for (int q = 0; q < 8; q++) {
                const int p = q & 3, e = q >> 2;
                const int row = g + 8 * (p & 1), k = 16 * st + 2 * t + 8 * (p >> 1) + e;
                const float c = (float)((int)((w[st] >> (4 * q)) & 15u) - 8);
                s[row * 80 + k] = float_to_e4m3(c * (row < 8 ? s_lo : s_hi));
            }
        }
    } else {
#pragma unroll
        for (int jj = 0; jj < 2; jj++) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(codes + b * 1024 + jj * 512) + lane);
            const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int wi = 0; wi < 4; wi++) {
                const int step = 2 * jj + (wi >> 1), word = wi & 1;
#pragma unroll
                for (int bb = 0; bb < 4; bb++) {
                    const int row = g + 8 * (bb & 1), k = 16 * step + 2 * t + 8 * word + (bb >> 1);
                    const float c = (float)((int)((w[wi] >> (8 * bb)) & 255u) - 128);
                    s[row * 80 + k] = float_to_e4m3(c * (row < 8 ? s_lo : s_hi));
                }
            }
        }
    }
    __syncwarp();
    // 16 rows x 64 bytes = 64 uint4: two per lane (4 lanes per row)
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int idx = i * 32 + lane, row = idx >> 2, seg = idx & 3;
        const uint4 val = *reinterpret_cast<const uint4*>(s + row * 80 + seg * 16);
        *reinterpret_cast<uint4*>(out + ((i64)tile * 16 + row) * ldo + (i64)chunk * 64 + seg * 16) = val;
    }
}

#define DQ8_KERNEL(NAME, FMT)                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * DQ_WARPS)                                             \
        NAME(const u8* __restrict__ codes, const u32* __restrict__ scales, int row_tiles, int kchunks,      \
             int ngroups, int group_chunks, float inv_pow2, u8* __restrict__ out, long long ldo) {         \
        dequant_fp8_body<FMT>(codes, scales, row_tiles, kchunks, ngroups, group_chunks, inv_pow2, out, ldo); \
    }

DQ8_KERNEL(dequant_q4_fp8, FMT_Q4)
DQ8_KERNEL(dequant_q8_fp8, FMT_Q8)

// x fp32 [rows][ldx] (first cols columns, the rest of ldo zero-filled up to ldo) -> e4m3 codes
// [rows][ldo] with one power-of-two scale per row: scale[row] = 2^e, e = fp8_row_exponent(amax)
// (amax * 2^-e in [128, 256)). grid rows, block 1024.
extern "C" __global__ void f32_to_fp8_rows(const float* __restrict__ x, int ldx, int cols, u8* __restrict__ out,
                                           int ldo, float* __restrict__ scale) {
    __shared__ float red[32];
    const int row = blockIdx.x;
    const float* xr = x + (i64)row * ldx;
    float m = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, fabsf(xr[c]));
    m = block_max(m, red);
    const int e = fp8_row_exponent(m);
    const float inv = exp2_int(-e);
    if (threadIdx.x == 0) scale[row] = exp2_int(e);
    u8* orow = out + (i64)row * ldo;
    for (int c = threadIdx.x * 4; c < ldo; c += blockDim.x * 4) {
        u32 word = 0;
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (c + j < cols) word |= (u32)float_to_e4m3(xr[c + j] * inv) << (8 * j);
        *reinterpret_cast<u32*>(orow + c) = word;
    }
}

// y[t][0..n) *= scale[t] (inverse: *= 1 / scale[t]; exact, powers of two). grid (ceil(n / 1024), ntok), block 256.
extern "C" __global__ void fp8_scale_rows(float* __restrict__ y, int ldy, int n, const float* __restrict__ scale,
                                          int inverse) {
    const int tok = blockIdx.y;
    const float s = inverse ? 1.f / scale[tok] : scale[tok];
    float* yr = y + (i64)tok * ldy;
    for (int c = blockIdx.x * 1024 + threadIdx.x; c < min(n, (blockIdx.x + 1) * 1024); c += 256) yr[c] *= s;
}

// swiglu_tiles over an unscaled fp8 GEMM output: gate and up rows are multiplied by the token's
// scale first (exact), then the same math. grid (ceil(nout / 256), ntok), block 256.
extern "C" __global__ void swiglu_tiles_scaled(const float* __restrict__ z, int ldz, int nout, float* __restrict__ y,
                                               int ldy, const float* __restrict__ scale) {
    const int tok = blockIdx.y, o = blockIdx.x * 256 + threadIdx.x;
    if (o >= nout) return;
    const float s = scale[tok];
    const float* zr = z + (i64)tok * ldz + (o >> 3) * 16 + (o & 7);
    const float gt = zr[0] * s, up = zr[8] * s;
    y[(i64)tok * ldy + o] = gt * sigmoid_f(gt) * up;
}
