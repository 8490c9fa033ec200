"""`q27py bench load`: the slot scheduler under concurrent streams (issue 15 deliverable 6).

Drives engine/scheduler.py directly (no HTTP, no trio): the bench is the engine thread, calling
`Scheduler.round()` until the work is done, and every delivery is timestamped where the bridge
would hand it to a client. Two parts:

- concurrency: for each C in `streams` (default 1 2 4 8 16), C requests arrive at once, each a
  distinct prompt of `prompt_tokens` and `gen_tokens` greedy tokens (no stop ids, so exactly that
  many). Streams beyond the engine's slots queue, as on the server, so TTFT includes queueing.
  Reported per C: aggregate tokens/s (all tokens / wall time from arrival to the last token),
  per-stream tokens/s (decode: tokens after the first over the time since the first; end to end:
  tokens over the time since arrival), TTFT p50/p99, inter-token gap p50/p99 (time between a
  stream's consecutive deliveries: a speculative round's tokens arrive together), rounds, the
  most slots stepped in one round (the interleaving actually reached), and the batched rounds
  (rounds whose decoding slots shared one model.decode_batch of two or more lanes: with
  EngineConfig.batch_rounds on, `--batch-rounds 1`) with the lanes they ran.
- mixed: one stream decoding; then a long prompt (`long_tokens`: 32K on the GPU, 2K on the CPU)
  arrives; once it is mid-prefill a short request arrives. Reported: the running stream's gaps
  before and during the long prefill (p50/p99/max), the long prompt's TTFT, and the short
  request's TTFT (well under the long one's when a slot is free for it: its prefill runs beside
  the long one, one chunk per round). EngineConfig.interleave_chunk (`--interleave-chunk N`) cuts
  the long prompt's pieces to N tokens while the running stream decodes: the gap bar.

Memory per slot: the largest live sequence state (FastState.nbytes on cuda: the whole window is
allocated up front; the reference state's rows as held on the CPU) plus, on cuda, the CUDA graph
bytes measured per state (GraphCache.bytes_by_state) next to the assumption the slot sizing uses
(EngineConfig.graph_bytes_per_layer x layers: gpu/forward.py graph_bytes_per_state).

Timings are wall-clock with host time included (time.perf_counter); on the CPU the numbers are
the reference fast path's, where slots split one core's speed between streams.
"""

from __future__ import annotations

import random
import time

import numpy as np

from q27py.engine.api import GenerationRequest
from q27py.engine.scheduler import Scheduler

STREAMS = (1, 2, 4, 8, 16)
LONG_GPU = 32768
LONG_CPU = 2048
SHORT_PROMPT = 32  # the mixed case's short request: a title-generation-sized prompt
SHORT_TOKENS = 8
WARM_DELIVERIES = 6  # the running stream's deliveries before the long prompt arrives (its baseline gaps)


class Stream:
    """One client: a request plus the time of every delivery (the scheduler's Job protocol)."""

    def __init__(self, name: str, request: GenerationRequest):
        self.name = name
        self.request = request
        self.submitted = time.monotonic()
        self.t_submit = time.perf_counter()
        self.arrivals: list[tuple[float, int]] = []  # (time, tokens) of each token-bearing delivery
        self.finish: str | None = None
        self.t_end: float | None = None
        self.error: BaseException | None = None

    def deliver(self, item) -> None:
        t = time.perf_counter()
        if isinstance(item, BaseException):
            self.error, self.finish, self.t_end = item, "error", t
            return
        if item.token_ids:
            self.arrivals.append((t, len(item.token_ids)))
        if item.finish_reason is not None:
            self.finish, self.t_end = item.finish_reason, t

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0][0] - self.t_submit if self.arrivals else None

    def gaps(self, start: float = float("-inf"), end: float = float("inf")) -> list[float]:
        """Gaps between consecutive deliveries whose later delivery falls in [start, end]."""
        t = [a for a, _ in self.arrivals]
        return [t[i] - t[i - 1] for i in range(1, len(t)) if start <= t[i] <= end]


