// Token embedding gather: one row of the table per lane, dequantized to fp32.
// Tables are row-major (not fragment-packed): fp32, bf16 bits, or int8 codes with an fp16
// scale per (row, group) (docs/FORMAT.md "row tables").
#include "common.cuh"


// grid (nlanes), block 256. ids live on the device so the launch can sit in a CUDA graph.
extern "C" __global__ void embed_rows(const int* __restrict__ ids, const void* __restrict__ table, int fmt, i64 ld_table,
                                      const u16* __restrict__ scales, int ngroups, int group, int H,
                                      float* __restrict__ out, int ldo) {
    pdl_entry();
    const int t = blockIdx.x;
    const i64 row = ids[t];
    float* dst = out + (i64)t * ldo;
    for (int k = threadIdx.x; k < H; k += blockDim.x) {
        float v;
        if (fmt == TAB_F32)
            v = reinterpret_cast<const float*>(table)[row * ld_table + k];
        else if (fmt == TAB_BF16)
            v = bf16_to_float(reinterpret_cast<const u16*>(table)[row * ld_table + k]);
        else
            v = (float)reinterpret_cast<const signed char*>(table)[row * ld_table + k] *
                half_to_float(scales[row * ngroups + k / group]);
        dst[k] = v;
    }
}
