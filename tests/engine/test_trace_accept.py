"""bench/trace_accept.py: recorded acceptance for the real engine on weights that accept nothing
(`bench load --random-weights 27b --traces ...`). What must hold, on the CPU fast path:
- the recorded rounds are read as drafts accepted per round (a round's "accepted" minus its own pick);
- each verify forward accepts exactly min(recorded, offered) drafts, as the engine's own stats count
  them, and everything else (the tokens' count, stops, commits) is the real engine's;
- the load bench runs the scheduler over it and reports what was forced;
- with recorded widths (TraceAcceptance.drive_widths, the load bench's default) each round offers its
  record's drafts through the real drafters -- the MTP ladder to the record's depth (on the device-shaped
  model: an MTP chain of that depth, a shared round's in one mtp_draft_batch), a suffix round the record's
  count after the ladder's "agree" check -- and that round's verify accepts that record's count, so on
  random weights (where the suffix drafter finds nothing) the offered drafts reach the records' own.
"""

import json

import pytest

from q27py.bench.load import run_load
from q27py.bench.spec_replay import TRACES
from q27py.bench.trace_accept import Round, TraceAcceptance, recorded_acceptance, recorded_rounds
from q27py.config import Q27Config
from q27py.engine.api import GenerationRequest
from q27py.engine.engine import LocalEngine
from q27py.model.fastcpu import FastCPUModel
from q27py.model.tiny import make_tiny
from q27py.tokenizer import Tokenizer



def _load_bench_engine(model, tok):
    """Two slots, a 2K window, batched rounds, speculation on: what the load-bench tests run."""
    cfg = Q27Config()
    cfg.spec.enabled = True
    cfg.engine.max_slots = 2
    cfg.engine.max_context = 2048
    cfg.engine.checkpoint_every = 0
    cfg.engine.batch_rounds = True
    cfg.engine.cpu_prefill_chunk = 64
    return LocalEngine(cfg, model, tok)


def _two_slot_drafts_engine(model, tok):
    """A speculating engine of two slots whose shared rounds carry drafts (batch_spec "drafts"), tracing rounds."""
    cfg = Q27Config()
    cfg.spec.enabled = True
    cfg.spec.trace = True
    cfg.engine.max_slots = 2
    cfg.engine.checkpoint_every = 0
    cfg.engine.batch_rounds = True
    cfg.engine.batch_spec = "drafts"
    return LocalEngine(cfg, model, tok)

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
    e = _load_bench_engine(model, tok)
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
    e = _two_slot_drafts_engine(model, tok)
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


# ---- recorded draft widths (drive_widths): each round offers its record's drafts ----------------------

CODE_TRACES = TRACES.with_name("spec_traces_code.json")


@pytest.fixture(scope="module")
def rand(tmp_path_factory):
    """A tiny model with random weights (the 27B bench's situation: nothing it writes repeats, so the
    suffix drafter never proposes) and its tokenizer."""
    d = tmp_path_factory.mktemp("tiny-random")
    make_tiny(d, seed=1)
    return FastCPUModel.load(d), Tokenizer.from_model_dir(d)


def test_recorded_rounds_keep_each_rounds_shape(fast, tok):
    rounds = recorded_rounds([TRACES])
    data = json.loads(TRACES.read_text())
    raw = [r for p in data["prompts"] for r in p["rounds"] if r.get("lanes", 1) > 0]
    assert rounds == [Round(r["source"], len(r["drafts"]), r["accepted"] - 1, r["mtp_steps"]) for r in raw]
    assert recorded_acceptance([TRACES]) == [r.accepted for r in rounds]
    # the shapes the load bench must offer: 3-draft ladder rounds and 7-draft suffix rounds after an "agree" check
    assert Round("mtp", 3, 2, 3) in rounds and any(r.source == "suffix" and r.drafts == 7 and r.mtp_steps == 1
                                                    for r in rounds)
    decoder = _engine(fast, tok).decoder
    with pytest.raises(ValueError, match="whole rounds"):  # bare counts carry no widths
        TraceAcceptance(fast, [1, 2]).drive_widths(decoder)
    assert decoder.planner_factory is None  # the engine's own planner unless the bench installs one


def _solo(model, tok, records, tokens, width_from_records=True, prompt="The river runs through the old town, and "):
    """One greedy request through the engine over TraceAcceptance(model, records); its per-round trace."""
    trace = TraceAcceptance(model, records)
    e = _engine(trace, tok)
    if width_from_records:
        trace.drive_widths(e.decoder)
    req = GenerationRequest(prompt_ids=tok.encode(prompt), max_tokens=tokens, stop_ids=frozenset())
    chunks = list(e.generate(req))
    assert sum(len(c.token_ids) for c in chunks) == tokens
    return trace, chunks[-1].stats["trace"][1:]  # [0]: the first token, picked from the prefill