def pct(values, q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


def _acceptance(model) -> dict | None:
    from q27py.bench.trace_accept import TraceAcceptance

    if not isinstance(model, TraceAcceptance):
        return None
    return {"verify_rounds": model.rounds, "drafts_offered": model.drafts_offered,
            "drafts_accepted": model.drafts_accepted, "drafts_recorded": model.drafts_recorded,
            "undrafted_verify_lanes": model.undrafted,
            # the drafts the forced rounds' records offered (drafts_offered's mark), whether each round's width
            # came from its record (TraceAcceptance.drive_widths), and then the rounds planned from records and
            # the recorded drafts the engine's caps cut (lane share, tokens left, depth ceiling)
            "drafts_recorded_offered": model.drafts_recorded_offered, "recorded_widths": model.recorded_widths,
            "rounds_planned": model.rounds_planned, "drafts_cut": model.drafts_cut}


def drive(sched: Scheduler, after_round=None) -> dict:
    """The engine thread's loop, synchronously: rounds until nothing is queued or running."""
    rounds = most = 0
    while sched.wait(timeout=0):
        stepped = sched.round()
        rounds += 1
        most = max(most, stepped)
        if after_round is not None:
            after_round()
    return {"rounds": rounds, "max_running": most, "batched_rounds": sched.batched_rounds,
            "batched_lanes": sched.batched_lanes, "solo_turns": sched.solo_turns,
            "round_seconds": {k: round(v, 4) for k, v in sched.seconds.items()}}


def _check(streams) -> None:
    for s in streams:
        if s.error is not None:
            raise RuntimeError(f"stream {s.name} failed: {s.error!r}") from s.error


class Prompts:
    """Distinct synthetic prompts of exact token counts (code-like text: the suffix drafter and the
    tokenizer see what an agent session sends). Distinct from their first tokens, so no stream
    restores another's prefix."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tok = tokenizer
        self.rng = random.Random(seed)
        self.n = 0

    def make(self, tokens: int) -> list[int]:
        from q27py.bench.replay import _code_block

        self.n += 1
        ids = self.tok.encode(f"# request {self.n}\n")
        pieces: list[list[int]] = []
        while len(ids) < tokens:
            if len(pieces) < 8:
                pieces.append(self.tok.encode(_code_block(self.rng, 12) + "\n"))
                block = pieces[-1]
            else:  # long prompts: reuse encoded blocks (encoding 32K tokens would dominate the bench)
                block = pieces[self.rng.randrange(len(pieces))]
            ids = ids + block
        return ids[:tokens]


def _request(ids: list[int], n: int) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(ids), max_tokens=n, stop_ids=frozenset())


def _sightings(engine) -> tuple[int, int] | None:
    """(steps run eagerly as new keys, captures) so far, or None without graphs (the CPU path)."""
    g = getattr(engine.model, "graphs", None)  # as memory(): the cuda model's GraphCache, or none (the CPU path)
    return (g.first_runs, g.captures) if g is not None else None


def concurrency_run(engine, prompts: Prompts, c: int, prompt_tokens: int, gen_tokens: int) -> dict:
    sched = Scheduler(engine)
    seen0 = _sightings(engine)
    streams = [Stream(f"c{c}-{i}", _request(prompts.make(prompt_tokens), gen_tokens)) for i in range(c)]
    t0 = time.perf_counter()
    for s in streams:
        s.t_submit = t0  # they arrive together
        sched.submit(s)
    counts = drive(sched)
    _check(streams)
    seen1 = _sightings(engine)
    last = max(s.arrivals[-1][0] for s in streams if s.arrivals)
    total = sum(s.tokens for s in streams)
    decode = [(s.tokens - 1) / (s.arrivals[-1][0] - s.arrivals[0][0]) for s in streams
              if s.tokens > 1 and s.arrivals[-1][0] > s.arrivals[0][0]]
    e2e = [s.tokens / (s.arrivals[-1][0] - s.t_submit) for s in streams if s.arrivals]
    ttft = [s.ttft for s in streams if s.ttft is not None]
    gaps = [g for s in streams for g in s.gaps()]
    # interleaving: did a later stream's first token come before an earlier one's last?
    overlapped = sum(1 for a, b in zip(streams, streams[1:]) if a.arrivals and b.arrivals
                     and b.arrivals[0][0] < a.arrivals[-1][0])
    return {
        "streams": c, "slots": sched.max_slots, "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens,
        "tokens": total, "wall_s": last - t0, "aggregate_tokens_per_s": total / (last - t0),
        "per_stream_decode_tokens_per_s_mean": float(np.mean(decode)) if decode else None,
        "per_stream_decode_tokens_per_s_min": float(np.min(decode)) if decode else None,
        "per_stream_tokens_per_s_mean": float(np.mean(e2e)) if e2e else None,
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "ttft_max_s": max(ttft) if ttft else None,
        "itl_p50_s": pct(gaps, 50), "itl_p99_s": pct(gaps, 99),
        "overlapping_stream_pairs": overlapped, "finish": sorted({s.finish for s in streams}),
        # CUDA graph keys first seen inside this run: eager first runs (new shapes) and captures (their second
        # sighting, ~25-40 ms each on the 27B). A warmed server has them; a run that pays many is not steady state
        "graph_first_runs": seen1[0] - seen0[0] if seen0 else None,
        "graph_captures": seen1[1] - seen0[1] if seen0 else None,
        **counts,
    }


def mixed_run(engine, prompts: Prompts, prompt_tokens: int, long_tokens: int) -> dict:
    """A running stream, a long prompt arriving beside it, a short request arriving mid-prefill."""
    sched = Scheduler(engine)
    room = engine.max_context - prompt_tokens - 1
    run = Stream("running", _request(prompts.make(prompt_tokens), room))
    long_ids = prompts.make(long_tokens)
    short_ids = prompts.make(SHORT_PROMPT)
    long = short = None
    events = {}

    def after_round():
        nonlocal long, short
        if long is None and len(run.arrivals) >= WARM_DELIVERIES:
            long = Stream("long", _request(long_ids, 1))
            events["long_submitted"] = long.t_submit
            sched.submit(long)
        elif long is not None and short is None and any(r is long.request for r in sched.running_requests()):
            # the long prompt was admitted and ran its first prefill chunk: now the short one arrives
            short = Stream("short", _request(short_ids, SHORT_TOKENS))
            events["short_submitted"] = short.t_submit
            sched.submit(short)
        if long is not None and short is not None and long.finish and short.finish:
            run.request.cancel.set()  # the measurement is over: the running stream's client leaves
        if run.finish and long is None:
            raise RuntimeError("the running stream ended before the long prompt arrived (window too small)")

    sched.submit(run)
    counts = drive(sched, after_round)
    _check([s for s in (run, long, short) if s is not None])
    t_long0 = long.t_submit
    t_long1 = long.arrivals[0][0]
    before = run.gaps(end=t_long0)
    during = run.gaps(start=t_long0, end=t_long1)
    return {
        "slots": sched.max_slots, "prefill_chunk": getattr(engine.decoder, "prefill_chunk", None),
        "interleave_chunk": getattr(engine, "interleave_chunk", 0),
        "interleave_budget_ms": getattr(engine, "interleave_budget_ms", 0), "piece_at_end": sched.piece,
        "running_prompt_tokens": prompt_tokens, "long_prompt_tokens": long_tokens,
        "short_prompt_tokens": SHORT_PROMPT, "short_gen_tokens": SHORT_TOKENS,
        "running_itl_before_p50_s": pct(before, 50),
        "running_itl_during_prefill_p50_s": pct(during, 50), "running_itl_during_prefill_p99_s": pct(during, 99),
        "running_itl_during_prefill_max_s": max(during) if during else None,
        "running_deliveries_during_prefill": len(during),
        "long_ttft_s": long.ttft, "short_ttft_s": short.ttft,
        "short_done_s": short.t_end - short.t_submit,
        "short_first_before_long": short.arrivals[0][0] < t_long1,
        "running_finish": run.finish, **counts,
    }


def _state_bytes(state) -> int:
    nbytes = getattr(state, "nbytes", None)
    if callable(nbytes):  # FastState: the whole window, allocated up front
        return int(nbytes())
    n = 0  # the reference SequenceState: KV rows as held (grown geometrically) + GDN + conv
    for cache in list(getattr(state, "kv", {}).values()) + [getattr(state, "mtp_kv", None)]:
        if cache is not None:
            n += sum(a.nbytes for a in vars(cache).values() if isinstance(a, np.ndarray))
    for g in getattr(state, "gdn", {}).values():
        n += g.recurrent.nbytes + g.conv.nbytes
    return int(n)


def _assumed_graph_bytes(engine) -> int | None:
    if engine.cfg.engine.device != "cuda" or not hasattr(engine.model, "graphs"):
        return None
    from q27py.gpu.forward import graph_bytes_per_state

    return graph_bytes_per_state(engine.model, engine.cfg.engine)


def _reserved_model_graph_bytes(engine) -> int | None:
    if engine.cfg.engine.device != "cuda" or not hasattr(engine.model, "graphs"):
        return None
    from q27py.gpu.forward import batch_graph_bytes

    return batch_graph_bytes(engine.model)


def memory(engine) -> dict:
    seqs = list(getattr(engine.prefix, "slots", []))
    state = max((_state_bytes(s.state) for s in seqs), default=0)
    graphs = getattr(engine.model, "graphs", None)
    by_state = dict(getattr(graphs, "bytes_by_state", {}) or {})
    measured = int(np.mean(list(by_state.values()))) if by_state else None
    most_bytes, most_graphs = graphs.largest_state() if graphs is not None else (None, None)
    plan = getattr(engine.model, "slot_plan", None)
    return {
        "state_bytes": state, "graph_bytes_per_state": measured,
        # the most any one state's graphs took and held (a solo stream captures the most: its verify widths,
        # logits-row sets and MTP chain shapes), and the steps run eagerly because a budget was full (GraphCache)
        "graph_bytes_per_state_max": most_bytes,
        "graphs_per_state_max": most_graphs,
        "graph_steps_over_budget": graphs.over_budget if graphs is not None else None,
        "graph_bytes_per_state_assumed": _assumed_graph_bytes(engine),
        "memory_per_slot_bytes": state + (measured or 0), "live_sequences": len(seqs),
        # the model-level graphs (decode_batch widths, verify / commit groups, mtp-batch chains): captured so
        # far, the device bytes they took, and what the slot plan reserved for all of them (kvbudget)
        "model_graphs": len(graphs.model_graphs) if graphs is not None else None,
        "model_graph_bytes": int(graphs.model_bytes) if graphs is not None else None,
        "model_graph_bytes_reserved": _reserved_model_graph_bytes(engine),
        "slot_plan": plan.describe() if plan is not None else None,
    }


def _warm_full(engine, prompts: Prompts, c: int, prompt_tokens: int, gen_tokens: int) -> int:
    """Untimed runs of the timed run's size until one meets no new graph key, at most ceil(slots / c) + 1 of them
    (one without graphs: the CPU path). Why more than one: a new request takes an idle slot that holds nothing
    first, else the least recently used one, so C streams at a time rotate over all the slots, and the solo
    steps' graphs are per state (they bake its pointers): a timed C=1 run after one warm run still met 9 new
    keys and 10 captures (run r4, 2026-12-06) -- what a server pays once per slot, not per request. Returns
    the runs made."""
    cap = 1 if _sightings(engine) is None else -(-max(1, engine.max_slots) // c) + 1
    for n in range(1, cap + 1):
        r = concurrency_run(engine, prompts, c, prompt_tokens, gen_tokens)
        if not r["graph_first_runs"] and not r["graph_captures"]:
            break
    return n


def run_load(engine, tokenizer, streams=STREAMS, prompt_tokens: int = 128, gen_tokens: int = 64,
             long_tokens: int | None = None, mixed: bool = True, seed: int = 0, log=print,
             warm_full: bool = True) -> dict:
    """warm_full: each concurrency's workload runs untimed (fresh prompts, the same sizes; _warm_full) right
    before its timed run, so the timed run meets the graph keys (verify-group widths, MTP chain shapes, solo
    widths of every slot) a server that has been serving already holds. Without it, a short C=2 run paid ~4-8 first sightings
    (an eager run ~11 ms, a capture ~36 ms, each on the H100) in ~30 rounds of ~9 ms: device run 2026-12-06
    (fifth) r3. The timed row reports what it still met (graph_first_runs / graph_captures)."""
    device = engine.cfg.engine.device
    long_tokens = long_tokens or (LONG_GPU if device == "cuda" else LONG_CPU)
    prompts = Prompts(tokenizer, seed)
    log(f"load: {type(engine.model).__name__} on {device}, {engine.max_slots} slot(s), window {engine.max_context}, "
        f"prompt {prompt_tokens} + {gen_tokens} tokens per stream, streams {list(streams)}")
    # warm: every slot's state gets its kernels compiled and its decode graphs captured (a key is
    # captured on its second run), so C=1 does not pay what C=8 would not
    warm = min(engine.max_slots, max(streams))
    for _ in range(2):
        concurrency_run(engine, prompts, warm, prompt_tokens, min(gen_tokens, 16))
    # and each smaller concurrency once: a shared sweep's graph is keyed by its width, and C streams
    # that finish together never pass through the widths below C (d14: the C=2 row of a 1 / 2 / 16 run
    # paid the width-2 captures, 203 t/s against 230 warmed)
    chunk = getattr(engine.decoder, "prefill_chunk", None)
    widths = {min(engine.max_slots, c) for c in streams}
    if mixed and chunk and engine.max_slots >= 2:
        widths.add(2)  # the mixed run's running + short streams share rounds of width 2 (e10: up to 538 ms unwarmed)
    for c in sorted(widths - {warm, 1}):
        concurrency_run(engine, prompts, c, prompt_tokens, min(gen_tokens, 16))
    if mixed and chunk and engine.max_slots >= 2:
        # and one full prefill chunk, so the long prompt's first chunk pays no first-launch costs
        # (cuBLAS workspaces, the bf16 expansion path) that a server warmed by traffic would not
        concurrency_run(engine, prompts, 1, min(chunk, long_tokens) + 1, 1)
    rows = []
    for c in streams:
        passes = _warm_full(engine, prompts, c, prompt_tokens, gen_tokens) if warm_full else 0
        r = concurrency_run(engine, prompts, c, prompt_tokens, gen_tokens)
        r["warm_passes"] = passes
        rows.append(r)
        log(f"C={c:3d}: aggregate {r['aggregate_tokens_per_s']:8.1f} t/s, per stream "
            f"{r['per_stream_decode_tokens_per_s_mean'] or 0:7.1f} t/s decode, TTFT p50 {r['ttft_p50_s'] * 1000:7.1f} "
            f"p99 {r['ttft_p99_s'] * 1000:7.1f} ms, gap p50 {(r['itl_p50_s'] or 0) * 1000:6.1f} "
            f"p99 {(r['itl_p99_s'] or 0) * 1000:6.1f} ms, {r['max_running']} running, "
            f"{r['batched_rounds']} batched rounds"
            + (f", graph keys new in the run: {r['graph_first_runs']} eager, {r['graph_captures']} captured "
               f"(after {passes} untimed run(s) of its size)" if r["graph_first_runs"] is not None else ""))
        sec = r["round_seconds"]
        log(f"       {r['rounds']} rounds, {r['solo_turns']} solo turns; seconds: shared {sec['shared']:.3f} (drafts "
            f"{sec['drafts']:.3f}, sweep {sec['sweep']:.3f}), solo {sec['solo']:.3f}, prefill {sec['prefill']:.3f}")
    base = rows[0]["aggregate_tokens_per_s"] if rows and rows[0]["streams"] == 1 else None
    out = {
        "bench": "load", "device": device, "model": type(engine.model).__name__, "model_name": engine.model_name,
        "slots": engine.max_slots, "window": engine.max_context,
        "spec": engine.cfg.spec.enabled is not False and bool(getattr(engine, "has_mtp", False)),
        # decoding slots share one decode_batch per round (EngineConfig.batch_rounds and a model with it)
        "batch_rounds": bool(getattr(engine, "shares_rounds", False)),
        # which decoding slots share a round and which take their own rounds in turn (engine/share_policy.py)
        "batch_spec": getattr(engine, "batch_spec", "solo-only"),
        # lanes a shared sweep takes in all, drafts included (0: plain lanes), and whether the sharing slots'
        # MTP chains run in one batch (engine/engine.py sweep_lanes, batch_drafts)
        "sweep_lanes": int(getattr(engine, "sweep_lanes", 0) or 0),
        "batch_drafts": bool(getattr(engine, "batch_drafts", False)),
        # `--traces` on random weights (bench/trace_accept.py): the verify rounds forced and their drafts
        "recorded_acceptance": _acceptance(engine.model),
        "interleave_chunk": getattr(engine, "interleave_chunk", 0),
        "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens, "warm_full": warm_full, "concurrency": rows,
        "aggregate_over_c1": {str(r["streams"]): r["aggregate_tokens_per_s"] / base for r in rows} if base else None,
    }
    ra = out["recorded_acceptance"]
    if ra:
        log(f"recorded acceptance: {ra['verify_rounds']} verify rounds forced, drafts offered {ra['drafts_offered']}, "
            f"accepted {ra['drafts_accepted']} of the records' {ra['drafts_recorded']}, "
            f"{ra['undrafted_verify_lanes']} verify lanes without drafts")
        widths = "on" if ra["recorded_widths"] else "off (the engine's own drafters')"
        log(f"recorded widths: {widths}; drafts "
            f"offered {ra['drafts_offered']} against the records' {ra['drafts_recorded_offered']} over the forced rounds; "
            f"{ra['rounds_planned']} rounds planned from records, {ra['drafts_cut']} recorded drafts cut by the "
            f"engine's caps (lane share, tokens left, depth ceiling)")
    if mixed and engine.max_slots < 2:
        out["mixed"] = {"skipped": "one slot: the long prompt would wait for the running stream to end"}
    elif mixed:
        m = mixed_run(engine, prompts, prompt_tokens, long_tokens)
        out["mixed"] = m
        log(f"mixed: {long_tokens}-token prefill beside a running stream: its gap p50 "
            f"{(m['running_itl_during_prefill_p50_s'] or 0) * 1000:.1f} ms, max "
            f"{(m['running_itl_during_prefill_max_s'] or 0) * 1000:.1f} ms ({m['running_deliveries_during_prefill']} "
            f"deliveries; before {(m['running_itl_before_p50_s'] or 0) * 1000:.1f} ms); long TTFT "
            f"{m['long_ttft_s']:.2f} s; short request TTFT {m['short_ttft_s'] * 1000:.0f} ms; pieces "
            f"{m['interleave_chunk']} tokens, budget {m['interleave_budget_ms'] or 0:.0f} ms, {m['piece_at_end']} at the end")
    out["memory"] = memory(engine)
    mem = out["memory"]
    log(f"memory per slot {mem['memory_per_slot_bytes'] / 2**20:.1f} MiB (state {mem['state_bytes'] / 2**20:.1f} MiB"
        + (f", graphs {mem['graph_bytes_per_state'] / 2**20:.1f} MiB measured, "
           f"{mem['graph_bytes_per_state_assumed'] / 2**20:.0f} MiB assumed; the largest state's "
           f"{mem['graph_bytes_per_state_max'] / 2**20:.1f} MiB in {mem['graphs_per_state_max']} graphs"
           if mem["graph_bytes_per_state"] is not None and mem["graph_bytes_per_state_assumed"] else "") + ")"
        + (f"; model-level graphs {mem['model_graphs']} captured, {mem['model_graph_bytes'] / 2**20:.1f} MiB measured, "
           f"{mem['model_graph_bytes_reserved'] / 2**20:.0f} MiB reserved" if mem["model_graph_bytes"] is not None
           and mem["model_graph_bytes_reserved"] is not None else "")
        + (f"; {mem['graph_steps_over_budget']} steps eager for a full graph budget"
           if mem["graph_steps_over_budget"] is not None else ""))
    return out
