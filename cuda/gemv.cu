// Weight-streaming GEMV for 1..16 lanes (decode, MTP drafts, verify), on tensor cores.
//
// y[lane][row] = sum_k W[row][k] * x[lane][k] for up to 16 lanes per launch, W in one of
// three packed formats (docs/FORMAT.md, "packed matrices"):
//   FMT_BF16: raw bf16 weights         activations enter as bf16 hi + lo (~16 bits): fp32-grade
//   FMT_Q8:   int8 codes, fp16 scale per (row, 128 k)   activations rounded to bf16 once
//   FMT_Q4:   int4 codes, fp16 scale per (row, 64 k)    activations rounded to bf16 once
// Weights are stored in mma.m16n8k16 A-fragment order, 16 rows x 64 k per "chunk", so each
// thread's 16-byte load is exactly its fragment (no shuffles, fully coalesced 512-byte warp
// loads). Codes dequantize to bf16 exactly (magic-number trick) and accumulate in fp32; per
// chunk partial sums are scaled in fp32. For bf16 weights the activations are split into bf16
// hi + lo (x = hi + lo to ~16 bits), so that path matches fp32 math to ~1e-5; for quantized
// weights one bf16 rounding of the activations (2^-9) is far below the weight error and
// halves the tensor-core and conversion work.
//
// Work split: a CTA of 8 warps owns a unit = (R=4 row tiles = 64 rows, K split); its warps
// interleave over the unit's chunks, each streaming through its own cp.async ring, then
// reduce through shared memory in fixed order. Long K is split over `splits` CTAs whose
// partials the last-arriving CTA sums in fixed order (integer ticket, no float atomics): the
// bits never depend on timing, and never on the lane count (splits depend on the matrix
// shape only), so lane t's output is the same for every launch width.
//
// One launch may run up to 4 matrices that read the same x (e.g. GDN in_proj + gates):
// descriptors live in device memory (int64 fields, below).
//
// The a8 kernels (gemv8_*: q4 / q8 weights only) take the activations as int8 instead: one
// code per k and one fp32 scale per (lane, 64-k chunk), made by quant_act8 below (absmax / 127,
// round to nearest even), and run mma.m16n8k32 s8 x s8 -> s32 on the same weight bytes. Why:
// the bf16 path spends ~48 of its ~66 instructions per 16 weight bytes on unpacking nibbles to
// bf16 and on 4 bf16 mma; the int8 path unpacks 8 nibbles in 3 integer ops (the nibble lands in
// the high half of a byte: byte = 16 x code, exact) and needs 2 mma, so the loop is ~2x shorter
// and the kernel can stay on the memory roofline instead of the issue limit. The int8 rounding of
// the activations (2^-8 of each chunk's max) is a numerics change: it is its own tier ("a8",
// EngineConfig.gemv_act) with a measured quality gate; the bf16 path stays selectable.
// Activation bytes sit in fragment order: per (lane, chunk) 64 bytes, byte t*16 + s*4 + j holds
// k = 16 s + 2 t + {0, 8, 1, 9}[j] -- exactly the k slots whose weights thread (g, t) holds in
// both the q4 and the q8 layout (docs/FORMAT.md), so one 16-byte load gives a thread both B
// fragments of both k32 steps of a chunk, and the weight file format does not change.
#include "common.cuh"

#include "gemv_common.cuh"
#include "gemv_v1.cuh"

// One kernel per (format, lane tiles): all matrices of one launch share the format.
// 8 lanes fit 128 registers (two CTAs per SM); 16 lanes need ~190 (one CTA per SM).
// Dynamic shared memory: max(ring_bytes<FMT>(), 8 x 64 x NT*8 x 4 reduction bytes).
#define GEMV_KERNEL(NAME, FMT, NT, MINB)                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MINB)                                                \
        NAME(const i64* __restrict__ desc, int nmat, int units, const float* __restrict__ x, int ldx,       \
             int nlanes, int lane0, const unsigned long long* __restrict__ pf) {                           \
        gemv_body<FMT, NT, false>(desc, nmat, units, x, ldx, nullptr, 0, nullptr, 0u, nlanes, lane0, pf);  \
    }

// a8: xq int8 codes [nlanes][ldq bytes] in fragment order, xs chunk scales [kch][GEMV_MAX_LANES],
// sgn = 0x80808080 (q4_lo8). pf (both kinds): [units][GEMV_PF_PER] next-launch prefetch words, or null.
#define GEMV8_KERNEL(NAME, FMT, NT, MINB)                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MINB)                                      \
        NAME(const i64* __restrict__ desc, int nmat, int units, const u8* __restrict__ xq, int ldq,          \
             const float* __restrict__ xs, u32 sgn, int nlanes, int lane0,                                   \
             const unsigned long long* __restrict__ pf) {                                                    \
        gemv_body<FMT, NT, true>(desc, nmat, units, nullptr, 0, xq, ldq, xs, sgn, nlanes, lane0, pf);        \
    }

GEMV_KERNEL(gemv_q4_nt1, FMT_Q4, 1, V1_CTAS_NT1)
GEMV_KERNEL(gemv_q4_nt2, FMT_Q4, 2, V1_CTAS_NT2)
GEMV_KERNEL(gemv_q8_nt1, FMT_Q8, 1, V1_CTAS_NT1)
GEMV_KERNEL(gemv_q8_nt2, FMT_Q8, 2, V1_CTAS_NT2)
GEMV_KERNEL(gemv_bf16_nt1, FMT_BF16, 1, V1_CTAS_BF16)
GEMV_KERNEL(gemv_bf16_nt2, FMT_BF16, 2, V1_CTAS_BF16)

GEMV8_KERNEL(gemv8_q4_nt1, FMT_Q4, 1, A8_CTAS_NT1)
GEMV8_KERNEL(gemv8_q4_nt2, FMT_Q4, 2, A8_CTAS_NT2)
GEMV8_KERNEL(gemv8_q8_nt1, FMT_Q8, 1, A8_CTAS_NT1)
GEMV8_KERNEL(gemv8_q8_nt2, FMT_Q8, 2, A8_CTAS_NT2)


// Activations -> int8 codes in fragment order + one fp32 scale per (lane, 64-k chunk), for the
// a8 kernels. grid (ceil(kch / 8), nlanes), block 256: a warp per chunk, 2 values per thread.
// scale = amax / 127, code = rint(x * (127 / amax)) (IEEE divisions, no contraction: the numpy
// spec in q27py/gpu/layout.py quantize_act8 gives the same bits); an all-zero chunk has scale 0.
// Columns k >= K (inside the padded row) must read as zero: the fp32 rows keep their pads zero.
extern "C" __global__ void quant_act8(const float* __restrict__ x, int ldx, int kch, u8* __restrict__ xq, int ldq,
                                      float* __restrict__ xs) {
    pdl_entry();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c = blockIdx.x * 8 + warp, row = blockIdx.y;
    if (c >= kch) return;
    act8_quantize_chunk(x + (i64)row * ldx, c, xq + (i64)row * ldq, xs + row, lane);
}
