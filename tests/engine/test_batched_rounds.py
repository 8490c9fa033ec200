"""Batched decode rounds (issue 15 items 2, 4, 5) on the CPU path.

With EngineConfig.batch_rounds on, the scheduler gathers one plain-decode lane per decoding
slot and runs them in ONE model.decode_batch (engine/scheduler.py); a slot alone runs its
speculative rounds. What must hold, tested on the bundled model through LocalEngine:

- every request's tokens (and logprobs) are bitwise those it gets alone -- greedy and seeded
  sampling, constrained or not, speculation on and off, prompts of different lengths, slots
  joining and leaving, one slot prefilling while others decode -- and decode_batch really ran
  with B > 1 (counted);
- the drafters stay consistent across the switch between shared and solo rounds (MTP rows of
  every committed position written, the suffix index holding the whole stream);
- the fast path's scratch rules hold (the Probe model raises otherwise): every lane of a batch
  reads its output before any later model call;
- cancellation in every phase frees the slot at once; a failed decode_batch ends only the
  slots whose lanes it carried;
- EngineConfig.interleave_chunk cuts a prompt's prefill pieces only while another slot decodes.
"""

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.config import ConfigError, Q27Config, apply_env
from q27py.engine.api import GenerationRequest, OutputConstraint, SamplingParams
from q27py.engine.decoder import DecodeStats, Decoder, Lane, Pace
from q27py.engine.engine import LocalEngine
from q27py.engine.sampling import TokenPicker
from q27py.engine.scheduler import Scheduler
from q27py.engine.spec import SpecDecoder
from q27py.model.reference import ReferenceModel
from fast_path_rules import Probe
from sched_jobs import Job, drain


@pytest.fixture(scope="module")
def reference():
    return ReferenceModel.load(DEFAULT_MODEL_DIR)


class NoBatch:
    """A model without a batched step (max_batch 0, model/interface.py): the engine keeps solo rounds
    (and never calls decode_batch)."""

    max_batch = 0

    def __init__(self, inner):
        self._m = inner

    def decode_batch(self, states, ids):
        raise AssertionError("decode_batch called on a model with max_batch 0")

    def __getattr__(self, name):
        return getattr(self._m, name)


# ---- engines, jobs, schedules -------------------------------------------------------------


def make_engine(model, tok, slots, spec=True, batch=True, **engine):
    """batch_spec "solo-only" unless asked: these tests look at the shared rounds' structure, which
    "adaptive" (tested below) makes depend on measured speed."""
    cfg = Q27Config()
    cfg.spec.enabled = spec
    cfg.engine.max_slots = slots
    cfg.engine.checkpoint_every = 0
    cfg.engine.batch_rounds = batch
    cfg.engine.batch_spec = "solo-only"
    for k, v in engine.items():
        setattr(cfg.engine, k, v)
    return LocalEngine(cfg, model, tok)


def alone(model, tok, request, spec=True, **engine):
    """The request on an engine of its own, one slot, no scheduler: its solo (speculative) rounds."""
    job = Job("alone", request)
    for chunk in make_engine(model, tok, 1, spec=spec, batch=False, **engine).generate(request):
        job.deliver(chunk)
    return job


