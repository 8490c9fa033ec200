"""Metrics: histograms, speculation and prefix-cache counters, the timeline, /dashboard.json == /metrics."""

from __future__ import annotations

import json
import math
import time

import pytest

from promtext import histogram, parse, value
from q27py.server.metrics import EngineLoad, GenerationRecord, Histogram, Metrics, Timeline
from server_harness import http_request

MODEL = {"model_name": "m"}


def _scrape(port: int, headers=None) -> dict:
    status, hdrs, body = http_request(port, "GET", "/metrics", None, headers)
    assert status == 200 and hdrs["content-type"].startswith("text/plain; version=0.0.4")
    return parse(body.decode())


def test_histogram_buckets_are_upper_inclusive_and_cumulative():
    h = Histogram((1, 2, 5))
    for v in (0.5, 1.0, 2.5, 10.0):
        h.observe(v)
    h.observe(2.0, n=3)  # one observation standing for three tokens
    lines = ["# TYPE x histogram"] + h.samples("x", {"model_name": "m"})
    fams = parse("\n".join(lines) + "\n")
    hist = histogram(fams, "x")
    assert hist["buckets"] == [(1.0, 2), (2.0, 5), (5.0, 6), (math.inf, 7)]
    assert hist["count"] == 7 and hist["sum"] == pytest.approx(0.5 + 1 + 2.5 + 10 + 6)


def test_one_generation_lands_in_every_histogram_and_counter():
    m = Metrics("m")
    m.observe_generation(GenerationRecord(
        submitted=10.0, started=10.5, first_token=11.5, finished=13.5, prompt_tokens=120, generated_tokens=6,
        cached_tokens=100, finish_reason="stop", token_gaps=[(0.5, 1), (1.0, 4)],
        stats={"rounds_by_source": {"none": 1, "mtp": 2, "suffix": 1},
               "drafted_by_source": {"mtp": 6, "suffix": 4}, "accepted_by_source": {"mtp": 3, "suffix": 4},
               "accepted_by_depth": [5, 2]}))
    fams = parse(m.render(EngineLoad(running=0, waiting=0, kv_cache_usage=0.0,
                                     prefix={"hits": 1, "misses": 3, "reused_tokens": 100, "live_sequences": 2,
                                             "snapshots": 5}, slots_total=4)))
    ttft = histogram(fams, "vllm:time_to_first_token_seconds")
    assert ttft["count"] == 1 and ttft["sum"] == pytest.approx(1.5)
    assert dict(ttft["buckets"])[1.0] == 0 and dict(ttft["buckets"])[2.5] == 1
    itl = histogram(fams, "vllm:inter_token_latency_seconds")
    # the 4-token round's 1.0 s gap is 0.25 s per token; the single token's gap is 0.5 s
    assert itl["count"] == 5 and itl["sum"] == pytest.approx(1.5)
    assert dict(itl["buckets"])[0.2] == 0 and dict(itl["buckets"])[0.3] == 4 and dict(itl["buckets"])[0.5] == 5
    assert histogram(fams, "vllm:e2e_request_latency_seconds")["sum"] == pytest.approx(3.5)
    assert histogram(fams, "vllm:request_queue_time_seconds")["sum"] == pytest.approx(0.5)
    assert histogram(fams, "vllm:request_prefill_time_seconds")["sum"] == pytest.approx(1.0)
    assert histogram(fams, "vllm:request_decode_time_seconds")["sum"] == pytest.approx(2.0)
    prompt = histogram(fams, "vllm:request_prompt_tokens")
    assert prompt["sum"] == 120 and dict(prompt["buckets"])[100.0] == 0 and dict(prompt["buckets"])[200.0] == 1
    assert histogram(fams, "vllm:request_generation_tokens")["sum"] == 6
    assert value(fams, "vllm:prefix_cache_queries_total") == 120
    assert value(fams, "vllm:prefix_cache_hits_total") == 100
    assert value(fams, "vllm:spec_decode_num_drafts_total") == 3  # mtp + suffix rounds, not plain steps
    assert value(fams, "vllm:spec_decode_num_draft_tokens_total") == 10
    assert value(fams, "vllm:spec_decode_num_accepted_tokens_total") == 7
    assert value(fams, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=0) == 5
    assert value(fams, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=1) == 2
    assert value(fams, "q27py_spec_draft_tokens_total", drafter="suffix") == 4
    assert value(fams, "q27py_spec_accepted_tokens_total", drafter="mtp") == 3
    assert value(fams, "q27py_spec_rounds_total", source="none") == 1
    assert value(fams, "q27py_prefix_cache_hit_ratio") == 0.25
    assert value(fams, "q27py_slots_in_use") == 2 and value(fams, "q27py_slots_total") == 4
    assert value(fams, "q27py_prefix_cache_snapshots") == 5


