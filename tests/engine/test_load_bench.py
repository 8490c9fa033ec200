"""`q27py bench load` (q27py/bench/load.py) on the CPU path with the bundled model, CI-sized: the
report's structure and that the scheduler interleaves (streams overlap, a short request arriving
during a long prefill gets its first token before the long one). Not speed: no timing bars here."""

import argparse
import json

import pytest

from q27py.bench.load import Prompts, Stream, concurrency_run, pct, run_load
from q27py.config import Q27Config
from q27py.engine.engine import LocalEngine

ROW_KEYS = {"streams", "slots", "prompt_tokens", "gen_tokens", "tokens", "wall_s", "aggregate_tokens_per_s",
            "per_stream_decode_tokens_per_s_mean", "per_stream_decode_tokens_per_s_min", "per_stream_tokens_per_s_mean",
            "ttft_p50_s", "ttft_p99_s", "ttft_max_s", "itl_p50_s", "itl_p99_s", "overlapping_stream_pairs", "finish",
            "rounds", "max_running", "batched_rounds", "batched_lanes", "solo_turns", "round_seconds",
            "graph_first_runs", "graph_captures", "warm_passes"}
MIXED_KEYS = {"slots", "prefill_chunk", "interleave_chunk", "running_prompt_tokens", "long_prompt_tokens", "short_prompt_tokens",
              "short_gen_tokens", "running_itl_before_p50_s", "running_itl_during_prefill_p50_s",
              "running_itl_during_prefill_p99_s", "running_itl_during_prefill_max_s",
              "running_deliveries_during_prefill", "long_ttft_s", "short_ttft_s", "short_done_s",
              "short_first_before_long", "running_finish", "rounds", "max_running", "batched_rounds",
              "batched_lanes", "solo_turns", "round_seconds", "interleave_budget_ms", "piece_at_end"}
TOP_KEYS = {"bench", "device", "model", "model_name", "slots", "window", "spec", "batch_rounds", "batch_spec",
            "sweep_lanes", "batch_drafts", "recorded_acceptance", "interleave_chunk",
            "prompt_tokens", "gen_tokens", "warm_full", "concurrency", "aggregate_over_c1", "mixed", "memory"}


def engine(model, tok, slots, chunk=64, **knobs):
    cfg = Q27Config()
    for k, v in knobs.items():
        setattr(cfg.engine, k, v)
    cfg.engine.max_slots = slots
    cfg.engine.max_context = 4096
    cfg.engine.checkpoint_every = 0
    cfg.engine.cpu_prefill_chunk = chunk  # the long prompt takes several rounds
    return LocalEngine(cfg, model, tok)


def test_report_structure_and_interleaving(fast, tok):
    e = engine(fast, tok, slots=4)
    r = run_load(e, tok, streams=(1, 2, 3), prompt_tokens=24, gen_tokens=6, long_tokens=640, log=lambda *a: None)
    assert set(r) == TOP_KEYS and r["bench"] == "load" and r["device"] == "cpu" and r["slots"] == 4
    assert [row["streams"] for row in r["concurrency"]] == [1, 2, 3]
    for row in r["concurrency"]:
        c = row["streams"]
        assert set(row) == ROW_KEYS
        assert row["tokens"] == 6 * c and row["finish"] == ["length"]  # every stream got all its tokens
        assert row["max_running"] == c  # all of them ran in one round: they interleaved
        assert row["overlapping_stream_pairs"] == c - 1  # each later stream began before the one before it ended
        assert row["aggregate_tokens_per_s"] > 0 and row["ttft_p50_s"] <= row["ttft_p99_s"] <= row["ttft_max_s"]
    assert set(r["aggregate_over_c1"]) == {"1", "2", "3"} and r["aggregate_over_c1"]["1"] == 1.0
    m = r["mixed"]
    assert set(m) == MIXED_KEYS and m["prefill_chunk"] == 64 and m["long_prompt_tokens"] == 640
    # the running stream kept receiving tokens while the 10-chunk prompt prefilled ...
    assert m["running_deliveries_during_prefill"] >= 5
    # ... and the short request, arriving mid-prefill, was served beside it, not after it
    assert m["short_first_before_long"] and m["short_ttft_s"] < m["long_ttft_s"]
    assert m["running_finish"] == "cancelled" and m["max_running"] == 3
    assert not r["batch_rounds"] and all(row["batched_rounds"] == 0 for row in r["concurrency"])  # off by default
    mem = r["memory"]
    assert mem["state_bytes"] > 0 and mem["memory_per_slot_bytes"] == mem["state_bytes"]
    assert mem["graph_bytes_per_state"] is None and mem["live_sequences"] >= 3
    assert mem["model_graphs"] is None and mem["model_graph_bytes_reserved"] is None  # no CUDA graphs here
    json.dumps(r)  # the report is plain JSON


