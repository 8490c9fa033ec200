"""Issue 14 (prefill): the first token goes out before the prompt's MTP warm-up.

The first token is chosen from the prefill's last logits row alone; the MTP head's KV rows of the
prompt (MTPLadder's warm-up after each prefill piece) are needed only by the first draft. The
speculative decoder holds those writes back (EngineConfig.mtp_defer_rows bounds the rows held, all
slots together) and runs them after the first token is out, before any draft. What must hold, on
the bundled model through LocalEngine (a recording wrapper logs every model call and every token
the consumer receives):

- the first token reaches the consumer before the last prompt piece's MTP write (before all of
  them while the bound allows);
- the MTP writes are the same calls (rows, positions, next ids) in the same order as eager
  warm-up (mtp_defer_rows 0), the outputs and every round's drafts are the same, and so is the
  state left for prefix reuse, array for array -- also with the bound forcing the earliest pieces
  to warm eagerly, across a prefix-cache restore (live snapshot and the disk tier, whose entries
  export the MTP rows), at a stop id on the first token, and with slots interleaved by the
  scheduler (one bound for all of them; a piece the scheduler cut short for decoding slots
  warms with its piece, as before, so held rows stop landing on those slots' wait);
- a request cancelled (or closed) mid-prefill drops what it held: nothing runs later, nothing is
  left in the budget.
"""

import time

import numpy as np
import pytest

from q27py.config import ConfigError, Q27Config, apply_env
from q27py.engine.api import GenerationChunk, GenerationRequest
from q27py.engine.engine import LocalEngine
from q27py.engine.scheduler import Scheduler
from q27py.io import prefix_entry
from fast_path_rules import Probe
from sched_jobs import Job, drain

TEXT = ("def parse(line):\n    fields = line.split(',')\n    return [f.strip() for f in fields]\n\n"
        "The river runs through the old town, and the bridges are older than the town. ")


class Recorder:
    """The model with every forward and MTP pass logged in `log` (shared with the consumer, which logs
    the tokens it receives). `check` (if set) runs before every main-model forward (between prefill
    pieces, where the bound on held rows must hold)."""

    def __init__(self, inner, log):
        self._m, self.log, self.check = inner, log, None

    def __getattr__(self, name):
        return getattr(self._m, name)

    def _checked(self):
        if self.check is not None:
            self.check()

    def forward(self, state, ids, *args, **kwargs):
        self._checked()
        self.log.append(("forward", id(state), len(ids)))
        return self._m.forward(state, ids, *args, **kwargs)

    def mtp_forward(self, kv, hidden, next_ids, start, logits_rows="all"):
        self.log.append(("mtp", id(kv), int(start), tuple(int(t) for t in next_ids), str(logits_rows)))
        return self._m.mtp_forward(kv, hidden, next_ids, start, logits_rows)


def make_engine(model, tok, defer, slots=1, **engine):
    cfg = Q27Config()
    cfg.spec.enabled = True
    cfg.spec.trace = True  # every round's drafts in the stats: what drafting saw
    cfg.engine.max_slots = slots
    cfg.engine.checkpoint_every = 0
    cfg.engine.mtp_defer_rows = defer
    for k, v in engine.items():
        setattr(cfg.engine, k, v)
    return LocalEngine(cfg, model, tok)


