"""Batched decode rounds on the CUDA fast path (issue 15): FastModel.decode_batch against its contract
(q27py/model/reference.py ReferenceModel.decode_batch: state i advances, and output i is, bitwise
what forward(states[i], [ids[i]]) gives), then the engine's shared rounds on it: every request's
tokens and logprobs bitwise its solo run's, with decode_batch really batching (B > 1 counted).

Skipped (per test) while the model has no decode_batch (branch `sweep` builds it).

Device command: python3 -m pytest -q tests/gpu/test_batched_rounds_gpu.py"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))


def _cfg(slots, spec, batch=True, **engine):
    from q27py.config import Q27Config

    cfg = Q27Config()
    cfg.engine.device = "cuda"
    cfg.engine.max_context = 4096
    cfg.engine.gpu_prefill_chunk = 64  # several prefill pieces per long prompt, beside decode rounds
    cfg.engine.checkpoint_every = 0
    cfg.engine.max_slots = slots
    cfg.engine.batch_rounds = batch
    cfg.engine.batch_sweep = batch  # FastModel.max_batch 16 (off: 1, no shared sweep to test)
    cfg.spec.enabled = spec
    cfg.engine.batch_spec = "solo-only"  # these tests look at the sweep; "adaptive" is tested last
    for k, v in engine.items():
        setattr(cfg.engine, k, v)
    return cfg


@pytest.fixture(scope="module")
def model():
    from q27py.gpu.forward import load_fast_model

    m = load_fast_model(_cfg(slots=1, spec=True))
    if not callable(getattr(m, "decode_batch", None)):
        pytest.skip("FastModel has no decode_batch yet (branch sweep)")
    return m


@pytest.fixture(scope="module")
def tok():
    from q27py import DEFAULT_MODEL_DIR
    from q27py.tokenizer import Tokenizer

    return Tokenizer.from_model_dir(DEFAULT_MODEL_DIR)


def _engine(model, tok, slots, spec, batch=True, **engine):
    from q27py.engine.engine import LocalEngine

    return LocalEngine(_cfg(slots, spec, batch, **engine), model, tok)


def _state_arrays(st) -> dict[str, bytes]:
    pos = st.position
    return {"position": str(pos).encode(), "k": st.k[:, :, :pos].get().tobytes(), "v": st.v[:, :, :pos].get().tobytes(),
            "gdn": st.gdn.get().tobytes(), "window": st.window.get().tobytes()}


PROMPTS = ([727, 15336, 263, 4327, 72], [1393, 1590, 198, 257, 262, 4071, 198, 262, 2604] * 9, [264],
           [491, 491, 3245, 11] * 3)


@pytest.mark.parametrize("b", [2, 5, 16])
def test_decode_batch_is_bitwise_the_solo_decode_steps(model, b):
    """B states at different positions (B up to max_batch), four steps: every output's logits, greedy
    ids and hidden row, and every state's arrays, bitwise those of solo forwards on twin states."""
    b = min(b, model.max_batch)
    prompts = [PROMPTS[i % len(PROMPTS)] + [i] for i in range(b)]
    batch, solo = [model.new_state() for _ in prompts], [model.new_state() for _ in prompts]
    for a, s, p in zip(batch, solo, prompts):
        model.forward(a, p, logits_rows="last")
        model.forward(s, p, logits_rows="last")
    ids = [(17 * i + 5) % model.cfg.vocab_size for i in range(b)]
    for step in range(4):
        outs = model.decode_batch(batch, ids)
        assert len(outs) == b
        # every output of the batch is readable until the next model call, in any order
        got = [(o.logits.copy(), np.array(o.hidden), np.asarray(o.greedy_ids()).copy()) for o in reversed(outs)][::-1]
        for (lg, hid, g), s, t in zip(got, solo, ids):
            r = model.forward(s, [t])
            assert lg.shape == (1, model.cfg.vocab_size) and hid.shape[0] == 1
            assert lg.tobytes() == r.logits.tobytes() and hid.tobytes() == np.array(r.hidden).tobytes()
            assert list(g) == [int(np.argmax(lg[0]))]
        for a, s in zip(batch, solo):
            assert _state_arrays(a) == _state_arrays(s), f"step {step}: a state differs from its solo twin"
        ids = [int(g[0]) for _, _, g in got]


def test_decode_batch_outputs_expire_at_the_next_model_call(model):
    a, b = model.new_state(), model.new_state()
    model.forward(a, [1, 2, 3], logits_rows="last")
    model.forward(b, [4, 5], logits_rows="last")
    outs = model.decode_batch([a, b], [7, 8])
    model.forward(a, [9])
    with pytest.raises(RuntimeError):
        outs[1].logits  # noqa: B018  (the scratch was reused: reading must fail, not return wrong rows)


def test_masked_picks_on_a_batch_output_equal_the_host_pick(model):
    from q27py.engine.constraint import masked_argmax, pack_bits

    states = [model.new_state() for _ in range(3)]
    for i, st in enumerate(states):
        model.forward(st, PROMPTS[i], logits_rows="last")
    outs = model.decode_batch(states, [11, 12, 13])
    rng = np.random.default_rng(0)
    keeps = [rng.random(model.cfg.vocab_size) < 0.3 for _ in outs]
    dev = [int(o.masked_greedy_ids([0], pack_bits(k)[None, :])[0]) for o, k in zip(outs, keeps)]
    host = [int(masked_argmax(o.logits[0], pack_bits(k))) for o, k in zip(outs, keeps)]
    assert dev == host