def test_batched_rounds_and_interleaved_prefill_are_counted(fast, tok):
    """With batch_rounds on the concurrent streams share decode_batch rounds (counted per run, one lane
    per decoding stream); the mixed case's long prompt goes in interleave_chunk pieces beside the
    running stream, so that stream gets a delivery every piece (64 / 16 = 4 per chunk)."""
    # "solo-only": every decoding slot shares (with "adaptive" the split follows measured speed)
    e = engine(fast, tok, slots=3, batch_rounds=True, interleave_chunk=16, batch_spec="solo-only")
    r = run_load(e, tok, streams=(1, 3), prompt_tokens=24, gen_tokens=6, long_tokens=640, log=lambda *a: None)
    assert r["batch_rounds"] and r["interleave_chunk"] == 16 and r["batch_spec"] == "solo-only"
    assert r["sweep_lanes"] == 0 and r["batch_drafts"] is False  # "solo-only": plain lanes
    assert all(row["solo_turns"] == 0 for row in r["concurrency"])
    one, three = r["concurrency"]
    assert one["batched_rounds"] == 0 and one["tokens"] == 6  # alone: its own (speculative) rounds
    assert three["tokens"] == 18 and three["batched_rounds"] >= 3
    assert 2 * three["batched_rounds"] <= three["batched_lanes"] <= 3 * three["batched_rounds"]
    # where the rounds' time went: shared rounds hold their sweeps (no batched drafting here), the lone
    # stream only its own rounds and its prompt's prefill, and the parts sum to no more than the run
    sec1, sec3 = one["round_seconds"], three["round_seconds"]
    assert sec1["shared"] == sec1["sweep"] == sec1["drafts"] == 0 and sec1["solo"] > 0 and sec1["prefill"] > 0
    assert 0 < sec3["sweep"] <= sec3["shared"] and sec3["drafts"] == 0 and sec3["prefill"] > 0
    assert sec3["shared"] + sec3["solo"] + sec3["prefill"] <= three["wall_s"] + 1e-3
    m = r["mixed"]
    assert m["interleave_chunk"] == 16 and m["running_deliveries_during_prefill"] >= 640 // 16 - 4
    assert m["batched_rounds"] > 0  # the short request decoded beside the running stream
    assert m["short_first_before_long"] and m["running_finish"] == "cancelled"


def test_one_slot_is_fifo_and_skips_the_mixed_case(fast, tok):
    e = engine(fast, tok, slots=1)
    r = run_load(e, tok, streams=(2,), prompt_tokens=16, gen_tokens=4, long_tokens=256, log=lambda *a: None)
    row = r["concurrency"][0]
    assert row["max_running"] == 1 and row["overlapping_stream_pairs"] == 0  # one after the other
    assert row["tokens"] == 8 and row["ttft_max_s"] > row["ttft_p50_s"]  # the second waited for the first
    assert "skipped" in r["mixed"]


def test_streams_beyond_the_slots_queue(fast, tok):
    e = engine(fast, tok, slots=2)
    row = concurrency_run(e, Prompts(tok, 1), 4, 16, 4)
    assert row["max_running"] == 2 and row["tokens"] == 16 and row["slots"] == 2


def test_prompts_are_distinct_and_exact(tok):
    p = Prompts(tok, 0)
    a, b, long = p.make(40), p.make(40), p.make(3000)
    assert len(a) == len(b) == 40 and len(long) == 3000 and a[:8] != b[:8]


def test_stream_timing_helpers():
    from q27py.engine.api import GenerationChunk, GenerationRequest

    s = Stream("x", GenerationRequest(prompt_ids=[1], max_tokens=3))
    s.t_submit = 0.0
    s.arrivals = [(1.0, 1), (1.5, 2), (3.5, 1)]
    assert s.tokens == 4 and s.ttft == 1.0
    assert s.gaps() == [0.5, 2.0] and s.gaps(start=2.0) == [2.0] and s.gaps(end=2.0) == [0.5]
    s.deliver(GenerationChunk([], finish_reason="length"))
    assert s.finish == "length" and s.tokens == 4  # an empty final chunk adds no arrival
    assert pct([1.0, 2.0, 3.0], 50) == 2.0 and pct([], 50) is None


def test_cli_wires_the_load_suite(capsys):
    from q27py.commands import bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["load", "--device", "cpu", "--streams", "1", "2", "--tokens", "3", "--prompt-tokens", "16",
                         "--long-tokens", "300", "--prefill-chunk", "64", "--max-slots", "3", "--json",
                         "--batch-rounds", "1", "--interleave-chunk", "32"])
    assert bench.suite(args) == "load" and bench.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == TOP_KEYS and out["slots"] == 3 and out["mixed"]["prefill_chunk"] == 64
    assert [r["tokens"] for r in out["concurrency"]] == [3, 6]
    assert out["batch_rounds"] and out["interleave_chunk"] == 32 and out["mixed"]["interleave_chunk"] == 32