def ids_of(tok, text, n=None):
    ids = tok.encode(text)
    return ids if n is None else (ids * (n // len(ids) + 1))[:n]


TEXTS = ("The river runs through the old town, and ", "def parse(line):\n    ", "List three colours: ",
         "Once upon a time, in a kingdom by the sea, ", "Q: what is two plus two?\nA:")


def requests(tok, sampling, constrained, logprobs):
    """Five requests: different prompt lengths (one long: it prefills in several pieces while the
    others decode), different lengths (they leave at different rounds); the third constrained."""
    lengths = (40, 18, 26, 12, 30)
    out = []
    for i, text in enumerate(TEXTS):
        ids = ids_of(tok, text * 9, 150) if i == 1 else ids_of(tok, text)
        constrain = constrained and i == 2
        out.append(GenerationRequest(
            # a constraint ends at an end id (a finished JSON object allows nothing else)
            prompt_ids=ids, max_tokens=lengths[i], stop_ids=frozenset(tok.eos_ids) if constrain else frozenset(),
            sampling=SamplingParams(**{**sampling, "seed": sampling["seed"] + i}) if sampling else SamplingParams(),
            constraint=OutputConstraint("json_object") if constrain else None,
            logprobs=logprobs if i % 2 == 0 else None))
    return out


def run_staggered(engine, reqs, arrivals):
    """Submit reqs[i] before round arrivals[i]; drain. Returns the jobs."""
    sched, log = Scheduler(engine), []
    jobs = [Job(str(i), r, log) for i, r in enumerate(reqs)]
    rnd = 0
    while True:
        for i, at in enumerate(arrivals):
            if at == rnd:
                sched.submit(jobs[i])
        if rnd > max(arrivals) and not sched.wait(timeout=0):
            break
        sched.round()
        rnd += 1
        assert rnd < 5000
    return sched, jobs


CASES = [  # (backend, spec, sampling, constrained, logprobs)
    ("fast", True, None, False, 2),
    ("fast", False, None, True, None),
    ("fast", True, {"temperature": 0.8, "top_p": 0.95, "seed": 11}, True, 2),
    ("fast", False, {"temperature": 1.0, "top_k": 40, "seed": 5}, False, 1),
    ("reference", True, {"temperature": 0.7, "seed": 3}, True, None),
]


@pytest.mark.parametrize("backend, spec, sampling, constrained, logprobs", CASES)
def test_shared_rounds_give_every_request_its_solo_tokens(request, tok, backend, spec, sampling, constrained,
                                                          logprobs):
    model = request.getfixturevalue(backend)
    reqs = requests(tok, sampling, constrained, logprobs)
    solo = [alone(model, tok, r, spec=spec, cpu_prefill_chunk=32) for r in requests(tok, sampling, constrained, logprobs)]
    probe = Probe(model)
    engine = make_engine(probe, tok, 5, spec=spec, cpu_prefill_chunk=32)
    # 0 alone for a while (solo speculative rounds), 2 and 3 join (shared rounds), the long prompt 1
    # prefills in pieces while they decode, 4 arrives late; each leaves at its own length
    sched, jobs = run_staggered(engine, reqs, arrivals=(0, 5, 3, 3, 12))
    for i, job in enumerate(jobs):
        assert job.finish == solo[i].finish and (job.finish == "length" or reqs[i].constraint)
        assert job.tokens == solo[i].tokens, f"request {i}: tokens differ in shared rounds"
        assert job.logprobs == solo[i].logprobs, f"request {i}: logprobs differ in shared rounds"
    sizes = probe.batches()
    assert sizes and max(sizes) >= 3 and sched.batched_rounds == sum(1 for b in sizes if b >= 2) > 5
    assert sched.batched_lanes == sum(b for b in sizes if b >= 2)
    # the long prompt prefilled while the others decoded: its pieces sit between shared rounds
    long_state = next(c[1] for c in probe.calls if c[0] == "forward" and c[2] == 32)
    pieces = [i for i, c in enumerate(probe.calls) if c[:2] == ("forward", long_state) and c[2] > 1]
    assert len(pieces) == 5 and any(probe.calls[j][0] == "batch" for j in range(pieces[0], pieces[-1]))
    verifies = [i for i, c in enumerate(probe.calls) if c[0] == "forward" and c[3] and c[2] > 1]
    if spec:  # a slot alone speculates: request 0 before the others came, the last one left at the end
        assert verifies[0] < pieces[0] and verifies[-1] > len(probe.calls) - 4
    else:
        assert verifies == []
    assert sum(seq.busy for seq in engine.prefix.slots) == 0


def test_more_requests_than_slots_queue_and_share(fast, tok):
    """Five requests through three slots: freed slots take queued ones mid-stream, max_batch 2 splits
    each shared round into two decode_batch calls; every request still gets its solo tokens."""
    sampling = {"temperature": 0.9, "seed": 21}
    reqs = requests(tok, sampling, False, 3)
    solo = [alone(fast, tok, r) for r in requests(tok, sampling, False, 3)]
    probe = Probe(fast, max_batch=2)
    sched, jobs = run_staggered(make_engine(probe, tok, 3), reqs, arrivals=(0, 0, 0, 0, 0))
    assert [j.tokens for j in jobs] == [s.tokens for s in solo]
    assert [j.logprobs for j in jobs] == [s.logprobs for s in solo]
    assert max(probe.batches()) == 2 and 1 in probe.batches()  # three lanes: a batch of 2 and one of 1


def test_device_picks_read_no_logits_rows_in_shared_rounds(fast, tok):
    """The GPU's pick paths through a lane: plain greedy takes Output.greedy_ids(), a constrained
    greedy pick (device_masks) Output.masked_greedy_ids(); no logits row comes to the host after
    the prefills, and the tokens are the host path's."""
    reqs = requests(tok, None, True, None)[:4]
    solo = [alone(fast, tok, r, spec=False) for r in requests(tok, None, True, None)[:4]]
    probe = Probe(fast, device=True)
    # device="cuda" only selects the device picks here (and the chunk knob below): the model is the CPU's
    engine = make_engine(probe, tok, 4, spec=False, device="cuda", device_masks=True, gpu_prefill_chunk=32)
    sched, jobs = run_staggered(engine, reqs, arrivals=(0, 0, 0, 0))
    assert [j.tokens for j in jobs] == [s.tokens for s in solo]
    assert sched.batched_rounds > 10 and probe.masked_launches > 10
    # the only rows downloaded are each prompt's last row (its first pick): a piece before the last asks
    # for none (decoder.prefill_steps)
    assert sum(1 for c in probe.calls if c[0] == "forward" and c[2] > 1) > len(reqs)  # several pieces each
    assert probe.logits_reads == len(reqs)


def test_a_model_without_decode_batch_keeps_solo_rounds(fast, tok):
    reqs = requests(tok, None, False, None)[:3]
    solo = [alone(fast, tok, r) for r in requests(tok, None, False, None)[:3]]
    engine = make_engine(NoBatch(fast), tok, 3)
    assert not engine.shares_rounds
    sched, jobs = run_staggered(engine, reqs, arrivals=(0, 1, 2))
    assert [j.tokens for j in jobs] == [s.tokens for s in solo] and sched.batched_rounds == 0


def test_batch_rounds_off_runs_no_decode_batch(fast, tok):
    probe = Probe(fast)
    engine = make_engine(probe, tok, 3, batch=False)
    assert not engine.shares_rounds
    run_staggered(engine, requests(tok, None, False, None)[:3], arrivals=(0, 0, 0))
    assert probe.batches() == []


# ---- the drafters across the switch ----------------------------------------------------------


def _drive(decoder, model, ids, n, pace, shared_rounds, sampling=SamplingParams()):
    """decoder.run by hand, the caller running each lane as the scheduler would; pace.shared on for
    the rounds in shared_rounds. Returns (tokens, state, stats)."""
    state = model.new_state()
    stats = DecodeStats(record_trace=True)
    picker = TokenPicker(sampling, ids)
    run = decoder.run(state, ids, n, sampling, frozenset(), None, stats, picker=picker, pause_prefill=True, pace=pace)
    out, rounds = [], 0
    pace.shared = 0 in shared_rounds
    for item in run:
        if isinstance(item, Lane):
            (o,) = model.decode_batch([item.state], [item.token])
            item.take(o)
            continue
        if item:
            out.extend(item)
            rounds += 1
            pace.shared = rounds in shared_rounds
    return out, state, stats


@pytest.mark.parametrize("stretch", [range(2, 9), range(1, 280)])
def test_drafters_stay_right_across_shared_stretches(fast, tok, stretch):
    """A speculative run that shares rounds for a stretch (7 rounds; or long enough that the MTP
    backlog is written eagerly, MTPLadder.MAX_BACKLOG) and then runs alone again: the same tokens as
    a run that never shared; at rest its MTP rows cover every committed position but the last and
    match the never-shared run's to rounding (rows written in one larger pass round differently);
    its suffix index holds prompt + output; the solo rounds after the stretch draft and accept."""
    from q27py.config import SpecConfig

    spec = SpecConfig(max_verify_width=6, max_depth=3, suffix_min_match=2)
    ids = ids_of(tok, "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n")
    n = 320 if len(stretch) > 100 else 60
    ref, ref_state, _ = _drive(SpecDecoder(fast, spec), fast, ids, n, Pace(), set())
    got, state, stats = _drive(SpecDecoder(fast, spec), fast, ids, n, Pace(), set(stretch))
    assert got == ref
    shared = stats.trace[stretch.start : stretch.stop]  # trace[0] is the prefill's token
    assert all(r["lanes"] == 1 and r["drafts"] == [] and r["source"] == "none" for r in shared)
    after = stats.trace[stretch.stop :]
    assert after and any(r["accepted"] > 1 for r in after), "no draft was accepted once alone again"
    assert state.position == ref_state.position == len(ids) + n - 1
    assert state.mtp_kv.length == ref_state.mtp_kv.length == state.position - 1
    for name in ("k", "v"):
        a, b = getattr(state.mtp_kv, name), getattr(ref_state.mtp_kv, name)
        np.testing.assert_allclose(a[: state.mtp_kv.length], b[: state.mtp_kv.length], rtol=0, atol=1e-5)
    idx = state.suffix_index
    assert idx.length == len(ids) + n and list(idx._tokens[: idx.length]) == ids + got


def test_plain_decoder_lanes_are_its_solo_steps(fast, tok):
    ids = ids_of(tok, TEXTS[0])
    ref, ref_state, _ = _drive(Decoder(fast), fast, ids, 20, Pace(), set())
    got, state, stats = _drive(Decoder(fast), fast, ids, 20, Pace(), set(range(1, 15)))
    assert got == ref and np.array_equal(state.hidden_last, ref_state.hidden_last)
    assert stats.lanes == 19


# ---- cancellation and failures ----------------------------------------------------------------


def test_cancel_in_every_phase_frees_the_slot_at_once(fast, tok):
    probe = Probe(fast)
    engine = make_engine(probe, tok, 4, cpu_prefill_chunk=16, interleave_chunk=8)
    sched, log = Scheduler(engine), []
    keep = [Job(f"k{i}", GenerationRequest(ids_of(tok, TEXTS[i]), 30), log) for i in range(2)]
    queued = Job("queued", GenerationRequest(ids_of(tok, TEXTS[2]), 8), log)
    pre = Job("prefill", GenerationRequest(ids_of(tok, TEXTS[3] * 6, 100), 8), log)
    dec = Job("decode", GenerationRequest(ids_of(tok, TEXTS[4]), 40), log)
    for j in keep + [dec]:
        sched.submit(j)
    for _ in range(3):
        sched.round()
    assert probe.batches() and all(j.tokens for j in keep + [dec])  # three decoding: shared rounds
    sched.submit(pre)
    sched.round()  # admitted: one 8-token piece beside the shared round
    sched.submit(queued)  # all four slots busy: it waits
    sched.round()
    assert sched.counts()[:2] == (4, 1) and pre.tokens == []
    # cancel one slot mid-prefill, one mid-shared-decode and the queued one, all before a round
    for j in (pre, dec, queued):
        j.request.cancel.set()
    calls = len(probe.calls)
    sched.round()
    assert pre.finish == dec.finish == queued.finish == "cancelled" and queued.tokens == []
    assert sched.running_requests() == [k.request for k in keep]
    # no model work for the cancelled slots in that round: the two left shared one decode_batch
    assert [c[:2] for c in probe.calls[calls:]] == [("batch", 2)]
    drain(sched)
    assert [k.tokens for k in keep] == [alone(fast, tok, GenerationRequest(ids_of(tok, TEXTS[i]), 30)).tokens
                                        for i in range(2)]
    assert sum(seq.busy for seq in engine.prefix.slots) == 0


def test_a_cancel_during_the_shared_forward_lands_next_round_and_keeps_the_sequence(fast, tok):
    """A client leaving while the shared forward runs: its slot's round completes (its token is
    delivered), the next round ends it as a cancel between rounds does, and its sequence stays
    healthy (a follow-up resumes it), not dropped as a slot the engine failed to stop would be."""
    probe = Probe(fast)
    engine = make_engine(probe, tok, 2, max_sequences=2)
    sched = Scheduler(engine)
    a_ids = ids_of(tok, TEXTS[0])
    a, b = Job("a", GenerationRequest(a_ids, 40)), Job("b", GenerationRequest(ids_of(tok, TEXTS[1]), 40))
    sched.submit(a)
    sched.submit(b)
    for _ in range(3):
        sched.round()
    n = len(a.tokens)
    probe.on_batch = a.request.cancel.set
    sched.round()
    probe.on_batch = None
    assert len(a.tokens) == n + 1 and a.finish is None
    sched.round()
    assert a.finish == "cancelled" and len(a.tokens) == n + 1
    drain(sched)
    again = list(engine.generate(GenerationRequest(a_ids + a.tokens + ids_of(tok, " Then?"), 4)))
    assert again[-1].stats["cached_tokens"] == len(a_ids) + len(a.tokens) - 1


def test_a_failed_decode_batch_ends_only_the_slots_it_carried(fast, tok):
    probe = Probe(fast, max_batch=2)
    engine = make_engine(probe, tok, 4)
    sched, log = Scheduler(engine), []
    jobs = [Job(str(i), GenerationRequest(ids_of(tok, TEXTS[i]), 24), log) for i in range(4)]
    for j in jobs:
        sched.submit(j)
    for _ in range(3):
        sched.round()
    doomed = [seq.state for seq in engine.prefix.slots if seq.busy][:1]
    probe.fail_batch = {id(s) for s in doomed}
    sched.round()
    probe.fail_batch = None
    failed = [j for j in jobs if j.items and isinstance(j.items[-1], RuntimeError)]
    assert len(failed) == 2, "the batch of two with the faulty lane ended both of its slots, nothing else"
    assert sched.counts()[0] == 2
    drain(sched)
    for i, j in enumerate(jobs):
        if j not in failed:
            assert j.tokens == alone(fast, tok, GenerationRequest(ids_of(tok, TEXTS[i]), 24)).tokens
    # the failed slots' sequences were dropped, not kept for reuse with a state of unknown contents
    assert len([s for s in engine.prefix.slots if s.tokens]) == 2


# ---- prefill beside decode (interleave_chunk) --------------------------------------------------


def _pieces(probe, state_id):
    return [c[2] for c in probe.calls if c[0] == "forward" and c[1] == state_id and c[2] > 1]


def test_interleave_cuts_prefill_pieces_only_while_others_decode(fast, tok):
    long_ids = ids_of(tok, "word soup and more words ", 200)
    # alone: full 64-token chunks
    probe = Probe(fast)
    engine = make_engine(probe, tok, 2, spec=False, cpu_prefill_chunk=64, interleave_chunk=16)
    sched = Scheduler(engine)
    sched.submit(Job("long", GenerationRequest(long_ids, 4)))
    drain(sched)
    (state_id,) = {c[1] for c in probe.calls if c[0] == "forward"}
    assert _pieces(probe, state_id) == [64, 64, 64, 8]
    # two prompts prefilling together, nobody decoding: still full chunks
    probe.calls.clear()
    sched = Scheduler(engine)
    a, b = Job("a", GenerationRequest(long_ids, 2)), Job("b", GenerationRequest(ids_of(tok, "other words ", 130), 2))
    sched.submit(a)
    sched.submit(b)
    sched.round()
    sched.round()
    assert sorted(c[2] for c in probe.calls) == [64, 64, 64, 64]
    drain(sched)
    # beside a decoding neighbour: 16-token pieces on the same grid while it decodes, full ones after
    probe.calls.clear()
    sched, log = Scheduler(engine), []
    run = Job("run", GenerationRequest(ids_of(tok, TEXTS[0]), 9), log)
    sched.submit(run)
    sched.round()
    sched.round()
    long = Job("long", GenerationRequest(long_ids, 4), log)
    sched.submit(long)
    drain(sched)
    run_state = probe.calls[0][1]
    long_state = next(c[1] for c in probe.calls if c[1] != run_state)
    pieces = _pieces(probe, long_state)
    # rounds 2-8 beside the neighbour's tokens 3-9, round 9 beside its end (it was still decoding when
    # the round began); then alone: the full grid's 128 -> 192 chunk and the 8-token tail
    assert pieces == [16] * 8 + [64, 8], pieces
    cuts = set(np.cumsum(pieces))
    assert {64, 128, 192, 200} <= cuts, "a full chunk's cut was moved"
    assert long.tokens == alone(fast, tok, GenerationRequest(long_ids, 4), spec=False, cpu_prefill_chunk=64).tokens
    first_long = next(i for i, (n, item) in enumerate(log) if n == "long" and item.token_ids)
    run_tokens = [i for i, (n, item) in enumerate(log) if n == "run" and item.token_ids]
    assert len(run_tokens) == 9 and run_tokens[-1] < first_long, "the running stream got a token every round"


# ---- config ------------------------------------------------------------------------------------


def test_batch_settings_env_and_validation(fast, tok):
    cfg = apply_env(Q27Config(), {"Q27_BATCH_ROUNDS": "1", "Q27_INTERLEAVE_CHUNK": "512", "Q27_BATCH_SPEC": "solo-only"})
    assert cfg.engine.batch_rounds is True and cfg.engine.interleave_chunk == 512
    # auto by default: shared rounds and 384-token interleave on cuda, both off on the CPU
    d = Q27Config().engine
    assert d.batch_rounds is None and d.interleave_chunk is None and d.batch_sweep is True
    assert (d.shared_rounds(), d.interleave()) == (False, 0)  # device "cpu"
    d.device = "cuda"
    assert (d.shared_rounds(), d.interleave()) == (True, 384) and d.interleave_halving == 0
    d.batch_rounds, d.interleave_chunk = False, 0
    assert (d.shared_rounds(), d.interleave()) == (False, 0)
    with pytest.raises(ValueError):
        apply_env(Q27Config(), {"Q27_BATCH_ROUNDS": "yes"})
    for bad in ({"batch_spec": "wide"}, {"batch_spec": "draft"}, {"interleave_chunk": -1}):
        with pytest.raises(ConfigError):
            make_engine(fast, tok, 2, **bad)
    # "drafts" (reserved until the shared sweep could carry drafts) is a choice now, from the env too
    assert apply_env(Q27Config(), {"Q27_BATCH_SPEC": "drafts"}).engine.batch_spec == "drafts"
    assert make_engine(fast, tok, 2, batch_spec="drafts").sweep_lanes == fast.verify_lanes > 0
    assert apply_env(Q27Config(), {"Q27_VERIFY_GROUPS": "0"}).engine.verify_groups is False
    assert Q27Config().engine.verify_groups is True  # on since the H200 groupsbench (docs/PERF.md 2026-12-06)
    e = make_engine(fast, tok, 2, interleave_chunk=256)
    assert e.shares_rounds and e.interleave_chunk == 256


def test_interleave_pieces_shrink_with_the_context():
    """Pace.halving: the piece at position p is prefill_chunk / (1 + p / halving), so a piece's
    attention (which grows with the keys it reads) keeps the waiting streams' gap flat; the full
    chunks' cuts stay cuts, and without halving every piece is prefill_chunk."""
    from prefill_recorder import pieces

    from q27py.engine.decoder import Pace

    def run(pace):
        return pieces(pace=pace)

    flat = run(Pace(prefill_chunk=64))
    assert flat[:4] == [64] * 4
    shrinking = run(Pace(prefill_chunk=64, halving=256))
    done, want = 0, []
    while done < 1000:
        p = max(1, round(64 / (1 + done / 256)))
        cut = min(1000, (done // 256 + 1) * 256, done + p)
        want.append(cut - done)
        done = cut
    assert shrinking == want
    assert shrinking[0] == 64 and max(shrinking[-5:]) < 32, shrinking  # ~64 / (1 + 900 / 256) at the end
    assert {256, 512, 768, 1000} <= set(np.cumsum(shrinking)), "a full chunk's cut was moved"
    assert sum(shrinking) == 1000


def _cost_clock(probe, fixed_ms=10.0, per_token_ms=1.0, decode_ms=5.0):
    """A clock that advances with the model work the probe saw: a prefill piece of n tokens costs
    fixed + n x per_token ms, a decode forward or a decode_batch decode_ms (the GPU's shape: a piece
    pays a fixed cost, e.g. the bf16 expansion, plus its tokens)."""
    def clock():
        ms = 0.0
        for c in probe.calls:
            if c[0] == "forward":
                ms += fixed_ms + per_token_ms * c[2] if c[2] > 1 else decode_ms
            else:
                ms += decode_ms
        return ms / 1000.0
    return clock


def test_interleave_budget_adapts_the_piece_to_the_round_budget(fast, tok):
    """interleave_budget_ms: each round that runs a piece beside a decoding stream scales the next
    piece by budget / the round's time, so the rounds (the running stream's wait) settle at the
    budget: here 5 ms decode + 10 ms fixed + 1 ms per token against 55 ms -> 40-token pieces."""
    probe = Probe(fast)
    engine = make_engine(probe, tok, 2, spec=False, cpu_prefill_chunk=4096, interleave_chunk=16,
                         interleave_budget_ms=55.0)
    assert engine.interleave_budget_ms == 55.0
    clock = _cost_clock(probe)
    sched, log = Scheduler(engine, clock=clock), []
    run = Job("run", GenerationRequest(ids_of(tok, TEXTS[0]), 60), log)
    sched.submit(run)
    sched.round()
    sched.round()
    long_ids = ids_of(tok, "word soup and more words ", 600)
    long = Job("long", GenerationRequest(long_ids, 2), log)
    sched.submit(long)
    rounds = []
    while long.finish is None:
        t0 = clock()
        sched.round()
        rounds.append(clock() - t0)
    long_state = next(c[1] for c in probe.calls if c[0] == "forward" and c[2] > 16)
    pieces = _pieces(probe, long_state)
    assert pieces[:5] == [16, 28, 36, 39, 40], pieces  # x (55 / 31), x (55 / 43), ... damped, to the fixed point
    assert all(p == 40 for p in pieces[4:-1]), pieces
    assert all(abs(r - 0.055) < 0.002 for r in rounds[4 : len(pieces) - 1]), str([round(r * 1e3, 1) for r in rounds])
    assert run.finish is None, "the running stream decoded through the whole prefill"
    drain(sched)
    assert long.tokens == alone(fast, tok, GenerationRequest(long_ids, 2), spec=False, cpu_prefill_chunk=4096).tokens
    # without a budget the pieces stay fixed
    probe.calls.clear()
    fixed = make_engine(probe, tok, 2, spec=False, cpu_prefill_chunk=4096, interleave_chunk=16)
    sched = Scheduler(fixed, clock=clock)
    run2 = Job("run", GenerationRequest(ids_of(tok, TEXTS[0]), 60))
    sched.submit(run2)
    sched.round()
    sched.round()
    sched.submit(Job("long", GenerationRequest(long_ids[:100], 2)))
    for _ in range(4):
        sched.round()
    states = [c[1] for c in probe.calls if c[0] == "forward" and c[2] == 16]
    assert len(states) == 4 and sched.piece == 16


def test_beside_decoders_only_the_shortest_prompt_takes_a_piece(fast, tok):
    """Two prompts prefilling beside a decoding stream: the shorter runs its piece alone that round
    (its prefill does not stack on the long prompt's piece in one wait); the long one resumes the
    round after. Tokens are each request's solo tokens."""
    probe = Probe(fast)
    engine = make_engine(probe, tok, 3, spec=False, cpu_prefill_chunk=4096, interleave_chunk=16)
    sched, log = Scheduler(engine), []
    run = Job("run", GenerationRequest(ids_of(tok, TEXTS[0]), 40), log)
    sched.submit(run)
    sched.round()
    sched.round()
    long_ids, short_ids = ids_of(tok, "word soup and more words ", 120), ids_of(tok, TEXTS[1])
    long = Job("long", GenerationRequest(long_ids, 2), log)
    sched.submit(long)
    sched.round()  # the long prompt's first piece
    short = Job("short", GenerationRequest(short_ids, 4), log)
    sched.submit(short)
    n = len(probe.calls)
    sched.round()  # admitted: its piece runs, the long prompt's does not
    pieces = [c[2] for c in probe.calls[n:] if c[0] == "forward" and c[2] > 1]
    assert pieces == [min(16, len(short_ids))], pieces
    assert len(short_ids) <= 16 and short.tokens, "the short prompt's single piece gave its first token"
    n = len(probe.calls)
    sched.round()  # the short one decodes now (a shared round), and the long one has its piece again
    assert [c[2] for c in probe.calls[n:] if c[0] == "forward" and c[2] > 1] == [16]
    drain(sched)
    assert long.tokens == alone(fast, tok, GenerationRequest(long_ids, 2), spec=False, cpu_prefill_chunk=4096).tokens
    assert short.tokens == alone(fast, tok, GenerationRequest(short_ids, 4), spec=False).tokens


def test_beside_decoders_the_least_prefill_left_goes_first(fast, tok):
    """Ranked by prefill left, not by prompt length: a long prompt with 24 tokens to go keeps its
    pieces ahead of a new 60-token prompt (44 to go after its first piece, which a new request gets
    at once). Before, the shorter prompt in all always went first: a warm turn restored from the
    prefix cache waited behind any shorter cold prompt."""
    probe = Probe(fast)
    engine = make_engine(probe, tok, 3, spec=False, cpu_prefill_chunk=4096, interleave_chunk=16)
    sched = Scheduler(engine)
    run = Job("run", GenerationRequest(ids_of(tok, TEXTS[0]), 60))
    sched.submit(run)
    sched.round()
    sched.round()
    long_ids = ids_of(tok, "word soup and more words ", 200)[:120]
    mid_ids = ids_of(tok, "another prompt entirely, of middling size ", 80)[:60]
    long = Job("long", GenerationRequest(long_ids, 2))
    sched.submit(long)
    for _ in range(6):  # 6 pieces of 16: 24 tokens left
        sched.round()
    long_state = next(c[1] for c in probe.calls if c[0] == "forward" and c[2] == 16)
    assert sum(_pieces(probe, long_state)) == 96
    mid = Job("mid", GenerationRequest(mid_ids, 2))
    sched.submit(mid)
    n = len(probe.calls)
    sched.round()  # new: its first piece runs (what is left is unknown until it starts)
    first = [c for c in probe.calls[n:] if c[0] == "forward" and c[2] > 1]
    assert len(first) == 1 and first[0][1] != long_state and first[0][2] == 16
    n = len(probe.calls)
    sched.round()  # 24 left beats 44 left
    assert [(c[1], c[2]) for c in probe.calls[n:] if c[0] == "forward" and c[2] > 1] == [(long_state, 16)]
    drain(sched)
    assert long.tokens == alone(fast, tok, GenerationRequest(long_ids, 2), spec=False, cpu_prefill_chunk=4096).tokens
    assert mid.tokens == alone(fast, tok, GenerationRequest(mid_ids, 2), spec=False, cpu_prefill_chunk=4096).tokens


def test_interleave_budget_config():
    cfg = apply_env(Q27Config(), {"Q27_INTERLEAVE_BUDGET_MS": "70"})
    assert cfg.engine.interleave_budget_ms == 70.0
    d = Q27Config().engine
    assert d.interleave_budget_ms is None and d.interleave_budget() == 0.0  # cpu: no pieces, no budget
    d.device = "cuda"
    from q27py.config import GPU_INTERLEAVE_BUDGET_MS
    assert d.interleave_budget() == GPU_INTERLEAVE_BUDGET_MS
    d.interleave_chunk = 0  # pieces off: no budget either
    assert d.interleave_budget() == 0.0
    d.interleave_chunk, d.interleave_budget_ms = 256, 40
    assert d.interleave_budget() == 40.0
    for bad in (-1.0, "fast", True):
        e = Q27Config().engine
        e.interleave_budget_ms = bad
        with pytest.raises(ConfigError):
            e.check_batching()
