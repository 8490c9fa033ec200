"""Trace-driven speculative decoding on the 27B shapes: wall-clock tokens/s with host time.

Real round traces (drafter, drafts, accepted count, MTP passes per round) are recorded from the
trained model on held-out prompts (tools/record_traces.py -> q27py/bench/data/spec_traces.json).
Random 27B weights cannot reproduce those acceptances, so this replays the round *shapes*: each
round does exactly the engine's work for its drafter --

    mtp:    MTPLadder.draft on the device chain (mtp_draft_chain: one graph, `mtp_steps` passes,
            backlog rows of earlier suffix rounds written in its step 0)
    suffix: SuffixIndex.propose on the token stream (the host work), the trace's drafts as lanes
    none:   the pending token alone
    then:   verify forward of the W lanes (graph), device argmax ids downloaded, the trace's
            accepted count n, hidden rows downloaded, commit(n) (graph), MTP rows deferred,
            suffix index extended, the n tokens detokenized incrementally

-- and times the whole loop with perf_counter (host time included). Plain decoding is timed the
same way in the same run (graph step, device argmax id, hidden row, detokenize), so the ratio
is the end-to-end speed-up at that context.

    python3 -m q27py.bench.spec_replay [--traces FILE] [--tier q4s] [--context 2048] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

TRACES = Path(__file__).resolve().parent / "data" / "spec_traces.json"


def load_rounds(path: Path = TRACES) -> tuple[dict, list[list[dict]]]:
    data = json.loads(Path(path).read_text())
    # the first round of each prompt is the prefill's token (lanes 0): not a decode round
    return data, [[r for r in p["rounds"] if r.get("lanes", 1) > 0] for p in data["prompts"]]


class _Detok:
    """The engine's incremental detokenization of each round's tokens (host work per round)."""

    def __init__(self, tokenizer):
        self.dec = tokenizer.new_decoder(skip_special=True)
        self.text = []

    def add(self, ids) -> None:
        self.text.append(self.dec.feed([int(i) for i in ids]))


def _detok(tokenizer):
    return _Detok(tokenizer)


class _Stream:
    """One replayed sequence: its state, drafters and detokenizer, as the engine keeps them per slot."""

    def __init__(self, m, st, tokenizer, rng, context: int):
        from q27py.engine.drafters import MTPLadder, SuffixIndex

        self.m, self.st = m, st
        self.ladder = MTPLadder(m, st.mtp_kv)
        self.suffix = SuffixIndex(key_len=4)
        self.suffix.extend(rng.integers(0, 1000, context).tolist())
        self.pending = 7
        self.ladder.defer(rng.standard_normal((1, m.cfg.hidden_size)).astype(np.float32), [self.pending])
        self.det = _detok(tokenizer)

    def spec_round(self, r: dict, hooks=None) -> int:
        """One trace round (module docstring): draft, verify, accept the trace's count, commit, feed the
        drafters, detokenize. hooks = (mark, event): the profile pass's phase marks. Returns the tokens."""
        m, st = self.m, self.st
        mark, event = hooks if hooks else (None, None)
        tp = time.perf_counter()
        ev = event() if hooks else None
        draft = self.draft(r)
        if hooks:  # the draft: its chain on the device, its host call (ids read back inside)
            tp, _ = mark("draft", tp, ev)
            ev = event()
        lanes = [self.pending] + draft
        out = m.forward(st, lanes, logits_rows="all", verify=True)
        if hooks:
            tp, _ = mark("verify_launch", tp)
        ids = out.greedy_ids()
        if hooks:  # the verify forward on the device; the host's wait for its ids
            tp, _ = mark("verify_wait", tp, ev)
        n = min(int(r["accepted"]), len(lanes))
        new = [int(x) for x in ids[:n]]
        hidden = np.array(out.hidden[:n])
        if hooks:
            tp, _ = mark("hidden_copy", tp)
            ev = event()
        m.commit(st, out.trace, n)
        if hooks:
            tp, _ = mark("commit_launch", tp, ev)
        self.feed(hidden, new)
        if hooks:
            mark("bookkeeping", tp)
        return n

    def draft(self, r: dict, cap: int | None = None) -> list[int]:
        """The trace round's drafts, made as the engine makes them (the MTP chain on the device for its
        recorded steps; the suffix drafter's lookup, its recorded tokens), at most `cap` of them (a
        shared sweep's group: its share of the lanes; the chain then runs only that deep)."""
        d = len(r["drafts"]) if cap is None else min(len(r["drafts"]), cap)
        if r["source"] == "mtp" and d:
            steps = max(d, int(r.get("mtp_steps", d))) if d == len(r["drafts"]) else d
            return self.ladder.draft(steps, float("-inf"), self.st.position).tokens[:d]
        if r["source"] == "suffix" and d:
            self.suffix.propose(d, min_match=2)
            return [int(x) for x in r["drafts"][:d]]
        return []

    def feed(self, hidden, new: list[int]) -> None:
        """What a committed round teaches the drafters (spec.py: solo and shared rounds alike)."""
        self.ladder.defer(hidden, new)
        self.suffix.extend(new)
        self.det.add(new)
        self.pending = new[-1]