@pytest.mark.parametrize("warm_full", [True, False])
def test_warmup_runs_every_concurrency(monkeypatch, fast, tok, warm_full):
    """Before the timed rows, run_load warms the largest concurrency twice (per-state graphs) and
    every other concurrency above one once (the shared sweep's graphs are keyed by width, and C
    streams that finish together never pass through the widths below C); with warm_full (the default)
    each timed row follows an untimed run of its own full size (the verify-group widths and chain shapes
    of a whole run: a short warm-up leaves the timed run paying them, device run 2026-12-06 r3)."""
    import q27py.bench.load as load

    calls = []
    real = load.concurrency_run

    def spy(engine_, prompts, c, prompt_tokens, gen_tokens, **kw):
        calls.append((c, gen_tokens))
        return real(engine_, prompts, c, prompt_tokens, gen_tokens, **kw)

    monkeypatch.setattr(load, "concurrency_run", spy)
    e = engine(fast, tok, slots=4)
    r = run_load(e, tok, streams=(1, 2, 4), prompt_tokens=16, gen_tokens=5, mixed=False, log=lambda *a: None,
                 warm_full=warm_full)
    assert calls[:3] == [(4, 5), (4, 5), (2, 5)], calls  # warm-up: 4 twice, then 2 (min(gen, 16) tokens)
    timed = [(1, 5), (1, 5), (2, 5), (2, 5), (4, 5), (4, 5)] if warm_full else [(1, 5), (2, 5), (4, 5)]
    assert calls[3:] == timed, calls
    assert r["warm_full"] is warm_full and [row["streams"] for row in r["concurrency"]] == [1, 2, 4]
    assert [row["warm_passes"] for row in r["concurrency"]] == ([1, 1, 1] if warm_full else [0, 0, 0])
    # the CPU model has no graphs: nothing to count
    assert all(row["graph_first_runs"] is None and row["graph_captures"] is None for row in r["concurrency"])


def test_a_row_reports_the_graph_keys_first_seen_in_it(fast, tok):
    """concurrency_run reports the graph cache's eager first runs and captures that happened inside it."""
    from types import SimpleNamespace

    e = engine(fast, tok, slots=2)
    g = SimpleNamespace(first_runs=0, captures=0)
    real_step = e.model.forward

    def forward(*a, **kw):  # every forward inside the run: one new key, every second one also captured
        g.first_runs += 1
        g.captures += g.first_runs % 2
        return real_step(*a, **kw)

    e.model.graphs = g
    e.model.forward = forward
    try:
        row = concurrency_run(e, Prompts(tok, 3), 2, 16, 4)
    finally:
        del e.model.graphs, e.model.forward
    assert row["graph_first_runs"] == g.first_runs > 0 and row["graph_captures"] == g.captures


def test_the_mixed_run_warms_width_two(monkeypatch, fast, tok):
    """With the mixed run on, the warm-up also runs two streams even when --streams is 1 alone: the
    mixed run's running and short streams share rounds of width 2, and unwarmed their first shared
    round paid the width-2 captures (e10 on the GPU: a 538 ms gap beside the 32K prefill)."""
    import q27py.bench.load as load

    calls = []
    real = load.concurrency_run

    def spy(engine_, prompts, c, prompt_tokens, gen_tokens, **kw):
        calls.append((c, prompt_tokens))
        return real(engine_, prompts, c, prompt_tokens, gen_tokens, **kw)

    monkeypatch.setattr(load, "concurrency_run", spy)
    e = engine(fast, tok, slots=3)
    run_load(e, tok, streams=(1,), prompt_tokens=16, gen_tokens=3, long_tokens=80, log=lambda *a: None)
    assert [c for c, p in calls if p == 16][:3] == [1, 1, 2], calls  # warm 1 twice, then width 2; then the timed row


def test_the_report_says_when_the_sweep_carries_drafts(fast, tok):
    e = engine(fast, tok, slots=2, batch_rounds=True, batch_spec="drafts")
    r = run_load(e, tok, streams=(2,), prompt_tokens=24, gen_tokens=12, long_tokens=None, mixed=False,
                 log=lambda *a: None)
    assert r["batch_spec"] == "drafts" and r["sweep_lanes"] == 16 and r["batch_drafts"] is False  # host ladder
    assert r["concurrency"][0]["tokens"] == 24 and r["concurrency"][0]["batched_rounds"] >= 1


@pytest.mark.parametrize("new_in_runs, slots, c, want", [(2, 8, 1, 3), (0, 8, 1, 1), (99, 8, 1, 9), (99, 8, 4, 3)])
def test_full_warm_repeats_until_a_run_meets_no_new_graph_key(monkeypatch, new_in_runs, slots, c, want):
    """_warm_full runs the timed size again while a run still met new graph keys (C streams rotate over the
    slots, and solo graphs are per state), at most ceil(slots / c) + 1 times."""
    from types import SimpleNamespace

    import q27py.bench.load as load

    runs = []

    def fake(engine_, prompts, c_, p, g):
        runs.append(c_)
        fresh = len(runs) <= new_in_runs
        return {"graph_first_runs": 3 if fresh else 0, "graph_captures": 1 if fresh else 0}

    monkeypatch.setattr(load, "concurrency_run", fake)
    e = SimpleNamespace(max_slots=slots, model=SimpleNamespace(graphs=SimpleNamespace(first_runs=0, captures=0)))
    assert load._warm_full(e, None, c, 16, 8) == want and runs == [c] * want
    e.model = SimpleNamespace()  # no graphs (the CPU path): one run
    runs.clear()
    assert load._warm_full(e, None, c, 16, 8) == 1 and runs == [c]
