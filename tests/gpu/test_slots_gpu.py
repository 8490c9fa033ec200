"""Interleaved slots on the CUDA fast path (issue 15): the scheduler steps several requests on one
FastModel, whose scratch buffers, pending verify trace and CUDA graphs are shared between states.
Each step ends whole (forward, commit, rows read), so a sequence's greedy tokens and logprobs must be
bitwise those it gets alone, and a cancel mid-prefill must leave the model fit for the next request.
Passed on the H200; `--max-slots auto` now sizes the slots from memory on cuda (kvbudget.plan_slots)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))


@pytest.fixture(scope="module")
def model():
    from q27py.gpu.forward import load_fast_model

    return load_fast_model(_cfg(slots=1, spec=True))


@pytest.fixture(scope="module")
def tok():
    from q27py import DEFAULT_MODEL_DIR
    from q27py.tokenizer import Tokenizer

    return Tokenizer.from_model_dir(DEFAULT_MODEL_DIR)


def _cfg(slots, spec):
    from q27py.config import Q27Config

    cfg = Q27Config()
    cfg.engine.device = "cuda"
    cfg.engine.max_context = 4096
    cfg.engine.gpu_prefill_chunk = 64  # several prefill steps per prompt, interleaved with decode rounds
    cfg.engine.checkpoint_every = 0
    cfg.engine.max_slots = slots
    cfg.spec.enabled = spec
    return cfg


def _engine(model, tok, slots, spec):
    from q27py.engine.engine import LocalEngine

    return LocalEngine(_cfg(slots, spec), model, tok)


TEXTS = ("The river runs through the old town, and ", "def parse(line):\n    " * 12, "List three colours: ")


@pytest.mark.parametrize("spec", [True, False])
def test_fast_path_output_is_bitwise_the_same_alone_and_mixed(model, tok, spec):
    from test_scheduler import Job, ask, drain

    from q27py.engine.scheduler import Scheduler

    lengths = (40, 24, 32)
    reqs = lambda: [ask(tok.encode(TEXTS[i]), lengths[i], logprobs=2) for i in range(3)]  # noqa: E731
    alone = []
    for r in reqs():
        chunks = list(_engine(model, tok, 1, spec).generate(r))
        alone.append(([t for c in chunks for t in c.token_ids], [lp for c in chunks for lp in (c.logprobs or [])]))
    engine = _engine(model, tok, 3, spec)
    sched, log = Scheduler(engine), []
    jobs = [Job(str(i), r, log) for i, r in enumerate(reqs())]
    sched.submit(jobs[0])
    sched.round()
    sched.round()
    sched.submit(jobs[1])  # a 200+ token prompt: its prefill chunks run between job 0's rounds
    sched.round()
    sched.submit(jobs[2])
    drain(sched)
    for i, job in enumerate(jobs):
        got = [lp for c in job.items for lp in (c.logprobs or [])]
        assert job.tokens == alone[i][0], f"request {i}: tokens differ beside other slots"
        assert [(r.token, r.logprob, r.top) for r in got] == [(r.token, r.logprob, r.top) for r in alone[i][1]]


def test_fast_path_cancel_mid_prefill_then_serve(model, tok):
    from test_scheduler import Job, ask, drain

    from q27py.engine.scheduler import Scheduler

    engine = _engine(model, tok, 2, True)
    sched, log = Scheduler(engine), []
    running = Job("run", ask(tok.encode(TEXTS[0]), 40), log)
    long = Job("long", ask(tok.encode("word soup " * 200)[:400], 8), log)
    sched.submit(running)
    sched.round()
    sched.submit(long)
    sched.round()
    long.request.cancel.set()
    sched.round()
    assert long.finish == "cancelled" and long.tokens == []
    drain(sched)
    cold = list(_engine(model, tok, 1, True).generate(ask(tok.encode(TEXTS[0]), 40)))
    assert running.tokens == [t for c in cold for t in c.token_ids]


def test_load_bench_on_the_fast_path(model, tok):
    """`q27py bench load` on cuda with the bundled model (the 27B run is the lead's): the streams
    interleave, the short request beats the long prefill, and the graphs' bytes per state are measured."""
    from q27py.bench.load import run_load

    e = _engine(model, tok, 3, True)
    r = run_load(e, tok, streams=(1, 3), prompt_tokens=32, gen_tokens=8, long_tokens=512, log=lambda *a: None)
    assert r["device"] == "cuda" and r["slots"] == 3
    for row in r["concurrency"]:
        assert row["tokens"] == 8 * row["streams"] and row["max_running"] == row["streams"]
    m = r["mixed"]
    assert m["prefill_chunk"] == 64 and m["running_deliveries_during_prefill"] >= 4
    assert m["short_first_before_long"] and m["running_finish"] == "cancelled"
    mem = r["memory"]
    assert mem["state_bytes"] == model.new_state().nbytes()  # the whole window, allocated up front
    assert mem["graph_bytes_per_state"] is not None and mem["graph_bytes_per_state_assumed"] > 0
    # the model-level graphs the run captured fit what the slot plan set aside for all of them
    assert mem["model_graph_bytes"] is not None and mem["model_graph_bytes_reserved"] is not None
    assert mem["model_graph_bytes"] <= mem["model_graph_bytes_reserved"]


def test_auto_slots_are_sized_from_memory_and_reach_the_engine(tok):
    """--max-slots auto on cuda: load_fast_model sizes the slots (kvbudget.plan_slots); the bundled
    model's states are tiny, so the card holds more than the cap at a 4,096 window."""
    from q27py.config import GPU_AUTO_MAX_SLOTS
    from q27py.engine.engine import LocalEngine
    from q27py.gpu.forward import load_fast_model

    cfg = _cfg(slots=1, spec=True)
    cfg.engine.max_slots = "auto"
    m = load_fast_model(cfg)
    assert m.max_pos == 4096 and m.slot_plan.budget.window == 4096  # a fixed window stays as given
    assert m.slot_plan.fit > GPU_AUTO_MAX_SLOTS and m.sized_slots == GPU_AUTO_MAX_SLOTS
    engine = LocalEngine(cfg, m, tok)
    assert engine.max_slots == GPU_AUTO_MAX_SLOTS and engine.prefix.max_sequences == GPU_AUTO_MAX_SLOTS
    # a number given keeps its value on the same model
    cfg1 = _cfg(slots=1, spec=True)
    assert LocalEngine(cfg1, m, tok).max_slots == 1


def test_graph_cache_counts_bytes_per_state(model, tok):
    """GraphCache.bytes_by_state: what each state's captures took, dropped with the state's graphs
    (the load bench reports it against the assumed EngineConfig.graph_bytes_per_layer x layers)."""
    from test_scheduler import ask

    engine = _engine(model, tok, 1, True)
    for _ in range(2):  # graphs are captured on a key's second run
        list(engine.generate(ask(tok.encode(TEXTS[2]), 24)))
    g = model.graphs
    per = g.graphs_per_state()
    assert per and set(g.bytes_by_state) == set(per)  # a state's bytes exist while its graphs do
    sid = max(per, key=per.get)
    assert sid in g.bytes_by_state and g.bytes_by_state[sid] >= 0
    assert sum(g.bytes_by_state.values()) < model.memory_per_sequence(4096) * 64  # sane: not the whole card
    g.drop_id(sid)
    assert sid not in g.bytes_by_state and sid not in g.graphs_per_state()


def test_load_compiles_every_module_and_sizes_the_weight_cache(model):
    """load_fast_model compiles every kernel module before serving (before: modules compiled on first
    use, and a short request beside a long prefill waited 911 ms for one in a fresh process, run f2),
    and EngineConfig.prefill_weight_cache_gb "auto" (the default) sizes the expansion cache beside
    the fixed states: a bf16 load has nothing to expand (its matrices stay on the GEMV), and the
    bundled model's q4s expansions all fit on a card that runs these tests."""
    from q27py.gpu import blas
    from q27py.gpu.forward import expansions_bytes, load_fast_model
    from q27py.gpu.runtime import KERNEL_FILES

    assert set(KERNEL_FILES) <= set(model.rt._modules)
    assert expansions_bytes(model.w) == 0
    cfg = _cfg(slots=2, spec=False)
    cfg.engine.tier = "q4s"
    m = load_fast_model(cfg)
    cache = blas.weight_cache()
    assert cache is not None and cache.budget == expansions_bytes(m.w) > 0
