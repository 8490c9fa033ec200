"""Drafts inside the shared sweep (issue 15 item 2, EngineConfig.batch_spec "drafts" / "adaptive"): each
sharing slot's group -- its pending token plus up to its share of the sweep's flat width in drafts --
runs in ONE model.verify_batch, each group walks its own rows as a solo round does (decoder.accept_walk)
and one commit_batch keeps every group's accepted tokens.

What must hold, on the CPU fast path through LocalEngine and the scheduler (the Probe model enforces the
CUDA fast path's scratch rules: every group reads its rows before any later model call, commit_batch
directly after its verify_batch):
- every request's tokens, logprobs and finish are bitwise those it gets alone (greedy, sampled,
  constrained, different lengths, slots joining and leaving);
- the groups really carried drafts, within each slot's share of the sweep (sweep_lanes / sharing slots)
  and never past the model's verify_lanes or max_batch in one call;
- a failed verify_batch ends only the slots whose groups it carried;
- with plain lanes two speculating streams take turns (test_share_policy); with drafts in the sweep,
  sharing yields as much as turns for one sweep, and the policy shares.
"""

import numpy as np
import pytest

from q27py.engine.api import GenerationRequest, OutputConstraint, SamplingParams
from q27py.engine.engine import sweep_parts
from q27py.engine.scheduler import Scheduler
from fast_path_rules import Probe
from sched_jobs import Job, drain
from test_share_policy import TEXTS, alone, counting_mtp, gpu_clock, make_engine


def reqs(tok, n, sampled=False, constrained=False, lengths=None):
    out = []
    for i in range(n):
        constrain = constrained and i == 2
        out.append(GenerationRequest(
            prompt_ids=tok.encode(TEXTS[i % len(TEXTS)] * (1 + i % 2)),
            max_tokens=(lengths or [48 + 5 * j for j in range(n)])[i],
            sampling=SamplingParams(temperature=0.8, seed=11 + i) if sampled else SamplingParams(),
            logprobs=2 if i % 2 == 0 else None,
            constraint=OutputConstraint("json_object") if constrain else None,
            stop_ids=frozenset(tok.eos_ids) if constrain else frozenset()))
    return out


def run(engine, requests, arrivals=None, clock=None):
    sched = Scheduler(engine, clock=clock) if clock else Scheduler(engine)
    jobs = [Job(str(i), r) for i, r in enumerate(requests)]
    arrivals = arrivals or [0] * len(jobs)
    rnd = 0
    while True:
        for j, at in zip(jobs, arrivals):
            if at == rnd:
                sched.submit(j)
        if rnd > max(arrivals) and not sched.wait(timeout=0):
            break
        sched.round()
        rnd += 1
    return sched, jobs


@pytest.mark.parametrize("sampled,constrained", [(False, False), (True, False), (True, True)])
def test_groups_in_the_sweep_keep_every_requests_tokens(fast, tok, sampled, constrained):
    probe = Probe(fast)
    engine = make_engine(probe, tok, 4, batch_spec="drafts")
    assert engine.sweep_lanes == fast.verify_lanes == 16
    requests = reqs(tok, 4, sampled, constrained)
    sched, jobs = run(engine, requests, arrivals=[0, 0, 3, 9])  # slots join while others decode
    solo = [alone(fast, tok, r) for r in reqs(tok, 4, sampled, constrained)]
    assert [j.tokens for j in jobs] == [s.tokens for s in solo]
    assert [j.logprobs for j in jobs] == [s.logprobs for s in solo]
    assert [j.finish for j in jobs] == [s.finish for s in solo]
    groups = probe.group_batches()
    assert sched.solo_turns == 0 and len(groups) > 10
    assert sum(max(w) > 1 for w in groups) > 5, "the sweep carried drafts"
    # each call within the model's limits, each group within its slot's share of the sweep
    assert all(sum(w) <= 16 and len(w) <= probe.max_batch for w in groups)
    assert all(max(w) <= engine.decoder.width for w in groups), groups
    # every verify_batch was followed by its commit_batch, nothing in between (the Probe raises otherwise)
    calls = [c[0] for c in probe.calls]
    assert all(calls[i + 1] == "commit_groups" for i, c in enumerate(calls) if c == "groups")