def ids_of(tok, n, text=TEXT):
    ids = tok.encode(text)
    return (ids * (n // len(ids) + 1))[:n]


def ask(ids, n, **kw):
    return GenerationRequest(prompt_ids=list(ids), max_tokens=n, stop_ids=kw.pop("stop_ids", frozenset()), **kw)


def run(engine, log, request):
    """One request through engine.generate; the consumer logs each token chunk as it arrives."""
    tokens, stats, finish = [], None, None
    for chunk in engine.generate(request):
        if chunk.token_ids:
            log.append(("token", tuple(chunk.token_ids)))
            tokens += chunk.token_ids
        if chunk.finish_reason is not None:
            stats, finish = chunk.stats, chunk.finish_reason
    return {"tokens": tokens, "trace": stats["trace"], "cached": stats["cached_tokens"], "finish": finish}


def mtp_calls(log):
    """The MTP passes in order, the cache object left out (each engine has its own)."""
    return [entry[2:] for entry in log if entry[0] == "mtp"]


def held_for_first_token(log) -> bool:
    """Whether the first token went out before some of the prompt's MTP writes (they were held): a
    warm-up write (logits_rows "none") between it and the next forward or draft."""
    first = next(i for i, e in enumerate(log) if e[0] == "token")
    upto = next((i for i in range(first, len(log)) if log[i][0] == "forward" or
                 (log[i][0] == "mtp" and log[i][4] != "none")), len(log))
    return any(e[0] == "mtp" and e[4] == "none" for e in log[first:upto])


def live_states(engine, model):
    """What the engine keeps for prefix reuse: each live sequence's tokens and exported arrays."""
    return [(seq.tokens, model.export_prefix(seq.state)) for seq in engine.prefix.slots]


def assert_same_arrays(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


def assert_same_live_states(e0, e1, model):
    s0, s1 = live_states(e0, model), live_states(e1, model)
    assert len(s0) == len(s1)
    for (tokens0, arrays0), (tokens1, arrays1) in zip(s0, s1):
        assert tokens0 == tokens1
        assert_same_arrays(arrays0, arrays1)  # MTP rows included (export_prefix's "mtp.*")


def session(model, tok, defer, turns, **engine):
    """Run `turns` (requests) on one engine; (results, MTP calls, full log, engine)."""
    log = []
    rec = Recorder(model, log)
    engine_ = make_engine(rec, tok, defer, **engine)
    results = []
    for request in turns:
        log.append(("request",))
        results.append(run(engine_, log, request))
    return results, mtp_calls(log), log, engine_


def requests_of(log):
    """A session's log cut at its requests."""
    starts = [i for i, e in enumerate(log) if e[0] == "request"] + [len(log)]
    return [log[a + 1 : b] for a, b in zip(starts, starts[1:])]


# ---- the order --------------------------------------------------------------------------


def test_first_token_reaches_the_consumer_before_the_prompts_mtp_warmup(fast, tok):
    ids = ids_of(tok, 1000)  # four 256-token pieces on the CPU path
    (res,), calls, log, engine = session(fast, tok, 32768, [ask(ids, 6)])
    first = next(i for i, e in enumerate(log) if e[0] == "token")
    assert [e[2] for e in log[:first] if e[0] == "forward"] == [256, 256, 256, 232]  # the prefill's pieces
    warm = [i for i, e in enumerate(log) if e[0] == "mtp" and e[4] == "none"]
    # the prompt's rows: 0 .. len-2 (the last prompt position waits for the first token)
    last_piece = next(i for i, e in enumerate(log) if e[0] == "mtp" and e[2] + len(e[3]) == len(ids) - 1)
    assert first < last_piece
    assert warm and first < min(warm), "every prompt piece's warm-up waited for the first token"
    # ... and all of them ran before the first draft (the next MTP pass that asks for logits)
    draft = next(i for i, e in enumerate(log) if e[0] == "mtp" and e[4] != "none")
    assert max(i for i in warm if i < draft) == last_piece and last_piece < draft
    assert engine.decoder.hold_budget.held() == 0


def test_deferred_warmup_is_eager_warmup_bit_for_bit(fast, tok):
    turns = [ask(ids_of(tok, 1000), 40), ask(ids_of(tok, 300, "Once upon a time, in a kingdom by the sea, "), 24)]
    eager, eager_calls, eager_log, e0 = session(fast, tok, 0, turns)
    held, held_calls, held_log, e1 = session(fast, tok, 32768, turns)
    assert all(held_for_first_token(part) for part in requests_of(held_log))
    assert not any(held_for_first_token(part) for part in requests_of(eager_log))
    assert held == eager
    assert held_calls == eager_calls  # the same MTP passes: rows, positions, next ids, in order
    assert any(rows != "none" for _, _, rows in held_calls), "the MTP ladder drafted"
    assert_same_live_states(e0, e1, fast)


def test_the_bound_warms_the_earliest_pieces_eagerly(fast, tok):
    ids = ids_of(tok, 1300)  # pieces of 256: the bound holds one piece, never two
    bound = 300
    eager, eager_calls, _, _ = session(fast, tok, 0, [ask(ids, 30)])
    log = []
    rec = Recorder(fast, log)
    engine = make_engine(rec, tok, bound)
    seen = []

    def within_bound():
        held = engine.decoder.hold_budget.held()
        seen.append(held)
        assert held <= bound

    rec.check = within_bound
    got = run(engine, log, ask(ids, 30))
    assert [got] == eager and mtp_calls(log) == eager_calls
    assert max(seen) > 0, "some rows were held"
    first = next(i for i, e in enumerate(log) if e[0] == "token")
    warm = [i for i, e in enumerate(log) if e[0] == "mtp" and e[4] == "none"]
    before = [i for i in warm if i < first]
    after = [i for i in warm if i > first]
    assert before and after, "the earliest pieces warmed before the first token, the last after it"
    assert all(log[i][2] < log[j][2] for i in before for j in after)
    assert engine.decoder.hold_budget.held() == 0


# ---- prefix reuse -----------------------------------------------------------------------


def test_restores_from_live_snapshots_match_eager_and_cold(fast, tok):
    base = ids_of(tok, 900)
    turns = [ask(base, 20), ask(base[:700] + ids_of(tok, 200, "List three colours: "), 30)]
    kw = dict(checkpoint_every=256, max_sequences=1)
    eager, eager_calls, _, e0 = session(fast, tok, 0, turns, **kw)
    held, held_calls, held_log, e1 = session(fast, tok, 32768, turns, **kw)
    assert all(held_for_first_token(part) for part in requests_of(held_log))
    assert held[1]["cached"] > 0, "the second turn restored a snapshot"
    assert held == eager and held_calls == eager_calls
    assert any(r["mtp_steps"] > 0 for r in held[1]["trace"]), "the restored turn drafted with the ladder"
    assert_same_live_states(e0, e1, fast)
    (cold,), _, _, _ = session(fast, tok, 32768, turns[1:], **kw)
    assert cold["cached"] == 0 and cold["tokens"] == held[1]["tokens"]


def _entries(directory, engine):
    out = {}
    for path in sorted(directory.glob("*.q27p")):
        arrays = prefix_entry.decode(path.read_bytes(), engine.prefix.disk.compat, path.name)
        out[len(arrays["tokens"])] = arrays
    return out


def test_disk_entries_hold_the_mtp_rows_and_restore_like_cold(fast, tok, tmp_path):
    base = ids_of(tok, 900)
    # a stable boundary inside the prompt: its disk entry is written mid-prefill, with writes held
    first = ask(base, 12, stable_len=600)
    follow = ask(base[:600] + ids_of(tok, 150, "Q: what is two plus two?\nA:"), 30, stable_len=600)
    runs = {}
    for defer in (0, 32768):
        d = tmp_path / f"defer{defer}"
        results, calls, log, engine = session(fast, tok, defer, [first], prefix_cache_dir=d)
        assert held_for_first_token(log) == bool(defer)
        engine.prefix.disk.flush()
        runs[defer] = results, calls, _entries(d, engine), d
    (eager, eager_calls, eager_entries, _), (held, held_calls, held_entries, held_dir) = runs[0], runs[32768]
    assert held == eager and held_calls == eager_calls
    assert 600 in held_entries and sorted(held_entries) == sorted(eager_entries)
    for n in held_entries:
        assert_same_arrays(held_entries[n], eager_entries[n])
    assert any(k.startswith("mtp.") and v.shape[0] == 599 for k, v in held_entries[600].items()), \
        "the entry holds the MTP rows up to its position - 2"
    # a fresh engine restores the entry from disk: the same tokens and drafts as eager, the tokens of a cold run
    restored = {defer: session(fast, tok, defer, [follow], prefix_cache_dir=runs[defer][3])[:2] for defer in runs}
    assert restored[32768][0][0]["cached"] == 600 and restored[32768] == restored[0]
    assert any(rows != "none" for _, _, rows in restored[32768][1]), "the restored turn drafted with the ladder"
    restored = {defer: r[0][0] for defer, r in restored.items()}
    (cold,), _, _, _ = session(fast, tok, 32768, [follow])
    assert cold["cached"] == 0 and cold["tokens"] == restored[32768]["tokens"]


def test_a_stop_id_on_the_first_token_leaves_the_state_at_rest(fast, tok):
    ids = ids_of(tok, 700)
    (probe,), _, _, _ = session(fast, tok, 0, [ask(ids, 1)])
    stop = frozenset(probe["tokens"])
    states = {}
    for defer in (0, 32768):
        (res,), calls, log, engine = session(fast, tok, defer, [ask(ids, 8, stop_ids=stop)])
        assert res["finish"] == "stop" and res["tokens"] == probe["tokens"]
        assert held_for_first_token(log) == bool(defer)  # written when the engine closed the decoder
        (seq,) = engine.prefix.slots
        assert seq.state.mtp_kv.length == seq.state.position - 1  # at rest: rows up to position - 2
        states[defer] = engine, calls
    assert states[0][1] == states[32768][1]
    assert_same_live_states(states[0][0], states[32768][0], fast)


# ---- the scheduler and cancellation -----------------------------------------------------


@pytest.mark.parametrize("batch", [False, True], ids=["solo-rounds", "shared-rounds"])
def test_interleaved_slots_match_eager_and_share_one_bound(fast, tok, batch):
    prompts = {"a": ids_of(tok, 300), "b": ids_of(tok, 1100, "Once upon a time, in a kingdom by the sea, "),
               "c": ids_of(tok, 800, "List three colours: ")}
    bound = 600
    out = {}
    for defer in (0, bound):
        log = []
        rec = Recorder(Probe(fast), log)  # under the fast path's scratch rules
        engine = make_engine(rec, tok, defer, slots=3, batch_rounds=batch, interleave_chunk=64)
        held = []
        rec.check = lambda: held.append(engine.decoder.hold_budget.held())
        sched = Scheduler(engine)
        jobs = {name: Job(name, ask(ids, 25), log, tag="deliver") for name, ids in prompts.items()}
        sched.submit(jobs["a"])
        for _ in range(3):
            sched.round()
        assert jobs["a"].tokens, "a decodes while b and c prefill beside it"
        sched.submit(jobs["b"])
        sched.submit(jobs["c"])
        drain(sched)
        assert all(j.finish == "length" for j in jobs.values())
        assert max(held) <= bound and engine.decoder.hold_budget.held() == 0
        if defer:
            assert max(held) > 0
        out[defer] = {n: (j.tokens, j.items[-1].stats["trace"]) for n, j in jobs.items()}, held
    assert out[bound][0] == out[0][0]
    for name, ids in prompts.items():  # and each is its solo run's
        (alone,), _, _, _ = session(fast, tok, bound, [ask(ids, 25)])
        assert alone["tokens"] == out[bound][0][name][0]


def per_cache(log):
    """Each MTP cache's passes in order (caches in no particular order: slots interleave differently)."""
    calls = {}
    for e in log:
        if e[0] == "mtp":
            calls.setdefault(e[1], []).append(e[2:])
    return sorted(calls.values())


def test_pieces_cut_for_decoding_slots_warm_with_their_piece(fast, tok):
    """A prompt prefilling in interleaved pieces (the scheduler cut them for decoding slots) warms each
    piece as it ends, as without holding; the first such piece also writes what was held while the
    prompt ran alone (the one round where held rows meet a decoding slot's wait)."""
    long_ids, short_ids = ids_of(tok, 1500, "Once upon a time, in a kingdom by the sea, "), ids_of(tok, 40)
    out = {}
    for defer in (0, 32768):
        log = []
        rec = Recorder(fast, log)
        engine = make_engine(rec, tok, defer, slots=2, interleave_chunk=64)
        long = Job("long", ask(long_ids, 12), log, tag="deliver")
        short = Job("short", ask(short_ids, 200), log, tag="deliver")
        seen = []
        rec.check = lambda: seen.append((short.tokens != [] and short.finish is None,
                                         engine.decoder.hold_budget.held()))
        sched = Scheduler(engine)
        sched.submit(long)
        for _ in range(2):
            sched.round()  # two full pieces, alone
        assert engine.decoder.hold_budget.held() == (512 if defer else 0)
        sched.submit(short)
        drain(sched)
        assert long.finish == short.finish == "length"
        beside = [held for decoding, held in seen if decoding]
        assert (beside[0] > 512) == bool(defer), "the rows held while the prompts ran alone"
        assert len(beside) > 10 and not any(beside[1:]), "nothing is held once a slot decodes beside the prefill"
        out[defer] = (long.tokens, long.items[-1].stats["trace"], short.tokens, short.items[-1].stats["trace"],
                      per_cache(log))
    assert out[32768] == out[0]


def test_cancel_mid_prefill_drops_the_held_writes(fast, tok):
    log = []
    rec = Recorder(fast, log)
    engine = make_engine(rec, tok, 32768, slots=2)
    sched = Scheduler(engine)
    a = Job("a", ask(ids_of(tok, 300), 40), log, tag="deliver")
    b = Job("b", ask(ids_of(tok, 1200, "Once upon a time, in a kingdom by the sea, "), 10), log, tag="deliver")
    sched.submit(a)
    for _ in range(4):
        sched.round()
    assert len(a.tokens) > 1 and engine.decoder.hold_budget.held() == 0  # a drafts: its writes all ran
    sched.submit(b)
    while engine.decoder.hold_budget.held() < 512:  # b has run two pieces and written none of them
        sched.round()
    (b_seq,) = [seq for seq in engine.prefix.slots if seq.busy and seq.state.position >= 512]
    b_state = b_seq.state  # (kept alive: its id is not reused)
    assert b.finish is None and not any(e[0] == "mtp" and e[1] == id(b_state.mtp_kv) for e in log)
    b.request.cancel.set()
    drain(sched)
    assert b.finish == "cancelled" and b.tokens == [] and a.finish == "length"
    assert engine.decoder.hold_budget.held() == 0
    assert not any(seq.busy for seq in engine.prefix.slots)
    assert b_seq.state is not b_state, "the partly prefilled state was dropped"
    assert not any(e[0] == "mtp" and e[1] == id(b_state.mtp_kv) for e in log), "b's held writes never ran"
    # a got its solo tokens; the engine serves b's prompt afterwards as a cold run does
    (alone,), _, _, _ = session(fast, tok, 32768, [ask(a.request.prompt_ids, 40)])
    assert a.tokens == alone["tokens"]
    again = run(engine, log, ask(b.request.prompt_ids, 10))
    (cold,), _, _, _ = session(fast, tok, 0, [ask(b.request.prompt_ids, 10)])
    assert again["cached"] == 0 and again["tokens"] == cold["tokens"] and again["trace"] == cold["trace"]


def test_closing_mid_prefill_drops_the_held_writes(fast, tok):
    log = []
    rec = Recorder(fast, log)
    engine = make_engine(rec, tok, 32768)
    steps = engine.steps(ask(ids_of(tok, 1000), 10))
    next(steps)
    next(steps)
    assert engine.decoder.hold_budget.held() > 0 and not any(e[0] == "mtp" for e in log)
    steps.close()
    assert engine.decoder.hold_budget.held() == 0 and not any(e[0] == "mtp" for e in log)
    assert not any(seq.busy for seq in engine.prefix.slots)


# ---- the knob ---------------------------------------------------------------------------


def test_the_knob(fast, tok):
    assert Q27Config().engine.mtp_defer_rows > 25000, "the default holds a cold 25K-token prompt whole"
    assert apply_env(Q27Config(), {"Q27_MTP_DEFER_ROWS": "0"}).engine.mtp_defer_rows == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError):
            make_engine(fast, tok, bad)
