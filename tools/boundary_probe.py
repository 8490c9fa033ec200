"""What a kernel boundary costs, and what a ready word would save (issue 10; cuda/probe.cu bnd_produce / bnd_consume,
a probe only): chains of P (small producer -> wide consumer) pairs captured as graphs with programmatic dependent
launch. Each side waits on its predecessor grid (griddepcontrol.wait, what the engine's kernels do) or on a ready word
its predecessor releases after its writes (a one-CTA producer at once; a consumer's last CTA through a ticket), or
not at all (the bound; its reads are wrong); beside them the consumers alone (the streaming bound). Rows are named
"producer's wait / consumer's wait". Each consumer is a GEMV's shape: CTAS CTAs streaming their own slice of MB
megabytes (distinct per pair, so the L2 holds none of it). Prints microseconds a pair per row, alternated over
rounds, and the words the consumers read that were not their producer's (0 expected under every wait).
Measured (docs/PERF.md, 2026-12-07 sixteenth session, H100): every ready word is 0.9-1.9 us slower than the grid wait.

    PYTHONPATH=. python3 tools/boundary_probe.py [--pairs 64] [--mb 5 40] [--ctas 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from q27py.bench import save_json
    from q27py.bench.random_weights import _time_graph, copy_bandwidth
    from q27py.gpu.graphs import capture
    from q27py.gpu.runtime import Runtime, i32

    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--mb", type=float, nargs="+", default=[5.0, 40.0], help="bytes a consumer streams (MB)")
    ap.add_argument("--ctas", type=int, default=256)
    ap.add_argument("--words", type=int, default=1280, help="u32 words a producer writes (a 5,120-row a8 row: 1,280)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rt = Runtime.get()
    if not rt.pdl_supported:
        print("programmatic dependent launch needs sm_90", file=sys.stderr)
        return 2
    cp = rt.cp
    probe = copy_bandwidth(1 << 30)
    s = cp.cuda.Stream(non_blocking=True)
    P, n, ctas = args.pairs, args.words, args.ctas
    data = cp.zeros((P, n), dtype=cp.uint32)
    flags = cp.zeros(P, dtype=cp.uint32)
    done = cp.zeros(P, dtype=cp.uint32)
    tickets = cp.zeros(P, dtype=cp.uint32)
    bad = cp.zeros(1, dtype=cp.uint32)
    fp, fc = rt.fn("probe", "bnd_produce"), rt.fn("probe", "bnd_consume")
    launcher = rt._pdl()
    results, graphs = {}, {}
    # name: (producer mode, consumer mode, producers launched); cuda/probe.cu's mode bits -- producer: 1 releases
    # its word, 2 spins on the previous consumer's word, 4 no wait; consumer: 1 spins on the producer's word, 2
    # releases its word by ticket, 4 no wait
    modes = {"grid / grid (engine)": (0, 0, True),
             "grid / word": (1, 1, True),      # the consumer (GEMV) spins on the producer's word
             "word / grid": (2, 2, True),      # the producer (norm) spins on the consumer's ticket release
             "word / word": (3, 3, True),
             "no wait (bound)": (4, 4, True),
             "consumers alone": (4, 4, False)}
    for mb in args.mb:
        per = max(64, int(mb * 1e6 / 16 / ctas))
        w = cp.empty(P * ctas * per * 4, dtype=cp.uint32)  # its values do not matter (the probe reads, XORs, drops)
        wp = w.data.ptr

        def chain(pm, cm, producers=True, mb_per=per):
            def f():
                for a in (flags, done, tickets, data):  # a replay's tags are its pairs' indices + 1: each
                    a.fill(0)                           # replay starts from cleared words
                for i in range(P):
                    tag = np.uint32(i + 1)
                    if producers:
                        launcher.launch(fp.kernel.ptr, (1,), (256,),
                                        (data[i], i32(n), flags[i:], tag, i32(pm), done[max(i - 1, 0):],
                                         np.uint32(i)), 0, s.ptr, pdl=True)
                    wi = np.uint64(wp + i * ctas * mb_per * 16)
                    launcher.launch(fc.kernel.ptr, (ctas,), (256,),
                                    (data[i], i32(n), flags[i:], tag, i32(cm), wi, np.int64(mb_per), bad,
                                     tickets[i:], done[i:]), 0, s.ptr, pdl=True)
            return f

        for name, (pm, cm, prod) in modes.items():
            graphs[(mb, name)] = (capture(chain(pm, cm, prod), s, pdl=True), pm, prod)
        s.synchronize()
        times = {name: [] for (m, name) in graphs if m == mb}
        for r in range(args.rounds):
            names = list(times) if r % 2 == 0 else list(reversed(list(times)))
            for name in names:
                g = graphs[(mb, name)][0]
                times[name].append(_time_graph(g, s, args.reps) * 1e3 / P)
        misses = {}
        for name in times:
            bad.fill(0)
            s.synchronize()
            graphs[(mb, name)][0].launch(s)
            s.synchronize()
            misses[name] = int(bad.get()[0])
        nbytes = ctas * per * 16
        print(f"consumer {nbytes / 1e6:.1f} MB over {ctas} CTAs ({nbytes / probe['read_GBps'] / 1e3:.2f} us at the "
              f"{probe['read_GBps']:.0f} GB/s read probe), producer {n * 4} B, {P} pairs a graph; us a pair, median "
              f"of {args.rounds} rounds:")
        for name, t in times.items():
            print(f"  {name:22s} {np.median(t):8.2f}  (min {min(t):.2f}, max {max(t):.2f})  stale words read: "
                  f"{misses[name]}", flush=True)
        results[str(mb)] = {"bytes": nbytes, "us_per_pair": {k: float(np.median(v)) for k, v in times.items()},
                            "all": times, "stale_words": misses}
        del w
        for k in [k for k in graphs if k[0] == mb]:
            del graphs[k]
    out = {"device": rt.describe(), "probe": probe, "results": results, "args": vars(args)}
    save_json(out, args.json, "boundary_probe.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