def _expected(records, rounds, tokens, width=8, max_depth=3, agree_depth=3):
    """What each round should offer and accept, record by record: the record's drafts, within the tokens
    left, the verify width and (a ladder round) the depth ceiling; and the MTP passes the host ladder runs."""
    out, produced, i = [], 1, 0
    for r in rounds:
        cap = min(width - 1, tokens - produced - 1)
        if cap <= 0:  # the last token: no drafts planned, no record drawn
            out.append(("none", 0, 1, 0))
            produced += r["accepted"]
            continue
        rec = records[i % len(records)]
        i += 1
        k = min(rec.drafts, cap, max_depth if rec.source == "mtp" else 7)
        steps = k if rec.source == "mtp" else (1 if rec.mtp_steps and k else 0)
        out.append((rec.source if k else "none", k, min(rec.accepted, k) + 1, steps))
        produced += r["accepted"]
    return out


PATTERN = [Round("mtp", 3, 3, 3), Round("suffix", 7, 2, 1), Round("mtp", 1, 1, 1), Round("none", 0, 0, 0),
           Round("suffix", 5, 5, 0), Round("suffix", 7, 7, 1), Round("mtp", 2, 0, 2)]


@pytest.mark.parametrize("which", ["trained", "random"])
def test_each_round_offers_and_accepts_its_records_width(fast, tok, rand, which):
    """Solo rounds on the host ladder: round i offers record i's drafts from record i's drafter (7-draft
    suffix rounds included, on random weights too, where the suffix drafter has nothing), runs the MTP
    passes that round ran, and its verify accepts record i's count."""
    model, tk = (fast, tok) if which == "trained" else rand
    trace, rounds = _solo(model, tk, PATTERN, 80)
    got = [(r["source"], len(r["drafts"]), r["accepted"], r["mtp_steps"]) for r in rounds]
    assert got == _expected(PATTERN, rounds, 80)
    assert sum(k for _, k, _, _ in got) == trace.drafts_offered
    assert [k for _, k, _, _ in got].count(7) >= 3  # the suffix rounds' full width, not the ladder's 3
    # one record per round planned; the forced rounds' records offered what they did, less the caps' cut
    assert trace.rounds_planned == len(rounds) and trace.rounds == sum(1 for g in got if g[1])
    assert trace.drafts_offered + trace.drafts_cut == trace.drafts_recorded_offered
    assert trace.undrafted == sum(1 for g in got if not g[1])  # the "none" records: one-lane verifies


def test_random_weights_offer_the_records_drafts(rand):
    """The load bench's gap (issue 15): on random weights the engine's own drafters offer far fewer drafts
    than the trained model's records did (no suffix proposals: ladder rounds of at most 3); with recorded
    widths the forced rounds offer the records' drafts, short only by the tokens left at a stream's end."""
    model, tk = rand
    records = recorded_rounds([TRACES, CODE_TRACES])
    own, own_rounds = _solo(model, tk, records, 120, width_from_records=False)
    assert max(len(r["drafts"]) for r in own_rounds) <= 3 and not any(r["source"] == "suffix" for r in own_rounds)
    assert own.drafts_offered < 0.8 * own.drafts_recorded_offered
    driven, rounds = _solo(model, tk, records, 120)
    assert driven.drafts_offered + driven.drafts_cut == driven.drafts_recorded_offered
    assert driven.drafts_cut <= 6 and driven.drafts_offered > own.drafts_offered
    assert driven.drafts_accepted >= driven.drafts_recorded - 6  # records accepted what they did
    assert max(len(r["drafts"]) for r in rounds) == 7


def test_device_chains_run_the_recorded_depths(fast, tok):
    """On the device-shaped model (drafts_on_device: the ladder is one mtp_draft_chain) a ladder round's
    chain is as deep as its record's drafts, and a suffix round's "agree" check runs the chain the engine's
    own check runs (to the depth ceiling); a suffix round recorded without the check runs none."""
    from fast_path_rules import Probe

    probe = Probe(fast, device=True, drafts_on_device=True)
    trace, rounds = _solo(probe, tok, PATTERN, 80)
    chains = [c[2] for c in probe.calls if c[0] == "chain"]
    want = []
    for (source, k, _, _), i in zip(_expected(PATTERN, rounds, 80), range(len(rounds))):
        rec = PATTERN[i % len(PATTERN)]
        if source == "mtp":
            want.append(k)
        elif source == "suffix" and rec.mtp_steps:
            want.append(min(7, 80 - 1 - sum(r["accepted"] for r in rounds[:i]) - 1, 3))
    assert chains == want and 3 in chains and 1 in chains and 2 in chains
    assert [len(r["drafts"]) for r in rounds] == [k for _, k, _, _ in _expected(PATTERN, rounds, 80)]


