"""POST <api>/render returns exactly the prompt ids the generation endpoint runs with (for routers)."""

from __future__ import annotations

import json

import pytest

from server_harness import http_request

CASES = [
    ("/v1/chat/completions", {"model": "m", "max_tokens": 5, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]}),
    ("/v1/messages", {"model": "m", "max_tokens": 5, "system": "be brief", "thinking": {"type": "adaptive"},
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    ("/v1/responses", {"model": "m", "max_output_tokens": 5, "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "client_metadata": {"x": "y"}}),
    ("/v1/completions", {"model": "m", "max_tokens": 5, "prompt": "import os\n"}),
]


@pytest.mark.parametrize("path,body", CASES, ids=[c[0] for c in CASES])
def test_render_gives_the_ids_the_engine_runs(make_server, path, body):
    live = make_server(keys=["k"])
    auth = {"Authorization": "Bearer k"}
    assert http_request(live.port, "POST", path + "/render", body)[0] == 401  # keyed like the API itself
    status, _, raw = http_request(live.port, "POST", path + "/render", body, auth)
    assert status == 200, raw
    rendered = json.loads(raw)
    assert rendered["token_ids"] and rendered["prompt_tokens"] == len(rendered["token_ids"])
    assert not live.engine.requests  # rendering runs nothing
    status, _, raw = http_request(live.port, "POST", path, body, auth)
    assert status == 200, raw
    assert live.engine.requests[0].prompt_ids == rendered["token_ids"]


def test_render_rejects_what_the_api_rejects(make_server):
    live = make_server()
    status, _, raw = http_request(live.port, "POST", "/v1/messages/render", {"model": "m", "messages": "nope"})
    assert status == 400 and json.loads(raw)["type"] == "error"  # in the Anthropic shape
    status, _, raw = http_request(live.port, "POST", "/v1/completions/render", {"model": "m"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "prompt"