def test_a_slots_share_follows_the_sharing_count_and_what_the_others_leave(fast, tok):
    """The 16 lanes are water-filled by what each slot's drafters would use (Pace.want_lanes): with two,
    three and four slots sharing, groups carry drafts; no call passes 16 lanes or a slot's own verify
    width; and a slot that drafts long (suffix matches in repeated text) takes lanes an even share
    would not give it while the others draft short."""
    probe = Probe(fast)
    engine = make_engine(probe, tok, 4, batch_spec="drafts")
    run(engine, reqs(tok, 4, lengths=[150, 150, 150, 150]), arrivals=[0, 0, 3, 6])
    widest = {}
    for w in probe.group_batches():
        assert sum(w) <= 16 and max(w) <= engine.decoder.width
        widest[len(w)] = max(widest.get(len(w), 0), max(w))
    assert set(widest) >= {2, 3, 4}, widest
    assert all(w > 1 for w in widest.values()), widest
    assert widest[3] > 16 // 3 or widest[4] > 16 // 4, widest  # beyond an even share


def test_share_lanes():
    from q27py.engine.share_policy import share_lanes

    assert share_lanes(16, [8, 8]) == [8, 8]
    assert share_lanes(16, [8, 8, 2, 2]) == [6, 6, 2, 2]
    assert share_lanes(16, [8, 8, 8]) == [6, 5, 5]
    assert share_lanes(16, [4] * 8) == [2] * 8
    assert share_lanes(16, [1] * 20) == [1] * 20  # more slots than lanes: one each
    assert share_lanes(16, [3, 3]) == [3, 3]  # wants below the sweep: the rest stays unused
    assert share_lanes(16, []) == []
    for wants in ([8, 2, 5, 7], [4, 4, 4, 4, 4], [8] * 3, [2, 8]):
        got = share_lanes(16, wants)
        assert sum(got) <= 16 and all(1 <= g <= max(1, w) for g, w in zip(got, wants))


