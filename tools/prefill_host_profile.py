"""Where a short prompt's eager prefill spends its host time (issue 15: 16 streams' 128-token prompts took 0.5 s of
a C=16 load run, ~33 ms each, against ~10 ms of device work; run o2 found the prefill host-bound).

On the 27B random-weights bench model: per prompt length, the wall time of one eager prefill, its device time
(events around it), the kernel launches it made, then a cProfile of --profile-runs prefills of the first length,
top functions by own time. A prefill is host-bound when its wall exceeds its device time by the launch cost.

    PYTHONPATH=. python3 tools/prefill_host_profile.py [--tokens 128 512] [--reps 5] [--profile-runs 5]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from q27py.bench.random_weights import Bench

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile-runs", type=int, default=5)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    b = Bench(tier="q4s", max_context=max(args.tokens) + 64, chunk=4096, log=lambda *a: None)
    m, cp, rt = b.model, b.cp, b.rt
    print(rt.describe().get("name", ""), flush=True)
    st = m.new_state()

    def once(ids) -> tuple[float, float, float, int]:
        st.reset()
        b.stream.synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        n0 = rt.launches
        t0 = time.perf_counter()
        e0.record(b.stream)
        m.forward(st, ids, logits_rows="last")
        t1 = time.perf_counter()
        e1.record(b.stream)
        e1.synchronize()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0, cp.cuda.get_elapsed_time(e0, e1) / 1e3, rt.launches - n0

    rng = np.random.default_rng(0)
    for n in args.tokens:
        ids = rng.integers(0, b.cfg.vocab_size, n)
        once(ids)  # first sight: compiles, workspaces
        runs = [once(ids) for _ in range(args.reps)]
        enq, wall, dev, launches = (statistics.median(r[i] for r in runs) for i in range(4))
        print(f"prefill {n:6d} tokens: wall {wall * 1e3:7.2f} ms, host enqueue {enq * 1e3:7.2f} ms, device "
              f"{dev * 1e3:7.2f} ms, {launches:.0f} launches ({enq / max(1, launches) * 1e6:.1f} us of host each)",
              flush=True)
    ids = rng.integers(0, b.cfg.vocab_size, args.tokens[0])
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.profile_runs):
        once(ids)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
    print(f"--- cProfile, {args.profile_runs} prefills of {args.tokens[0]} tokens, by own time")
    print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:12000])
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
    print("--- by cumulative time")
    print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:8000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
