"""Continuous batching on the CPU path (issue 15): slots, FIFO queue, rounds, cancellation, determinism.

The scheduler is driven round by round from the test (no threads), on a real LocalEngine
over the bundled model, so every assertion is about what one round does.
"""

import time

import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.config import Q27Config
from q27py.engine.api import GenerationChunk, GenerationRequest
from q27py.engine.engine import LocalEngine
from q27py.engine.scheduler import Scheduler
from q27py.model.reference import ReferenceModel
from fast_path_rules import Probe
from sched_jobs import Job, drain


@pytest.fixture(scope="module")
def reference():
    return ReferenceModel.load(DEFAULT_MODEL_DIR)


def make_engine(model, tok, slots=2, spec=True, **engine):
    cfg = Q27Config()
    cfg.spec.enabled = spec
    cfg.engine.max_slots = slots
    cfg.engine.checkpoint_every = 0
    for k, v in engine.items():
        setattr(cfg.engine, k, v)
    return LocalEngine(cfg, model, tok)


def ask(ids, n, **kw):
    return GenerationRequest(prompt_ids=list(ids), max_tokens=n, stop_ids=frozenset(), **kw)


def prompt(tok, text, n=None):
    ids = tok.encode(text)
    return ids if n is None else (ids * (n // len(ids) + 1))[:n]


def busy_sequences(engine):
    return sum(seq.busy for seq in engine.prefix.slots)


def test_two_streams_interleave(fast, tok):
    engine = make_engine(fast, tok, slots=2)
    sched, log = Scheduler(engine), []
    a = Job("a", ask(prompt(tok, "The first story begins. "), 60), log)
    b = Job("b", ask(prompt(tok, "A second, unrelated question? "), 12), log)
    sched.submit(a)
    sched.round()
    sched.round()
    assert a.tokens, "the first stream is decoding"
    sched.submit(b)
    drain(sched)
    assert a.finish == "length" and b.finish == "length"
    first_b = next(i for i, (n, item) in enumerate(log) if n == "b" and item.token_ids)
    end_b = next(i for i, (n, item) in enumerate(log) if n == "b" and item.finish_reason)
    end_a = next(i for i, (n, item) in enumerate(log) if n == "a" and item.finish_reason)
    assert first_b < end_b < end_a, "b's tokens waited for a to end"
    assert any(n == "a" and item.token_ids for n, item in log[first_b:end_b]), "the streams did not interleave"


def test_short_request_finishes_well_before_a_long_one_that_started_first(fast, tok):
    engine = make_engine(fast, tok, slots=2)
    sched, log = Scheduler(engine), []
    long = Job("long", ask(prompt(tok, "Tell me everything about rivers. "), 300), log)
    sched.submit(long)
    for _ in range(3):
        sched.round()
    short = Job("short", ask(prompt(tok, "Name one river. "), 6), log)
    sched.submit(short)
    rounds = 0
    while short.finish is None:
        sched.round()
        rounds += 1
    assert short.finish == "length" and len(short.tokens) == 6
    assert rounds <= 6, "a round gives each slot one step: six tokens take at most six rounds"
    assert long.finish is None and len(long.tokens) < 300 // 2, "the long one was not made to finish first"
    long.request.cancel.set()
    drain(sched)
    assert long.finish == "cancelled"


def test_a_long_prefill_is_chunked_between_decode_rounds(fast, tok):
    engine = make_engine(fast, tok, slots=2, spec=False, cpu_prefill_chunk=64)  # one token per round
    sched, log = Scheduler(engine), []
    running = Job("run", ask(prompt(tok, "Count slowly. "), 30), log)
    sched.submit(running)
    sched.round()
    sched.round()
    sched.submit(Job("long", ask(prompt(tok, "word soup and more words ", 640), 4), log))
    sched.round()  # admits it: its first chunk runs in this round
    before = len(running.tokens)
    for _ in range(8):  # chunks 2..9 of 10: the running stream gains tokens in every round
        sched.round()
        assert len(running.tokens) > before, "a running stream went a round without a token during prefill"
        before = len(running.tokens)
    assert not any(n == "long" for n, _ in log), "the long prompt is still prefilling"
    sched.round()  # its last chunk, and the first token picked from it
    assert [n for n, item in log if n == "long" and item.token_ids] == ["long"]
    drain(sched)
    assert [item.finish_reason for n, item in log if n == "long"][-1] == "length"


def test_max_slots_one_keeps_fifo(fast, tok):
    engine = make_engine(fast, tok, slots=1)
    sched, log = Scheduler(engine), []
    jobs = [Job(n, ask(prompt(tok, f"Request {n} asks something. "), 8), log) for n in "abc"]
    for j in jobs:
        sched.submit(j)
    sched.round()
    assert sched.counts()[:2] == (1, 2)
    drain(sched)
    names = [n for n, _ in log]
    assert names == sorted(names), "with one slot requests run whole, in arrival order"
    assert all(j.finish == "length" for j in jobs)


def test_cancel_while_queued_never_starts(fast, tok):
    engine = make_engine(fast, tok, slots=1)
    sched, log = Scheduler(engine), []
    a = Job("a", ask(prompt(tok, "Go on for a while. "), 40), log)
    b = Job("b", ask(prompt(tok, "Never mind. "), 8), log)
    started = []
    steps = sched._stepper
    sched._stepper = lambda r, *pace: (started.append(r), steps(r, *pace))[1]  # LocalEngine.steps(request, pace)
    sched.submit(a)
    sched.submit(b)
    sched.round()
    b.request.cancel.set()
    sched.round()
    assert b.finish == "cancelled" and b.tokens == [] and len(b.items) == 1
    assert sched.counts()[:2] == (1, 0)
    drain(sched)
    assert started == [a.request] and a.finish == "length"


def test_cancel_during_prefill_frees_the_slot_in_the_next_round(fast, tok):
    engine = make_engine(fast, tok, slots=1, cpu_prefill_chunk=64)
    sched, log = Scheduler(engine), []
    fed = []
    forward = fast.forward

    def counting(state, ids, *args, **kwargs):
        fed.append((id(state), len(ids)))
        return forward(state, ids, *args, **kwargs)

    fast.forward = counting
    try:
        a = Job("a", ask(prompt(tok, "long long prompt ", 640), 8), log)
        c = Job("c", ask(prompt(tok, "Next in line. "), 4), log)
        sched.submit(a)
        sched.submit(c)
        sched.round()
        a_state = fed[0][0]
        assert fed == [(a_state, 64)]  # one chunk of ten
        a.request.cancel.set()
        sched.round()
        assert a.finish == "cancelled" and a.tokens == []
        assert [n for n, _ in fed if n == a_state] == [a_state], "no chunk ran after the cancel"
        assert sched.running_requests() == [c.request], "the freed slot took the queued request in the same round"
        drain(sched)
    finally:
        del fast.forward
    assert c.finish == "length" and busy_sequences(engine) == 0


def test_cancel_during_decode_frees_the_slot_and_keeps_the_sequence(fast, tok):
    engine = make_engine(fast, tok, slots=2)
    sched, log = Scheduler(engine), []
    ids = prompt(tok, "A story that goes on and on. ")
    a = Job("a", ask(ids, 200), log)
    other = Job("o", ask(prompt(tok, "Meanwhile, elsewhere. "), 30), log)
    sched.submit(a)
    sched.submit(other)
    for _ in range(4):
        sched.round()
    assert a.tokens and a.finish is None
    produced = len(a.tokens)
    a.request.cancel.set()
    sched.round()
    assert a.finish == "cancelled" and len(a.tokens) == produced
    assert sched.running_requests() == [other.request] and busy_sequences(engine) == 1
    drain(sched)
    # the cancelled sequence stayed healthy: a follow-up continues its live state
    again = list(engine.generate(ask(ids + a.tokens + prompt(tok, " Then?"), 4)))
    assert again[-1].stats["cached_tokens"] == len(ids) + len(a.tokens) - 1


class _Stubborn:
    """An engine that never looks at the cancel flag."""

    max_slots = 2
    closed = 0

    def generate(self, r):
        try:
            while True:
                yield GenerationChunk([1])
        finally:
            _Stubborn.closed += 1


def test_an_engine_that_ignores_cancel_is_ended_by_the_scheduler():
    sched, log = Scheduler(_Stubborn()), []
    a = Job("a", ask([1, 2], 100), log)
    sched.submit(a)
    sched.round()
    a.request.cancel.set()
    sched.round()
    assert a.finish == "cancelled" and sched.counts()[0] == 0 and _Stubborn.closed == 1


class _Flaky:
    max_slots = 2

    def generate(self, r):
        for i in range(4):
            if r.prompt_ids == [666] and i == 1:
                raise RuntimeError("boom")
            yield GenerationChunk([i])
        yield GenerationChunk([], finish_reason="length")


def test_an_engine_error_ends_only_its_own_slot():
    sched, log = Scheduler(_Flaky()), []
    bad, good = Job("bad", ask([666], 4), log), Job("good", ask([1], 4), log)
    sched.submit(bad)
    sched.submit(good)
    drain(sched)
    assert isinstance(bad.items[-1], RuntimeError) and bad.tokens == [0]
    assert good.finish == "length" and good.tokens == [0, 1, 2, 3]


def test_stop_cancels_queued_and_running(fast, tok):
    engine = make_engine(fast, tok, slots=1)
    sched, log = Scheduler(engine), []
    a, b = Job("a", ask(prompt(tok, "x y z "), 50), log), Job("b", ask(prompt(tok, "q "), 5), log)
    sched.submit(a)
    sched.submit(b)
    sched.round()
    sched.stop()
    drain(sched)
    assert a.finish == "cancelled" and b.finish == "cancelled" and b.tokens == []
    late = Job("late", ask(prompt(tok, "q "), 5), log)
    sched.submit(late)
    assert late.finish == "cancelled"


PROMPTS = ("The river runs through the old town, and ", "def parse(line):\n    ", "List three colours: ")


@pytest.mark.parametrize("backend, spec", [("fast", True), ("fast", False), ("reference", True)])
def test_output_is_bitwise_the_same_alone_and_mixed(request, backend, spec, tok):
    model = request.getfixturevalue(backend)
    lengths = (32, 20, 26)

    def job_request(i):
        return ask(prompt(tok, PROMPTS[i]), lengths[i], logprobs=2)

    alone = []
    for i in range(3):
        chunks = list(make_engine(model, tok, slots=1, spec=spec).generate(job_request(i)))
        alone.append(([t for c in chunks for t in c.token_ids], [lp for c in chunks for lp in (c.logprobs or [])]))
    engine = make_engine(model, tok, slots=3, spec=spec)
    sched, log = Scheduler(engine), []
    jobs = [Job(str(i), job_request(i), log) for i in range(3)]
    sched.submit(jobs[0])
    sched.round()
    sched.round()  # the others join mid-stream, at different points of its output
    sched.submit(jobs[1])
    sched.round()
    sched.submit(jobs[2])
    drain(sched)
    for i, job in enumerate(jobs):
        got = [lp for c in job.items for lp in (c.logprobs or [])]
        assert job.tokens == alone[i][0], f"prompt {i}: tokens differ when run beside others"
        assert [(r.token, r.logprob, r.top) for r in got] == [(r.token, r.logprob, r.top) for r in alone[i][1]]


def test_a_follow_up_restores_its_prefix_in_its_own_slot_while_another_runs(fast, tok):
    engine = make_engine(fast, tok, slots=2, max_sequences=3)
    first = prompt(tok, "We talk about gardens: tulips, roses and the soil they like. ")
    other = prompt(tok, "Unrelated: how do trains stay on the rails? ")
    answer = [t for c in engine.generate(ask(first, 6)) for t in c.token_ids]
    list(engine.generate(ask(other, 6)))  # two idle sequences with contents, the garden one older
    history = first + answer
    sched, log = Scheduler(engine), []
    runner = Job("run", ask(prompt(tok, "Something new entirely, at length. "), 80), log)
    sched.submit(runner)
    sched.round()
    follow = history + prompt(tok, " And tulips?")
    job = Job("follow", ask(follow, 8), log)
    sched.submit(job)
    drain(sched)
    assert job.stats["cached_tokens"] == len(history) - 1, "the follow-up did not resume the garden conversation"
    cold = list(make_engine(fast, tok, slots=1).generate(ask(follow, 8)))
    assert job.tokens == [t for c in cold for t in c.token_ids]
    assert runner.finish == "length"


def test_kv_usage_counts_the_sequences_in_use(fast, tok):
    engine = make_engine(fast, tok, slots=2, max_context=4096)
    sched, log = Scheduler(engine), []
    assert engine.kv_cache_usage() == 0.0
    a = Job("a", ask(prompt(tok, "one two three "), 20), log)
    b = Job("b", ask(prompt(tok, "four five six seven "), 20), log)
    sched.submit(a)
    sched.submit(b)
    sched.round()
    sched.round()
    held = sum(seq.state.position for seq in engine.prefix.slots if seq.busy)
    assert held > 0 and engine.kv_cache_usage() == pytest.approx(held / (2 * engine.max_context))
    drain(sched)
    assert engine.kv_cache_usage() == 0.0  # idle sequences kept for reuse count as free


def test_max_slots_flag_env_and_device_defaults():
    import argparse

    from q27py.commands import serve
    from q27py.config import CPU_MAX_SLOTS, EngineConfig, parse_max_slots

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    build = lambda argv, env: serve.build_config(p.parse_args(argv), environ=env).engine  # noqa: E731
    assert build([], {}).max_slots == "auto" and build([], {}).slots() == CPU_MAX_SLOTS == 4
    assert build([], {"Q27_MAX_SLOTS": "3"}).slots() == 3
    assert build(["--max-slots", "2"], {"Q27_MAX_SLOTS": "3"}).slots() == 2  # the flag wins
    assert build(["--max-slots", "auto"], {"Q27_MAX_SLOTS": "3"}).slots() == CPU_MAX_SLOTS
    # cuda "auto": the count the model sized from memory (FastModel.sized_slots), 1 where none did;
    # a number given keeps its value whatever was sized
    assert EngineConfig(device="cuda").slots() == 1
    assert EngineConfig(device="cuda").slots(6) == 6 and EngineConfig(device="cuda").live_sequences(6) == 6
    assert EngineConfig(device="cuda", max_slots=1).slots(6) == 1
    assert EngineConfig(device="cpu").slots(6) == CPU_MAX_SLOTS  # nothing sizes slots on the CPU
    # every slot needs its own live sequence: the cache (and the CUDA window sizing) counts them
    assert EngineConfig(max_slots=8, max_sequences=4).live_sequences() == 8
    assert EngineConfig(max_slots=2, max_sequences=4).live_sequences() == 4
    for bad in ("0", "-1", "many"):
        with pytest.raises(ValueError):
            parse_max_slots(bad)
    with pytest.raises(SystemExit):
        p.parse_args(["--max-slots", "0"])


def test_the_engine_keeps_a_live_sequence_per_slot(fast, tok):
    engine = make_engine(fast, tok, slots=6, max_sequences=2)
    assert engine.max_slots == 6 and engine.prefix.max_sequences == 6
    sched, log = Scheduler(engine), []
    jobs = [Job(str(i), ask(prompt(tok, f"Question number {i}? "), 5), log) for i in range(6)]
    for j in jobs:
        sched.submit(j)
    sched.round()
    assert sched.counts()[:2] == (6, 0) and busy_sequences(engine) == 6
    assert len(engine.prefix.slots) == 6, "a slot ran on a temporary state outside the cache"
    drain(sched)
    assert all(j.finish == "length" for j in jobs)


@pytest.mark.parametrize("spec", [True, False])
def test_interleaved_slots_keep_the_fast_paths_scratch_rules(fast, tok, spec):
    strict = Probe(fast)  # the fast path's scratch and commit rules over a CPU model
    texts = ("One. ", "Two, with a longer prompt that takes more than one chunk " * 6, "Three? ")
    alone = [[t for c in make_engine(fast, tok, slots=1, spec=spec).generate(ask(prompt(tok, x), 24))
              for t in c.token_ids] for x in texts]
    engine = make_engine(strict, tok, slots=3, spec=spec, cpu_prefill_chunk=16)
    sched, log = Scheduler(engine), []
    jobs = [Job(str(i), ask(prompt(tok, x), 24), log) for i, x in enumerate(texts)]
    sched.submit(jobs[0])
    sched.round()
    for j in jobs[1:]:
        sched.submit(j)
    drain(sched)
    assert [j.tokens for j in jobs] == alone
    assert strict.serial > 0