def test_a_generation_without_tokens_has_no_first_token_time():
    m = Metrics("m")
    m.observe_generation(GenerationRecord(submitted=0.0, started=0.1, first_token=None, finished=0.2,
                                          prompt_tokens=3, generated_tokens=0, cached_tokens=0,
                                          finish_reason="cancelled"))
    fams = parse(m.render(EngineLoad(0, 0, 0.0)))
    assert histogram(fams, "vllm:time_to_first_token_seconds")["count"] == 0
    assert histogram(fams, "vllm:e2e_request_latency_seconds")["count"] == 1


def test_timeline_sums_per_bucket_carries_gauges_and_forgets_old_buckets():
    t = Timeline(bucket_s=2.0, span_s=10.0)
    t.add(100.0, tokens=3)
    t.add(101.9, tokens=4)  # same 2 s bucket
    t.add(104.0, tokens=1)
    t.gauge(100.5, waiting=2)
    t.gauge(101.0, waiting=1)  # a bucket keeps its peak
    t.gauge(106.0, waiting=0)
    s = t.series(107.0, ("tokens",), ("waiting",))
    assert s["t"] == [98.0, 100.0, 102.0, 104.0, 106.0]
    assert s["tokens"] == [0.0, 7.0, 0.0, 1.0, 0.0]
    assert s["waiting"] == [0.0, 2, 2, 2, 0]  # carried forward until the next sample
    t.add(130.0, tokens=5)  # 30 s later: everything before the window is dropped
    s = t.series(130.0, ("tokens",), ("waiting",))
    assert sum(s["tokens"]) == 5.0 and s["waiting"] == [0] * len(s["t"])


def test_live_server_histograms_move_with_each_generation(make_server):
    live = make_server(tokens_per_chunk=2, prefill_delay_s=0.05, token_delay_s=0.01, cached_tokens=5)
    port = live.port
    before = _scrape(port)
    assert histogram(before, "vllm:time_to_first_token_seconds")["count"] == 0
    for api, path, body in [
        ("chat", "/v1/chat/completions", {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}),
        ("anthropic", "/v1/messages", {"model": "m", "max_tokens": 50, "stream": True,
                                       "messages": [{"role": "user", "content": "hello there"}]}),
        ("responses", "/v1/responses", {"model": "m", "max_output_tokens": 50, "input": "hey"}),
    ]:
        status, _, raw = http_request(port, "POST", path, body, timeout=30)
        assert status == 200, raw
    after = _scrape(port)
    n = 3
    ttft = histogram(after, "vllm:time_to_first_token_seconds")
    assert ttft["count"] == n
    assert dict(ttft["buckets"])[0.04] == 0 and ttft["sum"] >= 0.05 * n  # the scripted prefill delay
    e2e = histogram(after, "vllm:e2e_request_latency_seconds")
    assert e2e["count"] == n and e2e["sum"] >= ttft["sum"]
    generated = value(after, "vllm:generation_tokens_total")
    gen_hist = histogram(after, "vllm:request_generation_tokens")
    assert gen_hist["count"] == n and gen_hist["sum"] == generated > 2 * n
    # every token after each generation's first 2-token chunk had a gap before it
    itl = histogram(after, "vllm:inter_token_latency_seconds")
    assert itl["count"] == generated - 2 * n and itl["sum"] > 0
    prompt_hist = histogram(after, "vllm:request_prompt_tokens")
    assert prompt_hist["sum"] == value(after, "vllm:prompt_tokens_total") == value(after, "vllm:prefix_cache_queries_total")
    assert value(after, "vllm:prefix_cache_hits_total") == 5 * n

    status, _, _ = http_request(port, "POST", "/v1/completions", {"model": "m", "max_tokens": 3, "prompt": "x"})
    assert status == 200
    again = _scrape(port)
    assert histogram(again, "vllm:time_to_first_token_seconds")["count"] == n + 1
    assert histogram(again, "vllm:request_generation_tokens")["sum"] == generated + 3  # length-capped at 3


