"""GraphCache's budgets (CPU: a stand-in capture and free-memory reading, no device): the graphs of a state, and
the model-level ones, stay within what the memory plan reserved for them; a new key beyond it runs eagerly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from q27py.gpu.graphs import GraphCache

MIB = 1 << 20


class _Graph:
    def __init__(self, log, key):
        self.log, self.key = log, key

    def launch(self, stream):
        self.log.append(("replay", self.key))


class _Cache(GraphCache):
    """Each capture takes `per` bytes of the stand-in device; `fail` makes the next capture raise it."""

    def __init__(self, per: int, **kw):
        self.free = 1 << 40
        self.per = per
        self.log: list = []
        self.fail: BaseException | None = None
        super().__init__(SimpleNamespace(stream=None), free_bytes=lambda: self.free, **kw)

    def _capture(self, enqueue):
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc
        self.free -= self.per
        return _Graph(self.log, len(self.log))


def _step(cache: _Cache, state, key, model: bool = False) -> str:
    """Run one step; what happened to it: "eager" (enqueue ran) or "graph" (a graph launched)."""
    before = len(cache.log)
    enqueue = lambda: cache.log.append(("eager", key))  # noqa: E731
    if model:
        cache.run_model(key, enqueue)
    else:
        cache.run(state, key, enqueue)
    return cache.log[before][0] if len(cache.log) > before else "none"


def test_a_state_at_its_budget_runs_new_keys_eagerly():
    cache = _Cache(3 * MIB, state_budget=5 * MIB)
    a, b = SimpleNamespace(id=1), SimpleNamespace(id=2)
    for key in (("main", 1), ("main", 8)):  # first sighting eager, second captured: 3, then 6 MiB >= 5
        assert _step(cache, a, key) == "eager"
        assert _step(cache, a, key) == "replay"
    assert cache.bytes_by_state[1] == 6 * MIB
    # a third key of the full state: eager on every sighting, never captured
    for _ in range(3):
        assert _step(cache, a, ("main", 16)) == "eager"
    assert cache.over_budget == 2 and (1, "main", 16) not in cache.graphs
    # what it already holds keeps replaying; another state has a budget of its own
    assert _step(cache, a, ("main", 1)) == "replay"
    _step(cache, b, ("main", 16))
    assert _step(cache, b, ("main", 16)) == "replay" and cache.bytes_by_state[2] == 3 * MIB
    # the state's graphs dropped (it was replaced): its budget is free again
    cache.drop_id(1)
    _step(cache, a, ("main", 16))
    assert _step(cache, a, ("main", 16)) == "replay"


def test_model_level_graphs_stop_at_their_budget():
    cache = _Cache(2 * MIB, model_budget=4 * MIB)
    for n in (2, 3, 4):
        _step(cache, None, ("batch", n), model=True)
        _step(cache, None, ("batch", n), model=True)
    assert cache.model_bytes == 4 * MIB and len(cache.model_graphs) == 2
    assert ("batch", 4) not in cache.model_graphs and cache.over_budget == 1
    assert _step(cache, None, ("batch", 2), model=True) == "replay"


def test_no_budget_means_no_limit():
    cache = _Cache(64 * MIB)
    s = SimpleNamespace(id=7)
    for w in range(1, 9):
        _step(cache, s, ("main", w))
        assert _step(cache, s, ("main", w)) == "replay"
    assert cache.over_budget == 0 and cache.bytes_by_state[7] == 8 * 64 * MIB


def test_a_capture_out_of_memory_runs_the_step_eagerly():
    class OutOfMemoryError(Exception):  # what CuPy's pool raises, by name
        pass

    cache = _Cache(MIB, state_budget=100 * MIB)
    s = SimpleNamespace(id=3)
    _step(cache, s, ("verify", 16))
    cache.fail = OutOfMemoryError("Out of memory allocating 2,097,152 bytes")
    assert _step(cache, s, ("verify", 16)) == "eager"  # the captured launches never ran: they run now
    assert cache.over_budget == 1 and (3, "verify", 16) not in cache.graphs
    assert _step(cache, s, ("verify", 16)) == "replay"  # a later sighting may capture once memory is back
    # any other failure is not absorbed
    _step(cache, s, ("verify", 15))  # first sighting: eager
    cache.fail = RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal"):
        _step(cache, s, ("verify", 15))


def test_the_budgets_are_what_the_memory_plan_reserved():
    from q27py.config import Q27Config
    from q27py.gpu.forward import batch_graph_bytes, graph_budgets, graph_bytes_per_state

    e = Q27Config().engine
    model = SimpleNamespace(cfg=SimpleNamespace(num_hidden_layers=64), has_mtp=True, max_batch=16, verify_lanes=16,
                            mtp_batch_lanes=16)
    got = graph_budgets(model, e)
    assert got == {"state_budget": graph_bytes_per_state(model, e), "model_budget": batch_graph_bytes(model)}
    assert got["state_budget"] == 65 * e.graph_bytes_per_layer and got["model_budget"] > 0


def test_the_replay_reports_the_warm_engines_graphs():
    from q27py.bench.replay import graph_stats

    cache = _Cache(MIB, state_budget=2 * MIB, model_budget=64 * MIB)
    s = SimpleNamespace(id=4)
    for key in (("main", 1), ("main", 2), ("main", 3)):
        _step(cache, s, key)
        _step(cache, s, key)
    _step(cache, None, ("batch", 2), model=True)
    _step(cache, None, ("batch", 2), model=True)
    got = graph_stats(SimpleNamespace(model=SimpleNamespace(graphs=cache)))
    assert got == {"captures": 3, "model_graph_bytes": MIB, "state_graph_bytes_max": 2 * MIB, "graphs_per_state_max": 2,
                   "state_budget": 2 * MIB, "model_budget": 64 * MIB, "steps_over_budget": 1}
    assert graph_stats(SimpleNamespace(model=SimpleNamespace())) is None  # the CPU path keeps no graphs



def test_first_sightings_are_counted_apart_from_captures_and_budget_eager_runs():
    """first_runs counts the eager runs of new keys (their first capture_after sightings) -- what the load
    bench reports a timed run still paid -- not the replays, not the over-budget eager runs."""
    cache = _Cache(3 * MIB, state_budget=4 * MIB)
    a = SimpleNamespace(id=1)
    assert _step(cache, a, ("main", 1)) == "eager"
    assert (cache.first_runs, cache.captures) == (1, 0)
    assert _step(cache, a, ("main", 1)) == "replay"  # captured on its second sighting
    assert _step(cache, a, ("main", 1)) == "replay"
    assert (cache.first_runs, cache.captures) == (1, 1)
    assert _step(cache, None, ("groups", 8, 2), model=True) == "eager"
    assert (cache.first_runs, cache.captures) == (2, 1)
    # a's graphs hold 3 MiB < 4: one more key is captured (6 MiB), then a third runs eagerly for the budget
    for key in (("main", 8), ("main", 16)):
        _step(cache, a, key)
        _step(cache, a, key)
    assert cache.first_runs == 4 and cache.captures == 2 and cache.over_budget == 1
