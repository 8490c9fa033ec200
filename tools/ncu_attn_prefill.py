"""One launch of the prefill attention kernel per named form on the 27B heads (24 q / 4 kv heads, head dim 256):
the second 4096-lane chunk of an 8K prefill (pos0 4096, two key blocks), random q / gate / bf16 K and V. For ncu:

    PYTHONPATH=. ncu --kernel-name regex:attn_prefill3 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section InstructionStats python3 tools/ncu_attn_prefill.py ws

Forms: v2 (the mma.sync kernel), or a kernels.PF3_FORMS key (sync, ws, pipe) for the wgmma kernel.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(forms: list[str]) -> int:
    from q27py.gpu import kernels as K
    from q27py.gpu.runtime import Runtime

    cp = Runtime.get().cp
    nq, nkv, hd, t, pos0 = 24, 4, 256, 4096, 4096
    max_pos = 2 * t + 64
    q = cp.random.uniform(-2, 2, (t, nq * hd), dtype=cp.float32)
    qg = cp.random.uniform(-2, 2, (t, 2 * nq * hd), dtype=cp.float32)
    out = cp.empty((t, nq * hd), cp.float32)
    rng = np.random.default_rng(0)
    # bf16 bits of values in about [-1, 1) (as q27py/bench/attn_prefill.py makes them)
    kc = cp.asarray((rng.integers(0, 1 << 16, (nkv, max_pos, hd)) & 0x807F | 0x3F00).astype(np.uint16))
    vc = cp.asarray((rng.integers(0, 1 << 16, (nkv, max_pos, hd)) & 0x807F | 0x3F00).astype(np.uint16))
    part = cp.zeros(K.attention_prefill2_part_floats(t, nq, hd, 2), cp.float32)
    pos_dev = cp.asarray(np.array([pos0], np.int32))
    for form in forms:
        K.ATTN_PREFILL_WGMMA = form != "v2"
        K.PF3_FORM = form if form != "v2" else K.PF3_FORM
        K.attention_prefill2(q, nq * hd, kc, vc, False, max_pos, nq, nkv, hd, pos_dev, pos0, qg, 2 * nq * hd, out,
                             nq * hd, t, part)
    cp.cuda.Device().synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] or ["ws"]))
