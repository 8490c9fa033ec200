"""Decode / verify / MTP step times on the 27B shapes with programmatic dependent launch off and on
(issue 10: the per-launch gaps). One process compiles one trigger placement (PDL_EARLY follows
Q27_PDL), so run it twice for both:

    Q27_PDL=on    PYTHONPATH=. python3 tools/pdl_bench.py   # rows: off, on
    Q27_PDL=early PYTHONPATH=. python3 tools/pdl_bench.py   # rows: off, early

Every row is the same captured step (graphs.capture), timed by replays (L2 defeated: distinct
weights per layer, 13.7 GB per step), beside the streaming-read probe of the same process.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from q27py.bench.random_weights import Bench, _time_graph, captured, copy_bandwidth
from q27py.gpu import runtime as R


def main() -> int:
    mode = R.pdl_mode()
    if mode == "off":
        print("set Q27_PDL=on or early (the compile option follows it)", file=sys.stderr)
        return 2
    b = Bench(tier="q4s", max_context=32768 + 64, log=lambda *a: None)
    m, st = b.model, b.state
    read = copy_bandwidth()["read_GBps"]
    rows = []
    for label in ("off", mode, "off", mode):  # interleaved twice: clock drift shows as a row pair disagreeing
        R._PDL_MODE = label if label == "off" else mode
        row = {"pdl": label}
        for ctx in (2048, 32768):
            b._set(st, ctx - 1, [7])
            st.position = ctx - 1
            g, k = captured(lambda: m.enqueue_main(st, 1, False, np.array([0])), b.stream)
            ms = _time_graph(g, b.stream, 40)
            nbytes = b.weights.stream_bytes() + b.kv_bytes(ctx) + b.gdn_bytes()
            row[f"decode_{ctx}_ms"] = ms
            row[f"decode_{ctx}_read_fraction"] = nbytes / ms / 1e6 / read
            row["kernels"] = k["total"]
        for w in (1, 8, 16):
            b._set(st, 2047, list(range(5, 5 + w)))

            def round_():
                m.enqueue_main(st, w, True, np.arange(w))
                m.enqueue_commit(st)

            g, _ = captured(round_, b.stream)
            row[f"verify_w{w}_ms"] = _time_graph(g, b.stream, 20)
        b._set(st, 2047, [5])
        g, _ = captured(lambda: m.enqueue_mtp(st, 1), b.stream)
        row["mtp_ms"] = _time_graph(g, b.stream, 30)
        rows.append(row)
    R._PDL_MODE = mode
    print(f"streaming read {read:.0f} GB/s; {rows[0]['kernels']} kernels per decode step; mode {mode}")
    print("pdl    dec2K ms (read)     dec32K ms (read)    W1      W8      W16     W8/W1  W16/W1  mtp")
    for r in rows:
        print(f"{r['pdl']:<6} {r['decode_2048_ms']:7.3f} ({r['decode_2048_read_fraction']:.1%})   "
              f"{r['decode_32768_ms']:7.3f} ({r['decode_32768_read_fraction']:.1%})   "
              f"{r['verify_w1_ms']:6.3f}  {r['verify_w8_ms']:6.3f}  {r['verify_w16_ms']:6.3f}  "
              f"{r['verify_w8_ms'] / r['verify_w1_ms']:5.3f}  {r['verify_w16_ms'] / r['verify_w1_ms']:5.3f}  {r['mtp_ms']:.3f}")
    print(json.dumps({"read_GBps": read, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