STREAM_ROUNDS = 40  # rounds per stream and mode in run(streams=...)


def run(traces: Path = TRACES, tier: str = "q4s", context: int = 2048, seed: int = 0, log=print,
        streams: list[int] | None = None) -> dict:
    from q27py.bench.random_weights import Bench
    from q27py.model.tiny import FULL_TOKENIZER
    from q27py.tokenizer import Tokenizer

    meta, prompts = load_rounds(traces)
    total_tokens = sum(r["accepted"] for p in prompts for r in p)
    widest = max(len(r["drafts"]) + 1 for p in prompts for r in p)
    b = Bench(tier=tier, seed=seed, max_context=context + max(total_tokens, STREAM_ROUNDS * widest) + 64, chunk=64,
              log=log)
    m = b.model
    m.enable_graphs()
    tokenizer = Tokenizer.from_file(FULL_TOKENIZER)
    st = b.state
    rng = np.random.default_rng(seed)

    def reset():
        st.position = context
        st.mtp_kv.length = context - 1
        st.mtp_position = context - 1

    # ---- plain decoding (as engine/decoder.Decoder runs it on the fast path)
    reset()
    n_plain = min(256, total_tokens)
    tok = 7
    det = _detok(tokenizer)
    for _ in range(8):  # warm: graph capture
        out = m.forward(st, [tok])
        tok = int(out.greedy_ids()[0])
    reset()
    t0 = time.perf_counter()
    for _ in range(n_plain):
        out = m.forward(st, [tok])
        _ = out.hidden[-1:].copy()
        tok = int(out.greedy_ids()[0])
        det.add([tok])
    m.stream.synchronize()
    plain_s = time.perf_counter() - t0
    plain_tps = n_plain / plain_s

    # ---- speculative rounds replayed from the traces
    import cupy as cp

    prof: dict[str, list[float]] = {}

    def mark(name: str, t0: float, ev0=None) -> tuple[float, object]:
        """Profile pass: host seconds since t0 under `name`, and (with ev0) a device interval."""
        t1 = time.perf_counter()
        prof.setdefault("host_" + name, []).append(t1 - t0)
        ev1 = None
        if ev0 is not None:
            ev1 = cp.cuda.Event()
            ev1.record(m.stream)
            prof.setdefault("_dev_" + name, []).append((ev0, ev1))
        return t1, ev1

    def event():
        ev = cp.cuda.Event()
        ev.record(m.stream)
        return ev

    def replay(rounds_of_prompts, timed: bool, profile: bool = False) -> tuple[float, int, int]:
        reset()
        sm = _Stream(m, st, tokenizer, rng, context)
        tokens = rounds = 0
        hooks = (mark, event) if profile else None
        t0 = time.perf_counter()
        for rounds_ in rounds_of_prompts:
            for r in rounds_:
                tokens += sm.spec_round(r, hooks)
                rounds += 1
        m.stream.synchronize()
        return time.perf_counter() - t0, tokens, rounds

    replay(prompts, timed=False)  # warm: every graph shape the traces use is captured before the timed pass
    spec_s, spec_tokens, spec_rounds = replay(prompts, timed=True)
    spec_tps = spec_tokens / spec_s
    # A third pass with CUDA events and perf_counter marks at the phase boundaries: where a round's
    # time goes (ms per round; not the timed figure). host_X: the host's time in phase X. device_X:
    # the GPU timeline from the event before X's launch to the event after it (for the draft and the
    # verify that includes reading their ids back, i.e. the GPU waiting on the host inside the phase).
    # outside: the round's wall time in none of those brackets (hidden copy, bookkeeping, launches).
    prof_s, _, _ = replay(prompts, timed=False, profile=True)
    profile = {}
    for k, v in prof.items():
        if k.startswith("_dev_"):
            profile["device_" + k[5:]] = sum(cp.cuda.get_elapsed_time(a, b) for a, b in v) / spec_rounds
        else:
            profile[k] = sum(v) * 1e3 / spec_rounds
    profile["round_wall"] = prof_s * 1e3 / spec_rounds
    profile["outside"] = profile["round_wall"] - sum(v for k, v in profile.items() if k.startswith("device_"))
    res = {
        "device": b.rt.describe(), "tier": tier, "context": context, "traces": str(traces), "trace_model": meta.get("model"),
        "plain_tokens": n_plain, "plain_s": plain_s, "plain_tokens_per_s": plain_tps,
        "spec_tokens": spec_tokens, "spec_rounds": spec_rounds, "tokens_per_round": spec_tokens / spec_rounds,
        "spec_s": spec_s, "spec_tokens_per_s": spec_tps, "speedup": spec_tps / plain_tps, "bar": 2.5,
        "graph_captures": m.graphs.captures, "profile_ms_per_round": profile,
    }
    log(f"spec replay ({meta.get('model')} traces, {spec_rounds} rounds, {res['tokens_per_round']:.2f} tokens/round, "
        f"ctx {context}): plain {plain_tps:.1f} t/s, speculative {spec_tps:.1f} t/s = {res['speedup']:.2f}x (host time included)")
    log("  per round (ms, profile pass): " + ", ".join(f"{k} {v:.3f}" for k, v in profile.items()))
    if streams:
        res["streams"] = _streams(m, [st] + [m.new_state() for _ in range(max(streams) - 1)], prompts, streams,
                                  tokenizer, rng, context, log)
    return res


