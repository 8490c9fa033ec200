"""A captured decode step's launch timeline on the 27B shapes (seeded random weights): where its time goes between
launches. Built with STEP_TRACE = 1, every kernel of runtime.PDL_MODULES has thread 0 of each CTA record, around its
griddepcontrol.wait (cuda/common.cuh pdl_wait_if), [%gridid, %globaltimer before the wait, after it, %smid]. One
replay of the step's graph (after warm-up replays) is read back from every module and grouped by %gridid, one group
a launch; the launches' order is %gridid's, labelled with the capture's launch sequence.

Per launch (us from the step's first record):
  open     when its first CTA reached its wait (a CTA is resident then; a GEMV has issued its first weight stages)
  release  when its first CTA left the wait = when the launch before it completed (PDL: the predecessor grid and its
           memory flush)
  last     when its last CTA left the wait (CTAs that became resident only after others finished: the waves)
  busy     the next launch's release minus this one's: how long this launch held the step's critical path
The summary adds busy per family (GEMV by matrix, attention, GDN, norms, ...) against the family's bytes where known,
and the step's span. Why (docs/PERF.md, 2026-12-07): the same kernels without their waits (PDL_NOWAIT) run the 2K
step 27% faster; this shows which boundaries hold that time.

    PYTHONPATH=. python3 tools/step_trace.py [--ctx 2048] [--lanes 1] [--top 40] [--json out.json]
    python3 tools/step_trace.py --compare a.json b.json   (per kernel: launches x mean busy = total, side by side)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass
class Launch:
    gridid: int
    ctas: int
    open: float  # us from the step's first record: the first CTA at its wait
    release: float  # the first CTA past its wait
    last: float  # the last CTA past its wait
    sms: int  # distinct SMs its CTAs ran on
    name: str = "?"
    busy: float = 0.0  # the next launch's release minus this one's (0 for the last)


def in_gridid_order(launches: list[Launch]) -> None:
    """Sort launches by %gridid (launch order) and set each one's busy: the next launch's release minus its own (0
    for the last)."""
    launches.sort(key=lambda x: x.gridid)
    for a, b in zip(launches, launches[1:]):
        a.busy = b.release - a.release
    if launches:
        launches[-1].busy = 0.0


def group(records: np.ndarray, names: list[str] | None = None, t0: int | None = None) -> list[Launch]:
    """records [n, 4] uint64 (gridid, t_open ns, t_released ns, smid) -> launches in %gridid order, times in us from
    the first record (or from t0 ns); names: the capture's launch sequence of traced kernels (labels when the counts
    agree)."""
    rec = np.asarray(records, dtype=np.uint64).reshape(-1, 4)
    rec = rec[rec[:, 2] > 0]  # a record whose CTA never left its wait (a cap overflow race): dropped
    if rec.size == 0:
        return []
    t0 = int(rec[:, 1].min()) if t0 is None else t0
    out = []
    for gid in np.unique(rec[:, 0]):
        r = rec[rec[:, 0] == gid]
        opn = (r[:, 1].astype(np.int64) - t0) / 1e3
        rel = (r[:, 2].astype(np.int64) - t0) / 1e3
        out.append(Launch(int(gid), len(r), float(opn.min()), float(rel.min()), float(rel.max()),
                          len(np.unique(r[:, 3]))))
    in_gridid_order(out)
    if names is not None and len(names) == len(out):
        for x, n in zip(out, names):
            x.name = n
    return out


def align(launches: list[Launch], seq: list[tuple[str, int]]) -> bool:
    """Label traced launches from the capture's (name, CTAs) sequence when some captured launches left no
    stamps (a zero-size grid that never launched, a kernel without a wait): each traced launch takes the
    next captured one of its CTA count, in order. Returns whether every traced launch found one."""
    j = 0
    for x in launches:
        while j < len(seq) and seq[j][1] != x.ctas:
            j += 1
        if j == len(seq):
            return False
        x.name = seq[j][0]
        j += 1
    return True


def label_modules(parts: dict[str, np.ndarray], seq: list[tuple[str, int]]) -> tuple[list[Launch], bool]:
    """Each module's records (its own q27_trace) grouped and labelled against that module's part of the capture's
    sequence (align within a module: an unstamped launch of one module cannot shift another's labels), then all
    launches in %gridid order with busy across modules. Returns (launches, whether every one was labelled)."""
    live = [np.asarray(r, np.uint64).reshape(-1, 4) for r in parts.values()]
    live = [r[r[:, 2] > 0] for r in live]
    if not any(r.size for r in live):
        return [], True
    t0 = min(int(r[:, 1].min()) for r in live if r.size)
    out, ok = [], True
    for module, rec in parts.items():
        ls = group(rec, t0=t0)
        sub = [x for x in seq if x[0].partition(":")[0] == module]
        if len(sub) == len(ls):
            for x, (n, _c) in zip(ls, sub):
                x.name = n
        else:
            ok = align(ls, sub) and ok
        out += ls
    in_gridid_order(out)
    return out, ok


def family(name: str) -> str:
    """A launch label "module:kernel" -> its family for the summary."""
    module, _, kernel = name.partition(":")
    if module in ("gemv", "gemv_wg", "gemv2"):
        return "gemv" if kernel != "quant_act8" else "quant"
    if module == "norm":
        return "gdn" if kernel.startswith("gated") else "norm"
    return module


def summary(launches: list[Launch]) -> dict:
    fam: dict[str, list[float]] = {}
    for x in launches:
        f = fam.setdefault(family(x.name), [0.0, 0])
        f[0] += x.busy
        f[1] += 1
    span = launches[-1].release - launches[0].open if launches else 0.0
    return {"span_us": span, "launches": len(launches),
            "families": {k: {"busy_us": v[0], "launches": v[1]} for k, v in sorted(fam.items(), key=lambda kv: -kv[1][0])}}


def by_kernel(launches: list[Launch]) -> dict[str, tuple[int, float]]:
    """name -> (launches, total busy us), the most busy first."""
    out: dict[str, list] = {}
    for x in launches:
        v = out.setdefault(x.name, [0, 0.0])
        v[0] += 1
        v[1] += x.busy
    return {k: (v[0], v[1]) for k, v in sorted(out.items(), key=lambda kv: -kv[1][1])}


def compare(paths: list[str]) -> str:
    """Two or more --json files side by side: span, then per kernel its launches and busy (total and mean, us)."""
    runs = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        runs.append((Path(p).stem, d["summary"]["span_us"], by_kernel([Launch(**x) for x in d["launches"]])))
    names = list(dict.fromkeys(k for _, _, bk in runs for k in bk))
    lines = [f"{'kernel':<40}" + "".join(f" {t[:22]:>24}" for t, _, _ in runs),
             f"{'span us':<40}" + "".join(f" {sp:>24.0f}" for _, sp, _ in runs)]
    for k in names:
        cells = []
        for _, _, bk in runs:
            n, tot = bk.get(k, (0, 0.0))
            cells.append(f" {n:>4} x {tot / n if n else 0:5.1f} = {tot:7.0f}")
        lines.append(f"{k[:40]:<40}" + "".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", nargs="+", default=None, metavar="JSON",
                    help="print earlier runs' --json files side by side (no device needed)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--lanes", type=int, default=1, help="1: the decode step; W > 1: a verify round of W lanes")
    ap.add_argument("--tier", default="q4s")
    ap.add_argument("--top", type=int, default=40, help="print the launches with the most busy time")
    ap.add_argument("--json", default=None)
    ap.add_argument("--set", nargs="+", default=[], metavar="NAME=VALUE", help="constants-table overrides")
    args = ap.parse_args(argv)
    if args.compare:
        print(compare(args.compare))
        return 0
    from q27py.bench.gemv_probe import _apply_overrides
    from q27py.gpu import constants as C

    _apply_overrides(args.set)
    C.STEP_TRACE = 1  # before anything compiles
    from q27py.bench.random_weights import Bench, copy_bandwidth
    from q27py.gpu.graphs import capture
    from q27py.gpu.runtime import PDL_MODULES, Runtime

    probe = copy_bandwidth(1 << 30)["read_GBps"]
    b = Bench(tier=args.tier, max_context=args.ctx + 64, log=lambda *a: print(*a, flush=True))
    m, st, s = b.model, b.state, b.stream
    rt = Runtime.get()
    seq: list[str] = []
    real = rt.launch

    def launch(module, kernel, grid, *a, **kw):
        if module in PDL_MODULES:
            g = grid if isinstance(grid, tuple) else (grid,)
            seq.append((f"{module}:{kernel}", int(np.prod([int(x) for x in g]))))
        return real(module, kernel, grid, *a, **kw)

    w = args.lanes
    b._set(st, args.ctx - 1, list(range(5, 5 + w)))
    rt.launch = launch
    try:
        with s:
            if w == 1:
                g = capture(lambda: m.enqueue_main(st, 1, False, np.array([0])), s)
            else:
                def round_():
                    m.enqueue_main(st, w, True, np.arange(w))
                    m.enqueue_commit(st)
                g = capture(round_, s)
    finally:
        rt.launch = real
    cp = rt.cp
    for _ in range(3):
        b._set(st, args.ctx - 1, list(range(5, 5 + w)))
        g.launch(s)
    s.synchronize()
    mods = {name: mod for name, mod in rt._modules.items() if name in PDL_MODULES}
    for mod in mods.values():  # zero every module's count, then one replay
        cp.ndarray((1,), dtype=cp.uint32, memptr=mod.get_global("q27_trace_n")).fill(0)
    b._set(st, args.ctx - 1, list(range(5, 5 + w)))
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record(s)
    g.launch(s)
    e1.record(s)
    e1.synchronize()
    ms = cp.cuda.get_elapsed_time(e0, e1)
    parts = {}
    for name, mod in mods.items():
        n = int(cp.ndarray((1,), dtype=cp.uint32, memptr=mod.get_global("q27_trace_n")).get()[0])
        if n > C.STEP_TRACE_CAP:  # the rest of the step is missing from this module's records
            print(f"WARNING: module {name}: {n} records past STEP_TRACE_CAP = {C.STEP_TRACE_CAP}: raise it (--set)")
        n = min(n, C.STEP_TRACE_CAP)
        buf = cp.ndarray((C.STEP_TRACE_CAP * 4,), dtype=cp.uint64, memptr=mod.get_global("q27_trace"))
        parts[name] = buf[: 4 * n].get().reshape(-1, 4)
    launches, labelled = label_modules(parts, seq)
    print(f"{rt.name}: read probe {probe:.0f} GB/s; step of {w} lane(s) at {args.ctx}: {ms * 1e3:.0f} us a replay; "
          f"{len(launches)} traced launches ({len(seq)} in the capture{'' if labelled else ': NOT labelled'})")
    print(f"{'#':>4} {'launch':<40} {'ctas':>5} {'sms':>4} {'open':>9} {'release':>9} {'last':>9} {'busy':>7}")
    top = sorted(range(len(launches)), key=lambda i: -launches[i].busy)[: args.top]
    for i in sorted(top):
        x = launches[i]
        print(f"{i:>4} {x.name:<40} {x.ctas:>5} {x.sms:>4} {x.open:9.1f} {x.release:9.1f} {x.last:9.1f} {x.busy:7.1f}")
    sm = summary(launches)
    print(f"span {sm['span_us']:.0f} us over {sm['launches']} launches; busy by family (us, launches):")
    for k, v in sm["families"].items():
        print(f"  {k:<12} {v['busy_us']:9.1f} {v['launches']:5d}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": rt.name, "ms": ms, "probe_gbs": probe, "summary": sm,
                                               "launches": [x.__dict__ for x in launches]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
