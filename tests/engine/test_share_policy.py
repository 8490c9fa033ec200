"""EngineConfig.batch_spec "adaptive" (engine/share_policy.py, issue 15 item 2): each round with two
or more decoding slots splits them between the shared weight sweep and their own speculative
rounds taken in turn, by measured tokens per second. What must hold:

- the plan is the tokens-per-second optimum of the averages it was fed (all shared, all solo, or
  the high-acceptance slots solo beside a sweep), never a one-lane sweep, and unknown slots are
  probed one per round with growing spacing;
- through the scheduler and the real engine (CPU fast path, a clock that charges model work as a
  weight-bound GPU does): two speculating streams run their own rounds in turn, a batch of plain
  streams shares, and every request's tokens and logprobs are bitwise those it gets alone.
"""

import pytest

from q27py.config import Q27Config
from q27py.engine.api import GenerationRequest, SamplingParams
from q27py.engine.engine import LocalEngine
from q27py.engine.scheduler import Scheduler
from q27py.engine.share_policy import PROBE_FIRST, PROBE_MAX, SharePolicy, SoloStats
from fast_path_rules import Probe
from sched_jobs import Job, drain


def measured(tokens, seconds, rounds=3):
    s = SoloStats()
    for _ in range(rounds):
        s.add(tokens, seconds)
    s.probe_at = 10**9  # no probe in the way of the plan under test
    return s


def test_solo_only_and_unmeasured_sweeps_share():
    stats = [measured(3.0, 0.010), measured(3.0, 0.010)]
    assert SharePolicy("solo-only").plan(stats) == [False, False]
    p = SharePolicy("adaptive")
    assert p.plan(stats) == [False, False], "the sweep is measured first"
    assert p.plan([measured(3.0, 0.010)]) == [False], "one slot is never planned"


def test_two_speculating_streams_take_turns_sixteen_share():
    p = SharePolicy("adaptive")
    p.observe_shared(2, 0.0105)
    p.observe_shared(16, 0.013)
    # 3 tokens per own round of ~one step: 6 tokens / 20 ms beat 2 / 10.5 ms
    assert p.plan([measured(3.0, 0.010), measured(3.0, 0.010)]) == [True, True]
    # 16 streams: 16 tokens / 13 ms beat every split (a turn adds 2 tokens for 10 ms)
    assert p.plan([measured(3.0, 0.010) for _ in range(16)]) == [False] * 16
    # no gain per own round (no drafts accepted): share
    assert p.plan([measured(1.0, 0.009), measured(1.0, 0.009)]) == [False, False]


def test_a_high_acceptance_slot_runs_solo_beside_a_sweep():
    p = SharePolicy("adaptive")
    p.observe_shared(4, 0.011)
    p.observe_shared(3, 0.011)
    stats = [measured(1.1, 0.010), measured(6.0, 0.010), measured(1.1, 0.010), measured(1.2, 0.010)]
    # all shared 4 / 11 ms = 0.36 per ms; slot 1 on its own: (3 + 6) / 21 ms = 0.43; the others add ~0.1 token
    assert p.plan(stats) == [False, True, False, False]
    # ... and when slot 1 leaves a sweep of two, the remaining lane would be alone: it runs its own round too
    p2 = SharePolicy("adaptive")
    p2.observe_shared(3, 0.011)
    p2.observe_shared(2, 0.011)
    plan = p2.plan([measured(1.1, 0.010), measured(6.0, 0.010), measured(1.1, 0.010)])
    assert plan.count(True) in (1, 3) and plan[1] and plan.count(False) != 1


def test_unknown_slots_borrow_the_mean_and_are_probed_with_growing_spacing():
    p = SharePolicy("adaptive")
    p.observe_shared(3, 0.012)
    fresh = [SoloStats(), SoloStats(), SoloStats()]
    plans = [p.plan(fresh) for _ in range(PROBE_FIRST + 2)]
    assert all(pl == [False] * 3 for pl in plans[: PROBE_FIRST - 1]), "nothing known: share until a probe is due"
    # from round PROBE_FIRST on: one probe per round, the earliest due first
    assert plans[PROBE_FIRST - 1] == [True, False, False]
    assert plans[PROBE_FIRST] == [False, True, False]
    assert plans[PROBE_FIRST + 1] == [False, False, True]
    assert p.probes == 3
    two = SharePolicy("adaptive")
    two.observe_shared(2, 0.012)
    pair = [SoloStats(), SoloStats()]
    assert [two.plan(pair) for _ in range(PROBE_FIRST)][-1] == [True, True], "a probe never leaves a one-lane sweep"
    # a probe that keeps losing waits twice as long each time, up to PROBE_MAX
    s = fresh[0]
    assert s.probe_every == 2 * PROBE_FIRST
    for _ in range(20):
        s.probe_at = 0
        p.plan([s, measured(1.0, 0.01), measured(1.0, 0.01)])
    assert s.probe_every == PROBE_MAX
    # a slot with no average borrows the measured ones' mean
    p3 = SharePolicy("adaptive")
    p3.observe_shared(2, 0.0105)
    unknown = SoloStats(probe_at=10**9)
    assert p3.plan([measured(3.0, 0.010), unknown]) == [True, True]