TEXTS = ("The river runs through the old town, and ", "def parse(line):\n    " * 12, "List three colours: ",
         "Once upon a time, ")


def _requests(tok, sampling, logprobs):
    from q27py.engine.api import SamplingParams
    from test_scheduler import ask

    lengths = (40, 24, 32, 16)
    return [ask(tok.encode(TEXTS[i]), lengths[i], logprobs=logprobs,
                sampling=SamplingParams(**{**sampling, "seed": sampling["seed"] + i}) if sampling else SamplingParams())
            for i in range(4)]


@pytest.mark.parametrize("spec, sampling", [(True, None), (False, None), (True, {"temperature": 0.8, "seed": 4})])
def test_shared_rounds_on_the_fast_path_give_the_solo_tokens(model, tok, spec, sampling):
    from test_scheduler import Job, drain

    from q27py.engine.scheduler import Scheduler

    alone = []
    for r in _requests(tok, sampling, 2):
        chunks = list(_engine(model, tok, 1, spec, batch=False).generate(r))
        alone.append(([t for c in chunks for t in c.token_ids], [(x.token, x.logprob, x.top) for c in chunks
                                                                  for x in (c.logprobs or [])]))
    sizes = []
    inner = model.decode_batch

    def counting(states, ids):
        sizes.append(len(states))
        return inner(states, ids)

    model.decode_batch = counting
    try:
        engine = _engine(model, tok, 4, spec)
        assert engine.shares_rounds
        sched, log = Scheduler(engine), []
        jobs = [Job(str(i), r, log) for i, r in enumerate(_requests(tok, sampling, 2))]
        sched.submit(jobs[0])
        sched.round()
        sched.round()
        sched.submit(jobs[1])  # a 200+ token prompt: its prefill pieces run between shared rounds
        sched.submit(jobs[2])
        sched.round()
        sched.submit(jobs[3])
        drain(sched)
    finally:
        del model.decode_batch
    for i, job in enumerate(jobs):
        got = [(x.token, x.logprob, x.top) for c in job.items for x in (c.logprobs or [])]
        assert job.tokens == alone[i][0], f"request {i}: tokens differ in shared rounds"
        assert got == alone[i][1], f"request {i}: logprobs differ in shared rounds"
    assert sizes and max(sizes) >= 3 and sched.batched_rounds > 5


def test_interleaved_prefill_beside_a_decoder_keeps_the_tokens(model, tok):
    """interleave_chunk 16 under 64-token chunks: the long prompt's pieces are cut 4x finer while the
    other slot decodes. Equal tokens here (the CPU tests' class: pieces change the prompt's rounding
    as a prefix-restore split does). If this fails, the fast path's prefill bits depend on the piece
    size more than that: keep interleave_chunk off and report it."""
    from test_scheduler import Job, ask, drain

    from q27py.engine.scheduler import Scheduler

    long_ids = tok.encode(TEXTS[1] * 3)[:400]
    solo = [t for c in _engine(model, tok, 1, False, batch=False).generate(ask(long_ids, 12)) for t in c.token_ids]
    engine = _engine(model, tok, 2, False, interleave_chunk=16)
    sched, log = Scheduler(engine), []
    run = Job("run", ask(tok.encode(TEXTS[0]), 60), log)
    sched.submit(run)
    sched.round()
    long = Job("long", ask(long_ids, 12), log)
    sched.submit(long)
    drain(sched)
    assert long.tokens == solo


def test_load_bench_counts_batched_rounds_on_the_fast_path(model, tok):
    from q27py.bench.load import run_load

    e = _engine(model, tok, 3, True, interleave_chunk=16)
    r = run_load(e, tok, streams=(1, 3), prompt_tokens=32, gen_tokens=8, long_tokens=512, log=lambda *a: None)
    assert r["batch_rounds"] and r["concurrency"][0]["batched_rounds"] == 0
    assert r["concurrency"][1]["batched_rounds"] > 0 and r["concurrency"][1]["tokens"] == 24
    assert r["mixed"]["interleave_chunk"] == 16 and r["mixed"]["running_deliveries_during_prefill"] >= 20


def test_adaptive_turns_keep_the_tokens_on_the_fast_path(model, tok):
    """batch_spec "adaptive" (the default) on the device: two speculating streams split between the
    sweep and their own rounds by measured speed (engine/share_policy.py); whatever the split, each
    request's tokens are its solo ones, and the probes alone give each some own rounds."""
    from test_scheduler import Job, drain

    from q27py.engine.scheduler import Scheduler

    reqs = _requests(tok, None, None)[:2]
    alone = [[t for c in _engine(model, tok, 1, True, batch=False).generate(r) for t in c.token_ids] for r in reqs]
    engine = _engine(model, tok, 2, True, batch_spec="adaptive")
    assert engine.batch_spec == "adaptive"
    sched = Scheduler(engine)
    jobs = [Job(str(i), r) for i, r in enumerate(_requests(tok, None, None)[:2])]
    for j in jobs:
        sched.submit(j)
    drain(sched)
    assert [j.tokens for j in jobs] == alone
    assert sched.solo_turns > 0 and sched.policy.plans > 0