def test_dashboard_json_matches_metrics(make_server):
    live = make_server(tokens_per_chunk=3, cached_tokens=4)
    for i in range(2):
        status, _, _ = http_request(live.port, "POST", "/v1/chat/completions",
                                    {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": f"q{i}"}]})
        assert status == 200
    status, _, raw = http_request(live.port, "GET", "/dashboard.json")
    assert status == 200
    d = json.loads(raw)
    fams = _scrape(live.port)
    t = d["totals"]
    assert t["generations"] == 2 == histogram(fams, "vllm:e2e_request_latency_seconds")["count"]
    assert t["generation_tokens"] == value(fams, "vllm:generation_tokens_total")
    assert t["prompt_tokens"] == value(fams, "vllm:prompt_tokens_total")
    assert t["ttft_sum"] == pytest.approx(histogram(fams, "vllm:time_to_first_token_seconds")["sum"], abs=1e-6)
    assert t["prefix_hit_tokens"] == value(fams, "vllm:prefix_cache_hits_total") == 8
    # the timeline holds the same generations
    s = d["series"]
    assert sum(s["requests"]) == 2 and sum(s["generated_tokens"]) == t["generation_tokens"]
    assert len(s["t"]) == len(s["waiting"]) == len(s["slots"]) and d["gauges"]["running"] == 0


def test_dashboard_assets_are_public_and_self_contained_but_data_needs_the_key(make_server):
    live = make_server(keys=["k1"])
    status, headers, page = http_request(live.port, "GET", "/dashboard")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in headers["content-security-policy"]
    status, headers, script = http_request(live.port, "GET", "/dashboard.js")
    assert status == 200 and headers["content-type"].startswith("text/javascript")
    for asset in (page, script):
        assert b"http://" not in asset and b"https://" not in asset  # no external assets
    assert b'src="/dashboard.js"' in page and b"/dashboard.json" in script
    assert http_request(live.port, "GET", "/dashboard.json")[0] == 401
    assert http_request(live.port, "GET", "/metrics")[0] == 401
    status, _, raw = http_request(live.port, "GET", "/dashboard.json", None, {"Authorization": "Bearer k1"})
    assert status == 200 and json.loads(raw)["model"] == "scripted-tiny"
    assert http_request(live.port, "POST", "/dashboard.json", b"", {"Authorization": "Bearer k1"})[0] == 405


def test_metrics_without_key_opens_only_metrics(make_server):
    live = make_server(keys=["k1"], metrics_without_key=True)
    assert http_request(live.port, "GET", "/metrics")[0] == 200
    assert http_request(live.port, "POST", "/metrics", b"")[0] == 401  # only the scrape, nothing else
    assert http_request(live.port, "GET", "/dashboard.json")[0] == 401
    assert http_request(live.port, "POST", "/v1/chat/completions",
                        {"model": "m", "messages": [{"role": "user", "content": "x"}]})[0] == 401


def test_metrics_without_key_flag_maps_into_the_config():
    import argparse

    from q27py.commands import serve

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    assert serve.build_config(p.parse_args([]), environ={}).server.metrics_without_key is False
    assert serve.build_config(p.parse_args(["--metrics-without-key"]), environ={}).server.metrics_without_key is True


class _SlowToReleaseEngine:
    """Yields one token and the end, then spends a while releasing its state (as the real engine's
    prefix-cache release does when the bridge closes the generator)."""

    max_context = 4096
    model_name = "slow-release"

    def __init__(self, stop_id: int):
        self.stop_id = stop_id

    def prefix_stats(self):  # the Engine protocol (engine/api.py)
        return None

    def kv_cache_usage(self):
        return None

    def generate(self, request):
        from q27py.engine.api import GenerationChunk

        try:
            yield GenerationChunk(token_ids=[self.stop_id])
            yield GenerationChunk(token_ids=[], finish_reason="stop",
                                  stats={"prompt_tokens": len(request.prompt_ids), "generated_tokens": 1})
        finally:
            time.sleep(0.5)


def test_a_generation_is_in_metrics_as_soon_as_its_response_is(tokenizer):
    """Regression: the timing tap was closed after the engine released its state, so a client
    reading /metrics right after its response could miss its own generation."""
    from q27py.server.app import App
    from q27py.server.bridge import EngineBridge
    from q27py.server.service import ChatService
    from server_harness import LiveServer, fast_limits

    engine = _SlowToReleaseEngine(min(tokenizer.eos_ids))
    bridge = EngineBridge(engine)
    service = ChatService(bridge, tokenizer, model_name=engine.model_name, template="qwen3.6",
                          stop_ids=tokenizer.eos_ids)
    app = App(service)
    with LiveServer(app.http_server(fast_limits()), on_start=bridge.start, on_stop=bridge.stop) as live:
        status, _, _ = http_request(live.port, "POST", "/v1/chat/completions",
                                    {"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert status == 200
        fams = _scrape(live.port)
        assert histogram(fams, "vllm:e2e_request_latency_seconds")["count"] == 1
        assert histogram(fams, "vllm:request_generation_tokens")["sum"] == 1
