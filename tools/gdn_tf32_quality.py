"""CPU study of a prefill lever (issue 14): the chunked GDN prefill's matrix products on TF32 operands.

The chunked2 GDN prefill (cuda/gdn_chunk2.cu, spec q27py/model/gdn_chunked.py gdn_chunked_wy) runs in
three phases: "prep" (per chunk, independent of the state: A = b e^{G_i-G_m} K K^T and the blockwise
solve for W = T diag(b e^G) K, U = T diag(b) V), "state" (the walk over chunks: V_new = U - W S,
S <- e^{G_n} S + K^T diag(e^{G_n-G}) V_new) and "out" (O = e^G Q S + (M o Q K^T) V_new). Every
product runs in 3xTF32 today (fp32-grade) because the state recurrence compounds over hundreds of
chunks. "tf32 out" (docs/QUANT.md, measured, off) runs the output pass in one TF32 product a mma;
it moves only O. The class under study here, "tf32 state", does the same for the W/U pre-pass and
the state recurrence: one TF32 product a mma instead of 3xTF32 in gdn2_prep1_* / gdn2_state1_*.
Unlike "tf32 out", its error lands in the recurrent state itself, so it compounds over the chunks
of a prefill and is carried by everything after it: the GDN state handed to the next prefill piece,
every prefix snapshot taken at a chunk boundary, and every decode step after the prefill. This
measures what that does to the trained models' next-token distributions.

The model is the CPU fast path (q27py/model/fastcpu.py, fp32, bf16 checkpoint weights exactly) with
one change, in this tool only (a FastCPUModel subclass; the engine is untouched): the GDN prefill
pieces (the branch that runs fastcpu.gdn_chunked: not a verify, more than SMALL_T tokens) run
gdn_chunked_wy(..., pos0=<absolute position of the piece's first token>, tf32=<phases>), with the
GPU's chunk (64 tokens) aligned at absolute multiples of it, as the kernels align them. Decode,
verify and short pieces (gdn_steps) are fastcpu's as shipped. The absolute position is the forward's
start (SequenceState.position): neither _gdn nor GDNState carries it, so the subclass records it in
forward. Configurations (tf32 phases):

    wy     ()                          the fp32 reference in the kernels' three-phase order
    out    ("out",)                    the "tf32 out" class (the shipped switch)
    state  ("prep", "state")           the "tf32 state" class (the lever)
    all    ("prep", "state", "out")    both

Pairs (reference, variant): out vs wy, state vs wy, all vs wy. The error class, not the kernels'
bits (the CPU sums run in numpy's order, not mma order). Every GDN layer is affected at every
prefill position (pieces of --chunk tokens, as the GPU prefill runs them); each configuration
carries its own state through the whole text, so the state's error accumulates as it would over a
long prompt. Text, metrics, CLI and JSON: tools/quality_study.py (shared with
tools/swiglu_bf16_quality.py).

    PYTHONPATH=. OMP_NUM_THREADS=2 python3 tools/gdn_tf32_quality.py [--tokens 3072] [--chunk 512] [--json out.json]

(both bundled models, defaults: about 105 s on 2 CPU cores.)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import quality_study  # noqa: E402
from q27py.model import fastcpu  # noqa: E402
from q27py.model.fastcpu import FastCPUModel  # noqa: E402
from q27py.model.gdn_chunked import gdn_chunked_wy  # noqa: E402

TF32 = {"wy": (), "out": ("out",), "state": ("prep", "state"), "all": ("prep", "state", "out")}
CONFIGS = tuple(TF32)
PAIRS = (("wy", "out"), ("wy", "state"), ("wy", "all"))  # (reference, variant)


class GdnTf32StudyModel(FastCPUModel):
    """FastCPUModel whose GDN prefill pieces run gdn_chunked_wy with the TF32 phases of `mode`."""

    mode = "wy"
    _pos0 = 0  # absolute position of the first token of the forward in flight

    def forward(self, state, ids, logits_rows="all", verify: bool = False):
        self._pos0 = state.position  # ReferenceModel.forward's start; _gdn is not told it
        return super().forward(state, ids, logits_rows=logits_rows, verify=verify)

    def _gdn(self, x, p, st, record):
        pos0, tf32 = self._pos0, TF32[self.mode]

        def chunked(q, k, v, g, beta, state):
            return gdn_chunked_wy(q, k, v, g, beta, state, pos0=pos0, tf32=tf32)

        # fastcpu's _gdn calls the module-level name for exactly the prefill branch; swap it for
        # this call only, so the rest of _gdn (projections, conv, gates, norm) stays fastcpu's own.
        shipped = fastcpu.gdn_chunked
        fastcpu.gdn_chunked = chunked
        try:
            return super()._gdn(x, p, st, record)
        finally:
            fastcpu.gdn_chunked = shipped


def main(argv=None) -> int:
    return quality_study.main(GdnTf32StudyModel, CONFIGS, PAIRS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
