"""CPU numerics of the chunked GDN form (docs/PERF.md "GDN chunked prefill"): relative L2 error of
the fp32 recurrence and of the fp32 chunked form (chunk 64) against the float64 recurrence.

    PYTHONPATH=. python3 tools/gdn_chunk_numerics.py [T]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "gpu")]

from q27py.model import ops  # noqa: E402
from q27py.model.gdn_chunked import gdn_chunked  # noqa: E402
from test_gdn_chunk import make, rel  # noqa: E402  (the GPU tests' input generator)


def main() -> int:
    t = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    for decay in ("normal", "strong"):
        for h, hv, dk, dv in [(2, 6, 64, 64), (1, 3, 128, 128)]:
            d = make(np.random.default_rng(1), t, h, hv, dk, dv, decay)
            a = [d[x] for x in ("q", "k", "v", "g", "beta", "s0")]
            o64, s64 = ops.gdn_recurrent(*(x.astype(np.float64) for x in a))
            o32, s32 = ops.gdn_recurrent(*a)
            oc, sc = gdn_chunked(*a)
            print(f"{decay:6s} dk {dk:3d}  fp32 recurrence out {rel(o32, o64):.2e} state {rel(s32, s64):.2e}  "
                  f"fp32 chunked out {rel(oc, o64):.2e} state {rel(sc, s64):.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