def _batched_drafts(m, ss, rs, cap: int) -> list[list[int]]:
    """Each stream's drafts for its trace round as a shared round makes them (engine.run_drafts): the
    MTP rounds' chains in one model.mtp_draft_batch (as deep as the deepest), the suffix rounds' on
    the host. Every draft is the chain's argmax (no gate: the trace decides acceptance)."""
    drafts: list[list[int] | None] = [None] * len(ss)
    calls = []
    for i, (sm, r) in enumerate(zip(ss, rs)):
        d = min(len(r["drafts"]), cap)
        if r["source"] == "mtp" and d:
            steps = max(d, int(r.get("mtp_steps", d))) if d == len(r["drafts"]) else d
            calls.append((i, d, sm.ladder.chain_call(steps, sm.st.position)))
        else:
            drafts[i] = sm.draft(r, cap)
    if calls:
        outs = m.mtp_draft_batch([c.kv for _, _, c in calls], [c.rows for _, _, c in calls],
                                 [c.next_ids for _, _, c in calls], [c.start for _, _, c in calls],
                                 max(c.depth for _, _, c in calls))
        for (i, d, call), (ids, margins) in zip(calls, outs):
            drafts[i] = ss[i].ladder.chain_result(call, ids, margins, float("-inf")).tokens[:d]
    return drafts