def test_probes_that_could_not_pay_are_skipped():
    """max_yield (the decoder's verify width): a due probe runs only if a solo round committing max_yield
    tokens in the fastest measured solo time would raise the plan's tokens per second. The H100 load bench's
    C = 16 (2026-12-06): a 16-lane sweep ~13.4 ms, own rounds ~17 ms -- 89 probes were 42% of the run."""
    def sweep_policy(max_yield):
        p = SharePolicy("adaptive", max_yield=max_yield)
        for lanes, ms in ((16, 13.4), (15, 13.2), (2, 10.4), (1, 10.2)):
            p.observe_shared(lanes, ms / 1000)
        return p

    def sixteen():  # one slot measured on its own rounds, the others due for their first probe
        stats = [measured(3.5, 0.017)] + [SoloStats(probe_at=0) for _ in range(15)]
        return stats

    p = sweep_policy(8)
    stats = sixteen()
    plans = [p.plan(stats) for _ in range(40)]
    assert all(pl == [False] * 16 for pl in plans), "16 tokens per 13.4 ms: no solo round of <= 8 tokens can pay"
    assert p.probes == 0 and p.skipped_probes > 0
    assert stats[1].probe_every > PROBE_FIRST  # a skipped probe waits as a lost one does
    # unknown max_yield: every due probe runs, one a round (the behaviour before)
    p0 = sweep_policy(0)
    plans0 = [p0.plan(sixteen()) for _ in range(3)]
    assert all(pl.count(True) == 1 for pl in plans0) and p0.probes == 3
    # two streams: a solo round of up to 8 tokens in ~14 ms could beat 2 tokens per 10.4 ms, so the probe runs
    # even after a first solo round that undershot (2 tokens in 13.8 ms: the ladder was still learning)
    p2 = sweep_policy(8)
    first = SoloStats()
    first.add(2, 0.0138)
    first.probe_at = 0
    assert p2.plan([first, measured(2.0, 0.0138)]) == [True, True] and p2.probes == 1
    # nothing measured solo yet: probes run as due, whatever max_yield says
    p3 = sweep_policy(8)
    assert p3.plan([SoloStats(probe_at=0) for _ in range(16)]).count(True) == 1


# ---- through the scheduler and the engine -------------------------------------------------------


def make_engine(model, tok, slots, spec=True, batch_spec="adaptive"):
    cfg = Q27Config()
    cfg.spec.enabled = spec
    cfg.engine.max_slots = slots
    cfg.engine.checkpoint_every = 0
    cfg.engine.batch_rounds = True
    cfg.engine.batch_spec = batch_spec
    cfg.engine.cpu_prefill_chunk = 32
    return LocalEngine(cfg, model, tok)


def gpu_clock(probe, step_ms=10.0, lane_ms=0.2, prefill_ms_per_token=0.05, mtp_ms_per_row=0.0):
    """A clock charging model work as a weight-bound GPU does: a decode or verify forward of <= 16 lanes
    about one step (+ lane_ms per lane), a decode_batch one step + lane_ms per lane, an MTP pass a
    tenth of a step (+ mtp_ms_per_row per row: a prompt's MTP warm-up is one pass over its rows), a
    prefill piece its tokens."""
    def clock():
        ms = 0.0
        for c in probe.calls:
            if c[0] == "forward":
                ms += step_ms + lane_ms * c[2] if (c[3] or c[2] == 1) else prefill_ms_per_token * c[2]
            elif c[0] == "batch":
                ms += step_ms + lane_ms * c[1]
            elif c[0] == "groups":  # verify_batch: one sweep for every group's lanes
                ms += step_ms + lane_ms * sum(c[1])
            elif c[0] == "mtp":
                ms += step_ms / 10 + mtp_ms_per_row * c[1]
            elif c[0] in ("chain", "chains"):  # a device MTP chain: one pass per step, for all its chains
                ms += c[2] * step_ms / 10
        return ms / 1000.0
    return clock


def counting_mtp(probe):
    """Log the probe's MTP passes ("mtp", rows) for the clock."""
    inner = probe.mtp_forward

    def mtp_forward(kv, hidden, next_ids, *args, **kwargs):
        probe.calls.append(("mtp", len(next_ids)))
        return inner(kv, hidden, next_ids, *args, **kwargs)

    probe.mtp_forward = mtp_forward


