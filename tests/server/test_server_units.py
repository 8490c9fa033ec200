"""Small server pieces on their own: stop matching, the metrics text format, error shapes, body parsing."""

from __future__ import annotations

import json
import random
import re

import pytest

from q27py.server.errors import ApiError, error_body, family_for_path
from q27py.server.metrics import EngineLoad, Metrics
from q27py.server.params import parse_json_object
from q27py.chat.textstage import StopMatcher


def run_stops(stops, pieces):
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    return out + m.flush(), m.matched


@pytest.mark.parametrize("text, stops, expected", [
    ("hello world", ["wor"], ("hello ", "wor")),
    ("hello world", ["xyz"], ("hello world", None)),
    ("abcabd", ["abd", "ca"], ("ab", "ca")),  # the earliest match wins
    ("aaab", ["aab"], ("a", "aab")),
    ("end with a partial sto", ["stop"], ("end with a partial sto", None)),
])
def test_stop_matcher_any_chunking(text, stops, expected):
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(5, len(text) - 1))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        assert run_stops(stops, pieces) == expected, pieces


def test_stop_matcher_holds_back_only_possible_prefixes():
    m = StopMatcher(["</end>"])
    assert m.feed("abc</e") == "abc"
    assert m.feed("x") == "</ex"


SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? -?[0-9.e+-]+$')


def test_metrics_text_format():
    m = Metrics('model "quoted"\nname')
    m.count_request("chat", 200)
    m.count_request("anthropic", 400)
    m.count_generation(prompt=100, cached=40, generated=20, reasoning=5, finish_reason="stop")
    text = m.render(EngineLoad(running=1, waiting=3, kv_cache_usage=0.25))
    assert text.endswith("\n")
    names_typed = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("gauge", "counter", "histogram")
            names_typed.add(name)
        elif not line.startswith("# HELP "):
            assert SAMPLE.match(line), line
            name = line.split("{")[0].split(" ")[0]
            assert name in names_typed or re.sub(r"_(bucket|sum|count)$", "", name) in names_typed, line
    assert 'vllm:num_requests_waiting{model_name="model \\"quoted\\"\\nname"} 3' in text
    assert re.search(r"^vllm:kv_cache_usage_perc\{.*\} 0\.25$", text, re.M)
    assert re.search(r"^vllm:prompt_tokens_total\{.*\} 100$", text, re.M)
    assert re.search(r'^vllm:request_success_total\{.*finished_reason="stop"\} 1$', text, re.M)
    assert 'q27py_http_requests_total{api="anthropic",status="400"} 1' in text


def test_error_shapes_follow_the_path():
    assert family_for_path("/v1/messages") == family_for_path("/v1/messages/count_tokens/") == "anthropic"
    assert family_for_path("/v1/responses") == family_for_path("/api/hello") == "openai"
    ant = error_body("anthropic", ApiError(413, "too big"))
    assert ant["error"] == {"type": "request_too_large", "message": "too big"} and ant["request_id"]
    oai = error_body("openai", ApiError(400, "bad", param="messages", code="context_length_exceeded"))
    assert oai == {"error": {"message": "bad", "type": "invalid_request_error", "param": "messages",
                             "code": "context_length_exceeded"}}


def test_body_parsing_accepts_bom_and_names_the_problem():
    assert parse_json_object(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}
    assert parse_json_object(json.dumps({"t": "\U0001f600 \ud83d\ude00"}).encode())["t"] == "\U0001f600 \U0001f600"
    with pytest.raises(ApiError, match="line 1 column 6"):
        parse_json_object(b'{"a":}')