def _streams(m, states, prompts, streams, tokenizer, rng, context: int, log) -> dict:
    """C sequences at once: the ways a scheduler round can move them (engine/share_policy.py), each
    timed over STREAM_ROUNDS rounds with host time, after a warm pass that captures its graphs --
    "shared": one decode_batch of C plain lanes per round, each stream's token and hidden row read and
    its drafters fed (spec.py _shared_round's work with one lane), the MTP backlog written at the end;
    "groups" (a model with verify_batch, C <= max_batch): one verify_batch per round of every stream's
    trace round, its drafts cut to its share of the sweep (verify_lanes // C lanes, as the scheduler
    shares them) and the MTP ones drafted in one mtp_draft_batch, each group's recorded count accepted,
    one commit_batch;
    "turns": every stream's own trace round in turn (stream i starts i / C of the way into the trace
    rounds, so the streams replay different rounds). Aggregate tokens/s of each; SharePolicy measures
    the same quantities and takes the largest (or a mix)."""
    flat = [r for p in prompts for r in p]
    out = {}
    for c in streams:
        sts = states[:c]

        def fresh():
            for st in sts:
                st.position = context
                st.mtp_kv.length = context - 1
                st.mtp_position = context - 1
            return [_Stream(m, st, tokenizer, rng, context) for st in sts]

        def rounds_at(k):
            return [flat[(k + i * len(flat) // c) % len(flat)] for i in range(c)]

        def turns():
            ss = fresh()
            tokens, t0 = 0, time.perf_counter()
            for k in range(STREAM_ROUNDS):
                for sm, r in zip(ss, rounds_at(k)):
                    tokens += sm.spec_round(r)
            m.stream.synchronize()
            return tokens, time.perf_counter() - t0

        def shared():
            ss = fresh()
            t0 = time.perf_counter()
            for _ in range(STREAM_ROUNDS):
                outs = m.decode_batch(sts, [sm.pending for sm in ss])
                for sm, o in zip(ss, outs):
                    sm.feed(np.array(o.hidden[-1:]), [int(o.greedy_ids()[0])])
            for sm in ss:
                sm.ladder.flush()
            m.stream.synchronize()
            return c * STREAM_ROUNDS, time.perf_counter() - t0

        def groups():
            ss = fresh()
            cap = max(1, m.verify_lanes // c) - 1  # drafts per group: its share of the sweep, less its token
            tokens, t0 = 0, time.perf_counter()
            for k in range(STREAM_ROUNDS):
                rs = rounds_at(k)
                lanes = [[sm.pending] + d for sm, d in zip(ss, _batched_drafts(m, ss, rs, cap))]
                outs = m.verify_batch(sts, lanes)
                kept = []
                for r, o, ln in zip(rs, outs, lanes):  # every group read before the commit (scratch rule)
                    n = min(int(r["accepted"]), len(ln))
                    kept.append(([int(x) for x in o.greedy_ids()[:n]], np.array(o.hidden[:n])))
                m.commit_batch(sts, [o.trace for o in outs], [len(new) for new, _ in kept])
                for sm, (new, hidden) in zip(ss, kept):
                    sm.feed(hidden, new)
                    tokens += len(new)
            m.stream.synchronize()
            return tokens, time.perf_counter() - t0

        modes = [("turns", turns), ("shared", shared)]
        if m.verify_lanes > 0 and c <= m.max_batch:
            modes.append(("groups", groups))
        row = {}
        for name, fn in modes:
            fn()  # warm: its graphs captured
            tokens, secs = fn()
            row[name] = {"tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs,
                         "per_stream_tokens_per_s": tokens / secs / c}
        row["faster"] = max((name for name, _ in modes), key=lambda k: row[k]["tokens_per_s"])
        row["turns_over_shared"] = row["turns"]["tokens_per_s"] / row["shared"]["tokens_per_s"]
        line = (f"  C={c}: turns {row['turns']['tokens_per_s']:.1f} t/s ({row['turns']['per_stream_tokens_per_s']:.1f} per "
                f"stream), shared {row['shared']['tokens_per_s']:.1f} t/s ({row['shared']['per_stream_tokens_per_s']:.1f}); "
                f"turns / shared {row['turns_over_shared']:.2f}")
        if "groups" in row:
            row["groups_over_shared"] = row["groups"]["tokens_per_s"] / row["shared"]["tokens_per_s"]
            line += (f"; groups {row['groups']['tokens_per_s']:.1f} t/s ({row['groups']['per_stream_tokens_per_s']:.1f}), "
                     f"groups / shared {row['groups_over_shared']:.2f}")
        out[c] = row
        log(line)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", type=Path, nargs="+", default=[TRACES])
    ap.add_argument("--tier", default="q4s")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--streams", type=int, nargs="+", default=None, metavar="C",
                    help="also C sequences at once: solo rounds in turn against one shared sweep per round (and, with "
                         "Q27_VERIFY_GROUPS=1, the sweep carrying each stream's drafts)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import sys

    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    results = [run(t, args.tier, args.context, log=log, streams=args.streams) for t in args.traces]
    if args.json:
        print(json.dumps(results, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
