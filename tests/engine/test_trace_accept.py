"""bench/trace_accept.py: recorded acceptance for the real engine on weights that accept nothing
(`bench load --random-weights 27b --traces ...`). What must hold, on the CPU fast path:
- the recorded rounds are read as drafts accepted per round (a round's "accepted" minus its own pick);
- each verify forward accepts exactly min(recorded, offered) drafts, as the engine's own stats count
  them, and everything else (the tokens' count, stops, commits) is the real engine's;
- the load bench runs the scheduler over it and reports what was forced.
"""

import json

from q27py.bench.load import run_load
from q27py.bench.spec_replay import TRACES
from q27py.bench.trace_accept import TraceAcceptance, recorded_acceptance
from q27py.config import Q27Config
from q27py.engine.api import GenerationRequest
from q27py.engine.engine import LocalEngine


def test_recorded_acceptance_reads_the_bundled_traces(tmp_path):
    acc = recorded_acceptance([TRACES])
    data = json.loads(TRACES.read_text())
    rounds = [r for p in data["prompts"] for r in p["rounds"] if r.get("lanes", 1) > 0]
    assert acc == [max(0, r["accepted"] - 1) for r in rounds] and max(acc) >= 3 and min(acc) == 0
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"prompts": []}))
    try:
        recorded_acceptance([empty])
    except ValueError:
        pass
    else:
        raise AssertionError("no rounds must be refused")


def _engine(model, tok, slots=1):
    cfg = Q27Config()
    cfg.spec.enabled = True
    cfg.spec.trace = True  # the per-round record in the final stats
    cfg.engine.max_slots = slots
    cfg.engine.checkpoint_every = 0
    return LocalEngine(cfg, model, tok)


def test_each_verify_accepts_the_recorded_count(fast, tok):
    pattern = [0, 3, 1, 7, 2]
    model = TraceAcceptance(fast, pattern)
    req = GenerationRequest(prompt_ids=tok.encode("The river runs through the old town, and "), max_tokens=60)
    chunks = list(_engine(model, tok).generate(req))
    stats = chunks[-1].stats
    assert sum(len(c.token_ids) for c in chunks) == 60
    assert model.rounds >= 5
    assert sum(stats["accepted_by_source"].values()) == model.drafts_accepted > 0
    assert sum(stats["drafted_by_source"].values()) == model.drafts_offered
    # round by round: min(recorded, offered), as the engine's own trace counts the committed tokens
    trace = [r for r in stats["trace"] if r["drafts"]]
    assert len(trace) == model.rounds
    want = [min(pattern[i % len(pattern)], len(r["drafts"])) for i, r in enumerate(trace)]
    assert [r["accepted"] - 1 for r in trace] == want
    # the records' uncapped sum over the same rounds
    assert model.drafts_recorded == sum(pattern[i % len(pattern)] for i in range(model.rounds))
    # a round without drafts is a plain decode step, never a one-lane verify (those come from shared groups)
    assert model.undrafted == 0 and any(not r["drafts"] for r in stats["trace"])


def test_the_load_bench_reports_the_forced_rounds(fast, tok):
    model = TraceAcceptance(fast, recorded_acceptance([TRACES]))
    cfg = Q27Config()
    cfg.spec.enabled = True
    cfg.engine.max_slots = 2
    cfg.engine.max_context = 2048
    cfg.engine.checkpoint_every = 0
    cfg.engine.batch_rounds = True
    cfg.engine.cpu_prefill_chunk = 64
    e = LocalEngine(cfg, model, tok)
    r = run_load(e, tok, streams=(1, 2), prompt_tokens=24, gen_tokens=24, long_tokens=None, mixed=False,
                 log=lambda *a: None)
    ra = r["recorded_acceptance"]
    assert ra["verify_rounds"] > 0 and 0 < ra["drafts_accepted"] <= ra["drafts_offered"]
    # the records' own counts, before the cap by what was offered, bound the accepted ones from above
    assert ra["drafts_accepted"] <= ra["drafts_recorded"]
    assert r["spec"] and r["batch_spec"] == "adaptive"
    assert all(row["tokens"] == row["streams"] * 24 for row in r["concurrency"])


def test_verify_groups_of_a_shared_sweep_are_forced_too(fast, tok):
    """Drafts in the shared sweep (batch_spec "drafts": every group through verify_batch): each group of
    two or more lanes takes one recorded round, as a solo verify forward does."""
    from q27py.engine.scheduler import Scheduler
    from sched_jobs import Job, drain

    model = TraceAcceptance(fast, [2])
    cfg = Q27Config()
    cfg.spec.enabled = True
    cfg.spec.trace = True
    cfg.engine.max_slots = 2
    cfg.engine.checkpoint_every = 0
    cfg.engine.batch_rounds = True
    cfg.engine.batch_spec = "drafts"
    e = LocalEngine(cfg, model, tok)
    sched = Scheduler(e)
    jobs = [Job(str(i), GenerationRequest(prompt_ids=tok.encode(t), max_tokens=40))
            for i, t in enumerate(("The river runs through the old town, and ", "def parse(line):\n    "))]
    for j in jobs:
        sched.submit(j)
    drain(sched)
    assert sched.batched_rounds > 5
    traces = [[r for r in j.stats["trace"] if r["drafts"]] for j in jobs]
    assert sum(map(len, traces)) == model.rounds > 10
    assert all(r["accepted"] - 1 == min(2, len(r["drafts"])) for t in traces for r in t)