TEXTS = ("def parse(line):\n    return line.split(',')\n\ndef parse(", "for i in range(10):\n    print(i)\nfor i in ",
         "The river runs through the old town, and ", "List three colours: red, green, ")


def alone(model, tok, request, spec=True):
    job = Job("alone", request)
    for chunk in make_engine(model, tok, 1, spec=spec).generate(request):
        job.deliver(chunk)
    return job


def requests(tok, n, sampled):
    return [GenerationRequest(prompt_ids=tok.encode(TEXTS[i % len(TEXTS)]), max_tokens=72 + 3 * i,
                              sampling=SamplingParams(temperature=0.8, seed=5 + i) if sampled else SamplingParams(),
                              logprobs=2 if i % 2 == 0 else None)
            for i in range(n)]


@pytest.mark.parametrize("sampled", [False, True])
def test_two_speculating_streams_take_turns_and_keep_their_tokens(fast, tok, sampled):
    """With a sweep of plain lanes (a model without verify_batch), two speculating streams do better
    in turns."""
    probe = Probe(fast, verify_lanes=0)
    counting_mtp(probe)
    engine = make_engine(probe, tok, 2)
    assert engine.batch_spec == "adaptive"
    sched = Scheduler(engine, clock=gpu_clock(probe))
    assert sched.policy.mode == "adaptive"
    assert sched.policy.max_yield == engine.decoder.width == engine.cfg.spec.max_verify_width  # probes' bound
    jobs = [Job(str(i), r) for i, r in enumerate(requests(tok, 2, sampled))]
    for j in jobs:
        sched.submit(j)
    drain(sched)
    solo = [alone(fast, tok, r) for r in requests(tok, 2, sampled)]
    assert [j.tokens for j in jobs] == [s.tokens for s in solo]
    assert [j.logprobs for j in jobs] == [s.logprobs for s in solo]
    # the sweep was measured (a shared round ran first), then turns won: speculation pays on this model
    assert sched.batched_rounds >= 1 and sched.solo_turns >= 10, (sched.batched_rounds, sched.solo_turns)
    if not sampled:  # greedy drafts are accepted from the start (sampled ones less: the averages learn slower)
        assert sched.solo_turns > 2 * sched.batched_rounds, (sched.batched_rounds, sched.solo_turns)
    verifies = [c for c in probe.calls if c[0] == "forward" and c[3] and c[2] > 1]
    assert len(verifies) >= sched.solo_turns // 2, "own rounds beside another stream verified drafts"


def test_plain_streams_share_and_solo_only_never_takes_turns(fast, tok):
    probe = Probe(fast)
    engine = make_engine(probe, tok, 3, spec=False)
    assert engine.batch_spec == "solo-only", "without speculation there is nothing to take turns for"
    sched = Scheduler(engine, clock=gpu_clock(probe))
    jobs = [Job(str(i), r) for i, r in enumerate(requests(tok, 3, False))]
    for j in jobs:
        sched.submit(j)
    drain(sched)
    assert sched.solo_turns == 0 and sched.batched_rounds > 20
    # speculation on, "solo-only": shared rounds whenever two decode
    probe2 = Probe(fast)
    sched2 = Scheduler(make_engine(probe2, tok, 2, batch_spec="solo-only"), clock=gpu_clock(probe2))
    jobs2 = [Job(str(i), r) for i, r in enumerate(requests(tok, 2, False))]
    for j in jobs2:
        sched2.submit(j)
    drain(sched2)
    assert sched2.solo_turns == 0 and sched2.batched_rounds > 10
    assert [j.tokens for j in jobs2] == [j.tokens for j in jobs[:2]]


def test_a_prompts_mtp_warm_up_is_not_timed_as_a_round(fast, tok):
    """The first decode step after a prefill runs the prompt's deferred MTP warm-up (MTP passes over its
    rows, held back until its first token was out): a one-off the policy must not average in, or a slot with a long prompt would look slow
    for good. Here it costs 300 ms against 10 ms steps; the averages stay near a step. (Plain shared lanes,
    so that turns win and both kinds of round are timed.)"""
    probe = Probe(fast, verify_lanes=0)
    counting_mtp(probe)
    engine = make_engine(probe, tok, 2)
    sched = Scheduler(engine, clock=gpu_clock(probe, mtp_ms_per_row=1.0))
    seen = []
    plan = sched.policy.plan

    def watching(stats):
        seen.extend(s.seconds for s in stats if s.rounds)
        seen.append(sched.policy.cost(len(stats)) or 0.0)
        return plan(stats)

    sched.policy.plan = watching
    long_prompt = tok.encode(TEXTS[0] * 30)[:300]
    jobs = [Job("0", GenerationRequest(prompt_ids=long_prompt, max_tokens=60)),
            Job("1", GenerationRequest(prompt_ids=tok.encode(TEXTS[1] * 30)[:300], max_tokens=60))]
    for j in jobs:
        sched.submit(j)
    drain(sched)
    warm_rows = sum(c[1] for c in probe.calls if c[0] == "mtp" and c[1] > 1)  # the prompts' held pieces
    assert warm_rows >= 2 * 250, warm_rows
    assert seen and max(seen) < 0.05, f"a warm-up was timed as a round: {max(seen):.3f} s"
    assert sched.solo_turns >= 10


