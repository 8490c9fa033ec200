"""Next-launch L2 prefetch A/B on the 27B shapes (seeded random weights), one process: the decode
step at 2K and 32K, verify rounds at W = 8 / 16, the MTP draft step and a 16-lane batched round
(decode_batch), each captured ONCE and replayed under every prefetch budget (FastModel.
set_gemv_prefetch rewrites the words in place, so the same graphs see each budget), budgets in an
interleaved order so drift shows. Beside it the streaming-read probe of the same run.

    PYTHONPATH=. python3 tools/gemv_prefetch_ab.py [--mb 0 8 16 24 32 0] [--tier q4s] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from q27py.bench import save_json
    from q27py.bench.random_weights import Bench, _time_graph, captured, copy_bandwidth, time_eager

    ap = argparse.ArgumentParser()
    ap.add_argument("--tier", default="q4s")
    ap.add_argument("--mb", type=float, nargs="+", default=[0, 16, 8, 32, 24, 0, 16])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--json", default=None)
    ap.add_argument("--set", nargs="+", default=[], metavar="NAME=VALUE",
                    help="constants-table overrides before anything compiles or plans (e.g. GEMV_TAIL_SPLIT=0)")
    args = ap.parse_args()
    from q27py.bench.gemv_probe import _apply_overrides

    _apply_overrides(args.set)
    probe = copy_bandwidth(1 << 30)
    b = Bench(tier=args.tier, max_context=32768 + 64, log=lambda *a: print(*a, flush=True))
    m, st, s = b.model, b.state, b.stream
    graphs = {}

    def dec(ctx):
        def f():
            b._set(st, ctx - 1, [7])
            st.position = ctx - 1
            return captured(lambda: m.enqueue_main(st, 1, False, np.array([0])), s)[0]
        return f

    def ver(w):
        def f():
            b._set(st, 2047, list(range(5, 5 + w)))

            def round_():
                m.enqueue_main(st, w, True, np.arange(w))
                m.enqueue_commit(st)
            return captured(round_, s)[0]
        return f

    def mtp():
        b._set(st, 2047, [5])
        with s:
            m.mtp_ids[:1].set(np.array([9], np.int32), stream=s)
        return captured(lambda: m.enqueue_mtp(st, 1), s)[0]

    # the graphs read the position from st.ctl at replay: each is re-set before it is timed
    sets = {"decode2k": lambda: b._set(st, 2047, [7]), "decode32k": lambda: b._set(st, 32767, [7]),
            "verify8": lambda: b._set(st, 2047, list(range(5, 13))),
            "verify16": lambda: b._set(st, 2047, list(range(5, 21))), "mtp": lambda: b._set(st, 2047, [5])}
    for name, make in (("decode2k", dec(2048)), ("decode32k", dec(32768)), ("verify8", ver(8)),
                       ("verify16", ver(16)), ("mtp", mtp)):
        graphs[name] = make()
    # the batched round: decode_batch's own captured graph per lane count (states a few positions apart)
    if m.graphs is None:
        m.enable_graphs()  # decode_batch replays one captured graph per lane count
    states = [st] + [m.new_state() for _ in range(args.batch - 1)]
    base = [2047 - 3 * i for i in range(args.batch)]

    def batch_round():
        for x, p in zip(states, base):
            x.position = p
        m.decode_batch(states, np.arange(args.batch) + 11)

    for _ in range(3):
        batch_round()
    s.synchronize()
    rows = []
    for mb in args.mb:
        m.set_gemv_prefetch(mb)
        s.synchronize()
        row = {"mb": mb}
        for name, g in graphs.items():
            sets[name]()
            row[name] = _time_graph(g, s, 30)
        row[f"batch{args.batch}"] = time_eager(batch_round, s, reps=15)
        rows.append(row)
        print(f"prefetch {mb:5.1f} MiB: " + "  ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "mb"), flush=True)
    sb = b.weights.stream_bytes()
    step = sb + b.kv_bytes(2048) + b.gdn_bytes()
    read = probe["read_GBps"]
    print(f"read probe {read:.0f} GB/s; decode 2K bytes {step / 1e9:.2f} GB")
    for r in rows:
        gbs = step / r["decode2k"] / 1e6
        print(f"  {r['mb']:5.1f} MiB: decode 2K {1e3 / r['decode2k']:.1f} t/s = {gbs:.0f} GB/s = {gbs / read:.1%} of read; "
              f"W8/W1 {r['verify8'] / r['decode2k']:.3f} (vs decode), W16/W8 {r['verify16'] / r['verify8']:.3f}; "
              f"B={args.batch} {args.batch * 1e3 / r[f'batch{args.batch}']:.0f} t/s")
    out = {"set": args.set, "probe": probe, "rows": rows, "device": b.rt.describe(), "decode2k_bytes": step}
    save_json(out, args.json, "prefetch_ab.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
