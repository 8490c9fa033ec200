"""CPU study of a prefill lever (issue 14): cuBLAS writing the MLP's gate and up rows as bf16.

The CUDA prefill computes gate_up with cuBLAS into fp32 rows, then SwiGLU silu(gate) * up in fp32,
rounded once to bf16 (the down projection's input: cuda/dequant.cu swiglu_tiles_bf16). The variant
under study has cuBLAS write gate and up as bf16 (round to nearest even), then the same SwiGLU in
fp32 from those, rounded to bf16 as now. This measures what that does to the trained models'
next-token distributions, on the CPU fast path (q27py/model/fastcpu.py, fp32 throughout, bf16
checkpoint weights exactly), in three configurations of the MLP only:

    a  as shipped: gate, up, SwiGLU and the down input all fp32 (the CPU path rounds nothing)
    b  the down input rounded to bf16 after SwiGLU (what the GPU prefill does today)
    c  b + gate and up rounded to bf16 before SwiGLU (the lever)

The rounding lives in this tool only (a subclass overriding FastCPUModel._mlp); the engine is
untouched. Every MLP of the main stack is affected, at every position (prefill chunks of --chunk
tokens, as the GPU prefill runs them; the GEMM route of fastcpu throughout).

Text, metrics, CLI and JSON: tools/quality_study.py (the harness this tool shares with
tools/gdn_tf32_quality.py): this repository's own source and the shared notes on agent traffic,
--tokens of each. Per pair (c vs b: the lever's own error; b vs a: today's rounding; c vs a: both):
mean / p99 / p99.9 / max KL(ref || variant) of the next-token distribution, greedy top-1 agreement,
the text's mean NLL under each and the difference, and max |logit diff| over the logit scale (max
|logit| of the reference run over the same positions, as tests/gpu/test_forward.py measures it).

    PYTHONPATH=. OMP_NUM_THREADS=2 python3 tools/swiglu_bf16_quality.py [--tokens 3072] [--json out.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import quality_study  # noqa: E402
from q27py.io.safetensors import round_to_bf16  # noqa: E402
from q27py.model.fastcpu import FastCPUModel, silu  # noqa: E402

CONFIGS = ("a", "b", "c")
PAIRS = (("b", "c"), ("a", "b"), ("a", "c"))  # (reference, variant)


class SwigluStudyModel(FastCPUModel):
    """FastCPUModel whose MLP rounds as configuration `mode` says (a: unchanged)."""

    mode = "a"

    def _mlp(self, x: np.ndarray, p: str) -> np.ndarray:
        if self.mode == "a":
            return super()._mlp(x, p)
        gu = self._linear(x, p + "mlp.gate_up.weight")
        m = gu.shape[1] // 2
        g, u = gu[:, :m], gu[:, m:]
        if self.mode == "c":
            g, u = round_to_bf16(g), round_to_bf16(u)
        return self._linear(round_to_bf16(silu(g) * u), p + "mlp.down_proj.weight")


def main(argv=None) -> int:
    return quality_study.main(SwigluStudyModel, CONFIGS, PAIRS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