def test_wanted_lanes():
    """DraftPlanner.wanted: the whole width after a suffix proposal, the ladder's depth + 1, two while
    paused or without a ladder (never one: a slot that drafts nothing would never ask for more)."""
    from q27py.config import SpecConfig
    from q27py.engine.drafters import DraftPlanner, SuffixIndex

    cfg = SpecConfig()
    suffix = SuffixIndex(key_len=2)
    suffix.extend([1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    p = DraftPlanner(cfg, None, suffix)
    assert p.wanted(8) == 2
    p.plan(7, 10)
    assert p.last_proposal > 0 and p.wanted(8) == 8
    assert DraftPlanner(cfg, None, None).wanted(8) == 2


def four_slots(probe, tok, max_tokens: int, rounds: int):
    """A "drafts" engine of four slots on `probe`, four requests of TEXTS submitted and `rounds` rounds run."""
    engine = make_engine(probe, tok, 4, batch_spec="drafts")
    sched = Scheduler(engine)
    jobs = [Job(str(i), GenerationRequest(tok.encode(TEXTS[i]), max_tokens)) for i in range(4)]
    for j in jobs:
        sched.submit(j)
    for _ in range(rounds):
        sched.round()
    return engine, sched, jobs


def fault_in_the_fifth_round(fast, tok, probe, fault) -> None:
    """Four slots (two per call: the probe's max_batch 2) decode for four rounds; `fault(engine)` arms a
    device fault for the fifth: the call it hits ends its two slots and nothing else -- the other two
    keep their solo tokens, and the failed slots' sequences are not kept for reuse."""
    engine, sched, jobs = four_slots(probe, tok, 24, rounds=4)
    fault(engine)
    sched.round()
    probe.fail_batch = None
    failed = [j for j in jobs if j.items and isinstance(j.items[-1], RuntimeError)]
    assert len(failed) == 2, "the call of two with the faulty one ended both of its slots, nothing else"
    drain(sched)
    for i, j in enumerate(jobs):
        if j not in failed:
            assert j.tokens == alone(fast, tok, GenerationRequest(tok.encode(TEXTS[i]), 24)).tokens
    assert len([s for s in engine.prefix.slots if s.tokens]) == 2  # the failed slots' sequences dropped


def test_a_failed_verify_batch_ends_only_its_groups(fast, tok):
    probe = Probe(fast, max_batch=2)

    def fault(engine):  # the call holding the first busy sequence's group faults
        busy = [seq.state for seq in engine.prefix.slots if seq.busy]
        probe.fail_batch = {id(busy[0])}

    fault_in_the_fifth_round(fast, tok, probe, fault)


def test_adaptive_shares_when_the_sweep_carries_drafts(fast, tok):
    """The weight-bound clock of test_share_policy (a sweep of <= 16 lanes costs about one step): with
    plain lanes two speculating streams take turns; with drafts in the sweep one shared round yields
    what two turns yield, so the policy keeps them sharing (probing turns now and then). Tokens are
    the solo ones either way."""
    want = [alone(fast, tok, r).tokens for r in reqs(tok, 2, lengths=[300, 300])]
    split = {}
    for lanes in (0, None):  # a model without verify_batch, then the CPU path's (16 lanes)
        probe = Probe(fast, verify_lanes=lanes)
        counting_mtp(probe)
        engine = make_engine(probe, tok, 2)
        assert engine.batch_spec == "adaptive" and engine.sweep_lanes == (lanes if lanes is not None else 16)
        sched, jobs = run(engine, reqs(tok, 2, lengths=[300, 300]), clock=gpu_clock(probe))
        assert [j.tokens for j in jobs] == want
        split[lanes] = (sched.batched_rounds, sched.solo_turns)
        if lanes is None:
            # the shared rounds verified drafts: more tokens than rounds, drafts proposed and accepted
            stats = [j.stats for j in jobs]
            assert all(s["tokens_per_round"] > 1.5 and sum(s["accepted_by_depth"]) > 10 for s in stats), stats
    (plain_shared, plain_turns), (drafts_shared, drafts_turns) = split[0], split[None]
    assert plain_turns > 2 * plain_shared, split  # turns win against plain lanes
    assert drafts_shared > drafts_turns, split  # the sweep wins once it carries drafts


def test_solo_only_and_plain_decoding_keep_plain_lanes(fast, tok):
    probe = Probe(fast)
    engine = make_engine(probe, tok, 2, batch_spec="solo-only")
    assert engine.sweep_lanes == 0
    run(engine, reqs(tok, 2))
    assert probe.batches() and not probe.group_batches()
    plain = make_engine(Probe(fast), tok, 2, spec=False)
    assert plain.batch_spec == "solo-only" and plain.sweep_lanes == 0
    assert make_engine(Probe(fast, verify_lanes=0), tok, 2).sweep_lanes == 0  # a model without verify_batch
    # ... where "drafts" cannot be had: a clear error at start, not plain lanes in silence
    from q27py.errors import ConfigError

    with pytest.raises(ConfigError, match="verify_batch"):
        make_engine(Probe(fast, verify_lanes=0), tok, 2, batch_spec="drafts")


def test_sweep_parts():
    assert sweep_parts([8, 8], 16, 16) == [[0, 1]]
    assert sweep_parts([5, 5, 5, 5], 16, 16) == [[0, 1, 2], [3]]
    assert sweep_parts([1] * 5, 2, 16) == [[0, 1], [2, 3], [4]]
    assert sweep_parts([3, 16, 1], 16, 16) == [[0], [1], [2]]
    with pytest.raises(ValueError):
        sweep_parts([17], 16, 16)
    with pytest.raises(RuntimeError):
        sweep_parts([2], 16, 0)


# ---- the sharing slots' MTP chains in one batch (LocalEngine.batch_drafts, run_drafts) -----------------


def test_the_reference_chain_keeps_the_host_ladders_drafts(fast, tok):
    """ReferenceModel.mtp_draft_chain (the fast path's one-call ladder, here its host steps) gives the
    ladder the drafts its host steps give, gate and probe included, and leaves the same MTP KV."""
    from q27py.engine.drafters import MTPLadder

    rng = np.random.default_rng(3)
    for margin, depth in ((float("-inf"), 5), (1.5, 6), (float("-inf"), 1)):
        got = []
        for on_device in (False, True):
            model = Probe(fast, drafts_on_device=on_device)
            st = fast.new_state()
            ids = tok.encode(TEXTS[0] * 3)
            out = fast.forward(st, ids)
            ladder = MTPLadder(model, st.mtp_kv)
            ladder.defer(out.hidden[:-1], ids[1:])
            ladder.defer(out.hidden[-1:], [int(np.argmax(out.logits[-1]))])
            probe_tok = int(rng.integers(0, 50))
            d = ladder.draft(depth, margin, st.position, stop_if_first=lambda t: t == probe_tok)
            got.append((d.tokens, d.gated, st.mtp_kv.length, [c[0] for c in model.calls]))
        assert got[0][:3] == got[1][:3], (margin, depth, got)
        assert "chain" in got[1][3] and "chain" not in got[0][3]


@pytest.mark.parametrize("sampled", [False, True])
def test_batched_chains_keep_every_requests_tokens(fast, tok, sampled):
    probe = Probe(fast, drafts_on_device=True)
    engine = make_engine(probe, tok, 4, batch_spec="drafts")
    assert engine.batch_drafts and engine.sweep_lanes == 16
    requests = reqs(tok, 4, sampled, constrained=sampled)
    sched, jobs = run(engine, requests, arrivals=[0, 0, 2, 5])
    solo = [alone(fast, tok, r) for r in reqs(tok, 4, sampled, constrained=sampled)]
    assert [j.tokens for j in jobs] == [s.tokens for s in solo]
    assert [j.logprobs for j in jobs] == [s.logprobs for s in solo]
    batches = [c for c in probe.calls if c[0] == "chains"]
    assert len(batches) > 5 and max(c[1] for c in batches) >= 3, batches
    # each batch runs as deep as its deepest ladder asked, within the groups' widths
    assert all(1 <= c[2] <= 15 for c in batches)
    # a chain batch precedes each sweep that carries MTP drafts; no chain runs alone inside a shared round
    kinds = [c[0] for c in probe.calls if c[0] in ("chains", "chain", "groups", "batch")]
    assert "groups" in kinds
    assert not plain_engine_batches(fast, tok)


def plain_engine_batches(fast, tok):
    """A model that drafts on the host (drafts_on_device False) never batches chains."""
    probe = Probe(fast)
    engine = make_engine(probe, tok, 2, batch_spec="drafts")
    assert not engine.batch_drafts
    run(engine, reqs(tok, 2, lengths=[20, 20]))
    return [c for c in probe.calls if c[0] == "chains"]


def test_a_failed_chain_batch_ends_only_its_slots(fast, tok):
    probe = Probe(fast, max_batch=2, drafts_on_device=True)

    def fault(engine):
        probe.fail_chains = 1  # the round's first batch of two chains

    fault_in_the_fifth_round(fast, tok, probe, fault)
    assert probe.fail_chains == 0 and sum(c[0] == "chains" for c in probe.calls) >= 2


def test_spec_replay_batches_the_streams_chains_as_the_engine_does(fast, tok):
    """bench spec-replay's "groups" mode drafts its MTP rounds in one mtp_draft_batch
    (spec_replay._batched_drafts): each stream's drafts are those its own ladder gives for the round."""
    from q27py.bench.spec_replay import _batched_drafts, _Stream

    def streams():
        out = []
        for i, text in enumerate(TEXTS[:3]):
            st = fast.new_state()
            ids = tok.encode(text * 2)
            fast.forward(st, ids)
            sm = _Stream(fast, st, tok, np.random.default_rng(i), 0)
            sm.suffix.extend(ids)
            out.append(sm)
        return out

    rs = [{"source": "mtp", "drafts": [0] * 4, "mtp_steps": 5}, {"source": "suffix", "drafts": [5, 6]},
          {"source": "mtp", "drafts": [0] * 2}]
    # _Stream starts its ladder with one random backlog row at position 0: give it the prompt's
    got = _batched_drafts(fast, [_rewarm(sm) for sm in streams()], rs, cap=3)
    want = [sm.draft(r, 3) for sm, r in zip([_rewarm(sm) for sm in streams()], rs)]
    assert got == want and len(got[0]) == 3 and len(got[2]) == 2 and got[1] == [5, 6]


def _rewarm(sm):
    """A replay stream whose MTP ladder holds the prompt's rows (kv.length + backlog == position)."""
    from q27py.engine.drafters import MTPLadder

    st = sm.st
    st.mtp_kv.truncate(0)
    sm.ladder = MTPLadder(sm.m, st.mtp_kv)
    rng = np.random.default_rng(st.position)
    sm.ladder.defer(rng.standard_normal((st.position, sm.m.cfg.hidden_size)).astype(np.float32),
                    rng.integers(0, 100, st.position).tolist())
    return sm


@pytest.mark.parametrize("phase", ["before", "drafting", "verify"])
def test_a_cancel_in_any_phase_of_a_drafted_shared_round(fast, tok, phase):
    """Four slots share rounds with drafts and batched chains; one client leaves before a round (its slot
    ends with no model work), while the round's chains run, or while its verify_batch runs (the round
    completes for it, the next step ends it). Either way it ends "cancelled", its slot frees, and the
    others keep their solo tokens."""
    probe = Probe(fast, drafts_on_device=True)
    engine, sched, jobs = four_slots(probe, tok, 40, rounds=3)
    assert any(c[0] == "chains" for c in probe.calls) and probe.group_batches()
    leaving = jobs[1]
    if phase == "before":
        leaving.request.cancel.set()
    elif phase == "drafting":
        inner = probe.mtp_draft_batch

        def leave_then_draft(*args):
            leaving.request.cancel.set()
            return inner(*args)

        probe.mtp_draft_batch = leave_then_draft
    else:
        probe.on_batch = leaving.request.cancel.set
    calls = len(probe.calls)
    sched.round()
    if phase == "before":  # no model work for it in that round: three groups in the sweep
        assert leaving.finish == "cancelled"
        assert all(len(c[1]) == 3 for c in probe.calls[calls:] if c[0] == "groups")
    drain(sched)
    assert leaving.finish == "cancelled" and sched.counts()[0] == 0
    for i, j in enumerate(jobs):
        if j is not leaving:
            assert j.tokens == alone(fast, tok, GenerationRequest(tok.encode(TEXTS[i]), 40)).tokens
    assert sum(seq.busy for seq in engine.prefix.slots) == 0
