"""Launch-time switches A/B on the 27B shapes (seeded random weights), one process: for each configuration of
constants-table switches that are read at launch time (NORM_FOLD, GATED_FOLD, QUANT_FOLD, ...), the decode step at
2K and 32K and verify rounds at W = 8 / 16 are captured once under it; then every configuration's graphs are replayed
in rounds that alternate the configurations, so drift shows and one model build serves them all (gemv_prefetch_ab
needs a process per configuration). Beside it the streaming-read probe of the same run.

    PYTHONPATH=. python3 tools/switch_ab.py --configs "" "NORM_FOLD=1 GATED_FOLD=1" "QUANT_FOLD=1" [--rounds 3]

A configuration is a space-separated list of NAME=VALUE ("" or "-": the table as it is). Only switches read at launch
time may differ between configurations (plans and buffers are built once, under the table as it is).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse(cfg: str) -> dict[str, int | float]:
    out = {}
    for kv in cfg.split():
        if kv == "-":
            continue
        k, v = kv.split("=", 1)
        out[k] = float(v) if "." in v else int(v)
    return out


def main() -> int:
    from q27py.bench import save_json
    from q27py.bench.random_weights import Bench, _time_graph, captured, copy_bandwidth
    from q27py.gpu import constants as C

    ap = argparse.ArgumentParser()
    ap.add_argument("--tier", default="q4s")
    ap.add_argument("--configs", nargs="+", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20, help="replays timed a shape, a configuration, a round")
    ap.add_argument("--shapes", nargs="+", default=["decode2k", "decode32k", "verify8", "verify16"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfgs = [parse(c) for c in args.configs]
    for c in cfgs:
        for k in c:
            if not hasattr(C, k):
                raise SystemExit(f"no constant {k}")
    probe = copy_bandwidth(1 << 30)
    b = Bench(tier=args.tier, max_context=32768 + 64, log=lambda *a: print(*a, flush=True))
    m, st, s = b.model, b.state, b.stream
    # decode2k / decode32k: one lane at that context; verifyW: a round of W lanes at 2K
    ctx = {n: 32768 if n == "decode32k" else 2048 for n in args.shapes}
    width = {n: int(n[6:]) if n.startswith("verify") else 1 for n in args.shapes}

    def reset(name):
        w = width[name]
        b._set(st, ctx[name] - 1, [7] if w == 1 else list(range(5, 5 + w)))
        st.position = ctx[name] - 1

    def capture(name):
        reset(name)
        w = width[name]
        if w == 1:
            return captured(lambda: m.enqueue_main(st, 1, False, np.array([0])), s)[0]

        def round_():
            m.enqueue_main(st, w, True, np.arange(w))
            m.enqueue_commit(st)
        return captured(round_, s)[0]

    graphs = []
    for c in cfgs:
        saved = {k: getattr(C, k) for k in c}
        for k, v in c.items():
            setattr(C, k, v)
        try:
            graphs.append({name: capture(name) for name in args.shapes})
        finally:
            for k, v in saved.items():
                setattr(C, k, v)
    s.synchronize()
    times = [{name: [] for name in args.shapes} for _ in cfgs]
    for r in range(args.rounds):
        order = range(len(cfgs)) if r % 2 == 0 else reversed(range(len(cfgs)))
        for i in order:
            for name in args.shapes:
                reset(name)
                times[i][name].append(_time_graph(graphs[i][name], s, args.reps))
    read = probe["read_GBps"]
    step = b.weights.stream_bytes() + b.kv_bytes(2048) + b.gdn_bytes()
    print(f"read probe {read:.0f} GB/s; decode 2K bytes {step / 1e9:.2f} GB; ms, median of {args.rounds} rounds "
          f"(min .. max)")
    rows = []
    for c, t in zip(args.configs, times):
        med = {name: float(np.median(v)) for name, v in t.items()}
        rows.append({"config": c, "median_ms": med, "ms": t})
        cells = "  ".join(f"{name} {med[name]:.3f} ({min(t[name]):.3f}..{max(t[name]):.3f})" for name in args.shapes)
        extra = ""
        if "decode2k" in med:
            gbs = step / med["decode2k"] / 1e6
            extra = f"  = {gbs:.0f} GB/s = {gbs / read:.1%} of read"
            if "verify8" in med:
                extra += f"; W8/W1 {med['verify8'] / med['decode2k']:.3f}"
            if "verify16" in med:
                extra += f", W16/W1 {med['verify16'] / med['decode2k']:.3f}"
        print(f"switch [{c or '-'}]: {cells}{extra}", flush=True)
    out = {"configs": args.configs, "probe": probe, "rows": rows, "device": b.rt.describe(), "decode2k_bytes": step}
    save_json(out, args.json, "switch_ab.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
