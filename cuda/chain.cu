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