def test_mixed_rounds_keep_every_requests_tokens(fast, tok):
    """Rounds where some decoding slots run their own speculative rounds while the others share one
    sweep, the split changing every round (a plan forced in rotation, whatever the clock says): every
    request's tokens and logprobs are its solo ones, sampled and constrained ones included."""
    from q27py.engine.api import OutputConstraint

    def reqs():
        out = []
        for i, r in enumerate(requests(tok, 5, sampled=(True))):
            out.append(GenerationRequest(prompt_ids=r.prompt_ids, max_tokens=30 + 4 * i, sampling=r.sampling,
                                         logprobs=r.logprobs,
                                         constraint=OutputConstraint("json_object") if i == 2 else None,
                                         stop_ids=frozenset(tok.eos_ids) if i == 2 else frozenset()))
        return out

    probe = Probe(fast)
    engine = make_engine(probe, tok, 5)
    sched = Scheduler(engine)
    turn = [0]

    def rotating(stats):
        turn[0] += 1
        n = len(stats)
        own = [(turn[0] + i) % 3 == 0 for i in range(n)]
        if sum(own) == n - 1:  # never a one-lane sweep (the scheduler's contract with the policy)
            own = [True] * n
        return own

    sched.policy.plan = rotating
    jobs = [Job(str(i), r) for i, r in enumerate(reqs())]
    for j in jobs:
        sched.submit(j)
    drain(sched)
    solo = [alone(fast, tok, r) for r in reqs()]
    assert [j.tokens for j in jobs] == [s.tokens for s in solo]
    assert [j.logprobs for j in jobs] == [s.logprobs for s in solo]
    assert [j.finish for j in jobs] == [s.finish for s in solo]
    assert sched.solo_turns > 10 and sched.batched_rounds > 10, (sched.solo_turns, sched.batched_rounds)
    # the shared sweeps carried drafts (verify_batch groups wider than one token)
    assert sum(max(w) > 1 for w in probe.group_batches()) > 5, probe.group_batches()


def test_sixteen_streams_are_not_stalled_by_probes(fast, tok):
    """Sixteen speculating streams through the scheduler and the real engine (plain-lane sweep, the GPU-like
    clock: a 16-lane sweep 13.2 ms, an own round ~10 ms + its drafting for a few tokens): with the decoder's
    max_yield bound a probe runs only while nothing was measured solo, so nearly every round is the sweep;
    without it (max_yield 0, the behaviour before) each slot probed on its own clock, 16 clocks in all, and
    the run took longer on the same clock. Tokens are each request's own either way."""
    def run(max_yield):
        probe = Probe(fast, verify_lanes=0)
        counting_mtp(probe)
        engine = make_engine(probe, tok, 16)
        clock = gpu_clock(probe)
        sched = Scheduler(engine, clock=clock)
        sched.policy.max_yield = max_yield
        reqs = [GenerationRequest(prompt_ids=tok.encode(TEXTS[i % len(TEXTS)] + str(i)), max_tokens=48)
                for i in range(16)]
        jobs = [Job(str(i), r) for i, r in enumerate(reqs)]
        for j in jobs:
            sched.submit(j)
        drain(sched)
        return sched, clock(), [j.tokens for j in jobs]

    bounded, t_bounded, tokens_bounded = run(8)
    unbounded, t_unbounded, tokens_unbounded = run(0)
    assert tokens_bounded == tokens_unbounded
    assert unbounded.policy.probes >= 16, unbounded.policy.probes  # every slot probed at least once before
    assert bounded.policy.probes <= 2 and bounded.policy.skipped_probes > 0, (bounded.policy.probes,
                                                                               bounded.policy.skipped_probes)
    assert bounded.solo_turns < unbounded.solo_turns // 4, (bounded.solo_turns, unbounded.solo_turns)
    assert t_bounded < t_unbounded, (t_bounded, t_unbounded)
