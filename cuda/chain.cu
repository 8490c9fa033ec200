// Device-side glue of the MTP draft chain (q27py/gpu/forward.py FastModel.mtp_draft_chain).
//
// Why: on the host path each MTP draft step is a round trip -- download a 248K-float logits row,
// argmax it on the host, upload the token and the hidden row -- about 0.3 ms of host and PCIe
// time per step against a 0.5 ms step on the device. Here the step's argmax (top2 kernel) stays
// on the device and this kernel feeds it to the next step, so a whole ladder is one CUDA graph
// and the host downloads `depth` ids and margins once.
#include "common.cuh"

// One launch between two MTP steps (block 256, grid 1):
//   draft[k] = tok[0]; margin_out[k] = margin[0];                 (record step k's draft)
//   if feed: mtp_ids[0] = tok[0]; hidden_in[0, :h] = out_row[:h];  (inputs of step k + 1)
//            ctl[1] += advance                                     (its position)
extern "C" __global__ void mtp_chain_step(const int* __restrict__ tok, const float* __restrict__ margin,
                                          int* __restrict__ draft, float* __restrict__ margin_out, int k, int feed,
                                          int* __restrict__ mtp_ids, float* __restrict__ hidden_in,
                                          const float* __restrict__ out_row, int h, int* __restrict__ ctl,
                                          int advance) {
    pdl_entry();
    if (threadIdx.x == 0) {
        draft[k] = tok[0];
        margin_out[k] = margin[0];
        if (feed) {
            mtp_ids[0] = tok[0];
            ctl[1] += advance;
        }
    }
    if (feed)
        for (int i = threadIdx.x; i < h; i += blockDim.x) hidden_in[i] = out_row[i];
}

// ---------------------------------------------------------------- mtp_draft_batch (FastModel.enqueue_mtp_batch)
// B chains in one MTP sweep per step. Step 0 runs every chain's backlog rows as a group of consecutive lane
// rows (common.cuh group table); each later step one lane per chain (a group table of widths 1). These two
// kernels are the step glue, the solo chain's mtp_chain_step split in two around the lm_head.

// Before a step's lm_head (grid B, block 256): row b of dst = row GT_FIRST[b] + GT_COUNT[b] - 1 of src, h floats
// -- chain b's last row of the step (what its solo chain's lm_head reads and feeds to its next step), so the
// lm_head and argmax run over B consecutive rows and dst holds the next step's hidden inputs. A copy: no math.
extern "C" __global__ void mtp_gather_last(const float* __restrict__ src, int lds, const int* __restrict__ groups,
                                           float* __restrict__ dst, int ldd, int h) {
    pdl_entry();
    const int b = blockIdx.x;
    const int r = group_field(groups, GT_FIRST, b) + group_field(groups, GT_COUNT, b) - 1;
    for (int i = threadIdx.x; i < h; i += blockDim.x) dst[(i64)b * ldd + i] = src[(i64)r * lds + i];
}

// After a step's argmax (grid 1, block >= B): chain b's draft and margin of step k into its row of out (depth
// ids, then depth margins as float bits: one download for every chain), and if feed, the inputs of step k + 1
// in the chain steps' lane table `lanes`: its token id (the embed reads it there) and its position += advance.
extern "C" __global__ void mtp_chain_step_lanes(const int* __restrict__ tok, const float* __restrict__ margin,
                                                int* __restrict__ out, int depth, int k, int feed,
                                                i64* __restrict__ lanes, int advance, int nchains) {
    pdl_entry();
    const int b = threadIdx.x;
    if (b >= nchains) return;
    const int id = tok[b];
    out[(i64)b * 2 * depth + k] = id;
    out[(i64)b * 2 * depth + depth + k] = __float_as_int(margin[b]);
    if (feed) {
        int* pos = reinterpret_cast<int*>(lanes + LANES_MAX * LT_NFIELDS);  // common.cuh lane_positions
        pos[LANES_MAX + b] = id;  // the ids follow the positions (FastModel lane_table_ids_offset)
        pos[b] += advance;
    }
}