def test_shared_sweep_groups_offer_the_recorded_width(fast, tok):
    """A shared round (batch_spec "drafts", the sharing slots' chains in one mtp_draft_batch): each slot's
    group carries its record's drafts within its lane share, and its verify accepts the record's count."""
    from fast_path_rules import Probe
    from q27py.engine.scheduler import Scheduler
    from sched_jobs import Job, drain

    probe = Probe(fast, device=True, drafts_on_device=True)
    model = TraceAcceptance(probe, [Round("suffix", 7, 2, 1)])
    e = _two_slot_drafts_engine(model, tok)
    model.drive_widths(e.decoder)
    assert e.batch_drafts and e.sweep_lanes == 16
    sched = Scheduler(e)
    jobs = [Job(str(i), GenerationRequest(prompt_ids=tok.encode(t), max_tokens=40, stop_ids=frozenset()))
            for i, t in enumerate(("The river runs through the old town, and ", "def parse(line):\n    "))]
    for j in jobs:
        sched.submit(j)
    drain(sched)
    assert sched.batched_rounds > 3
    groups = [w for c in probe.calls if c[0] == "groups" for w in c[1]]
    assert groups.count(8) >= 6  # two slots of 8 lanes (7 drafts each) in the 16-lane sweep
    drafted = [r for j in jobs for r in j.stats["trace"] if r["drafts"]]
    assert all(r["source"] == "suffix" and r["accepted"] == 3 for r in drafted if len(r["drafts"]) >= 2)
    assert sum(len(r["drafts"]) == 7 for r in drafted) >= 10
    assert any(c[0] == "chains" for c in probe.calls)  # the "agree" checks' chains, batched
    assert model.drafts_offered + model.drafts_cut == model.drafts_recorded_offered


def test_the_load_bench_reports_recorded_widths(rand):
    model, tk = rand
    trace = TraceAcceptance(model, recorded_rounds([TRACES, CODE_TRACES]))
    e = _load_bench_engine(trace, tk)
    trace.drive_widths(e.decoder)
    lines = []
    r = run_load(e, tk, streams=(1, 2), prompt_tokens=24, gen_tokens=48, long_tokens=None, mixed=False,
                 log=lines.append)
    ra = r["recorded_acceptance"]
    assert ra["recorded_widths"] and ra["rounds_planned"] >= ra["verify_rounds"] > 0
    assert ra["drafts_offered"] + ra["drafts_cut"] == ra["drafts_recorded_offered"]
    assert ra["drafts_offered"] >= 0.75 * ra["drafts_recorded_offered"]
    assert any(f"drafts offered {ra['drafts_offered']} against the records' {ra['drafts_recorded_offered']}" in ln
               for ln in lines)


class _StubOut:
    def __init__(self, n: int, vocab: int):
        self.logits = __import__("numpy").zeros((n, vocab), "float32")


class _StubModel:
    """forward / verify_batch returning zero logits: only the pairing of records with rounds is under test."""

    class cfg:
        vocab_size = 50

    def forward(self, state, ids, logits_rows="all", verify=False):
        return _StubOut(len(ids), self.cfg.vocab_size)


class _State:
    pass


def test_a_planned_record_never_pairs_with_a_later_state_at_the_same_address():
    """A record drawn for a state's planned round is forced on that state's verify only. A state whose round was
    planned and that went away before its verify (a cancelled request) must not hand its record to a new state
    that CPython allocated at the same address: that state's verify draws the next record. Failed before the
    pending records were keyed by the state itself (id(state) alone: the new state popped the dead one's record)."""
    import gc

    # a state planned, then dropped; find a new one at its address (CPython reuses a freed block at once)
    reused, keep = None, []
    for _ in range(50):
        trace = TraceAcceptance(_StubModel(), [Round("mtp", 3, 3), Round("mtp", 1, 0), Round("mtp", 2, 2)])
        old = _State()
        addr = id(old)
        assert trace.plan_record(old).accepted == 3
        del old
        gc.collect()
        new = _State()
        if id(new) == addr:
            reused = new
            break
        keep.append(new)  # not at that address: keep it alive so the next try's blocks differ
    if reused is None:
        pytest.skip("this interpreter did not reuse a freed state's address")
    out = trace.forward(reused, [7, 8, 9, 10], verify=True)
    # the next record (1 drafts, 0 accepted), not the dead state's (3 accepted)
    assert trace.drafts_accepted == 0 and trace.rounds == 1
    assert out.greedy_ids()[0] != 8
    # and a live state's planned record still pairs with its own verify
    live = _State()
    assert trace.plan_record(live).accepted == 2
    trace.forward(live, [1, 2, 3, 4], verify=True)
    assert trace.drafts_accepted == 2 and trace.rounds == 2
