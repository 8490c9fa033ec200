"""Regression tests for the defects of issue 13 that live in the server / engine-API code.

Each test here failed on main before its fix (the docstring names the item)."""

from __future__ import annotations

import json

import pytest

from server_harness import http_request, sse_events

LONG_THOUGHT = " ".join(f"step{i}" for i in range(80))


def thinker(prompt: str) -> str:
    """Thinks for a long time when the prompt opened a think block; answers after a forced close."""
    if prompt.endswith("\n</think>\n\n"):
        return "Final answer."
    if prompt.endswith("<think>\n"):
        return LONG_THOUGHT + "\n</think>\n\nnever reached"
    return "plain answer"


def post_json(live, path, body):
    status, _, raw = http_request(live.port, "POST", path, body)
    return status, json.loads(raw)


def ant(**kw):
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "think about it"}],
            "thinking": {"type": "enabled", "budget_tokens": 5}}
    body.update(kw)
    return body


def chat(**kw):
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "think about it"}],
            "thinking_budget": 5, "chat_template_kwargs": {"enable_thinking": True}}
    body.update(kw)
    return body


def prefix_cache_like(request, index):
    """What a real prefix cache reports: nothing on the first request of a fresh server, then
    (the continuation after the forced think close) all of the turn's own prompt + thought."""
    return 0 if index == 0 else len(request.prompt_ids) - 1


def _metric(live, name):
    status, _, raw = http_request(live.port, "GET", "/metrics")
    for line in raw.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


# --- 13.1: cached-token accounting across the reasoning-budget restart -----------------

def test_usage_cached_tokens_describe_the_clients_request(make_server):
    live = make_server(thinker, cached_tokens=prefix_cache_like)
    status, msg = post_json(live, "/v1/messages", ant())
    assert status == 200 and len(live.engine.requests) == 2  # the budget restart happened
    u = msg["usage"]
    assert u["cache_read_input_tokens"] == 0  # first request on a fresh server
    assert u["input_tokens"] == len(live.engine.requests[0].prompt_ids) and u["input_tokens"] > 0
    status, out = post_json(live, "/v1/chat/completions", chat())
    cu = out["usage"]
    assert 0 <= cu["prompt_tokens_details"]["cached_tokens"] <= cu["prompt_tokens"]
    assert cu["prompt_tokens_details"]["cached_tokens"] == 0  # index 2: a fresh first request again
    # /metrics counts what the usage says: no cached tokens were served to the clients
    assert _metric(live, "q27py_cached_prompt_tokens_total") == 0


def test_cached_tokens_never_exceed_the_prompt(make_server):
    live = make_server(lambda p: "ok", cached_tokens=10**6, default_thinking=False)
    status, msg = post_json(live, "/v1/messages", ant(thinking={"type": "disabled"}))
    u = msg["usage"]
    assert u["input_tokens"] >= 0 and u["cache_read_input_tokens"] == len(live.engine.requests[0].prompt_ids)


# --- 13.2: max_tokens is a hard limit, forced close included ---------------------------

@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5, 8, 64])
def test_max_tokens_counts_the_forced_think_close(make_server, max_tokens):
    live = make_server(thinker)
    status, msg = post_json(live, "/v1/messages", ant(max_tokens=max_tokens,
                                                       thinking={"type": "enabled", "budget_tokens": 50}))
    assert status == 200
    assert msg["usage"]["output_tokens"] <= max_tokens
    status, out = post_json(live, "/v1/chat/completions", chat(max_tokens=max_tokens))
    assert out["usage"]["completion_tokens"] <= max_tokens
    _, _, raw = http_request(live.port, "POST", "/v1/messages", ant(max_tokens=max_tokens, stream=True))
    final = [json.loads(d) for name, d in sse_events(raw) if name == "message_delta"][-1]
    assert final["usage"]["output_tokens"] <= max_tokens


# --- 13.3: edge sampling values and tool schemas, defined / refused at the boundary ----

def _bodies(**kw):
    user = [{"role": "user", "content": "hi"}]
    return [("/v1/messages", {"model": "m", "max_tokens": 8, "messages": user, **kw}),
            ("/v1/chat/completions", {"model": "m", "max_tokens": 8, "messages": user, **kw}),
            ("/v1/completions", {"model": "m", "max_tokens": 8, "prompt": "hi", **kw}),
            ("/v1/responses", {"model": "m", "max_output_tokens": 8, "input": "hi", **kw})]


@pytest.mark.parametrize("fields", [{"top_p": 0}, {"top_p": 0, "temperature": 1.0},
                                    {"temperature": 1e-310}, {"temperature": 5e-324, "top_p": 0.5}])
def test_edge_sampling_values_are_greedy_on_every_api(make_server, fields):
    from q27py.engine.sampling import validate

    live = make_server(lambda p: "ok", default_thinking=False)
    for path, body in _bodies(**fields):
        status, _, raw = http_request(live.port, "POST", path, body)
        assert status == 200, (path, raw[:200])
        sampling = live.engine.requests[-1].sampling
        validate(sampling)  # what the real engine runs first: it raised on top_p 0
        assert sampling.greedy and sampling.top_p == 1.0, (path, sampling)


@pytest.mark.parametrize("schema, where", [
    ({"type": "object", "anyOf": 5}, "anyOf"),
    ({"type": "object", "properties": {"a": {"oneOf": {"type": "string"}}}}, "oneOf"),
    ({"type": "object", "properties": []}, "properties"),
    ({"type": "object", "properties": {"a": 7}}, "properties.a"),
    ({"type": 3}, "type"),
    ({"type": "object", "required": "a"}, "required"),
    ({"type": "array", "items": [1]}, "items"),
])
def test_unusable_tool_schema_is_a_400_on_every_api(make_server, schema, where):
    live = make_server(lambda p: "ok", default_thinking=False)
    user = [{"role": "user", "content": "hi"}]
    cases = [("/v1/messages", {"model": "m", "max_tokens": 8, "messages": user,
                               "tools": [{"name": "f", "input_schema": schema}]}),
             ("/v1/chat/completions", {"model": "m", "messages": user, "tools": [
                 {"type": "function", "function": {"name": "f", "parameters": schema}}]}),
             ("/v1/responses", {"model": "m", "input": "hi", "tools": [
                 {"type": "function", "name": "f", "parameters": schema}]})]
    for path, body in cases:
        status, _, raw = http_request(live.port, "POST", path, body)
        assert status == 400, (path, raw[:200])
        err = json.loads(raw)["error"]
        assert err["type"] == "invalid_request_error" and where in err["message"], err


def test_schemas_the_parser_can_walk_are_accepted(make_server):
    live = make_server(lambda p: "ok", default_thinking=False)
    schema = {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                                               "b": {"type": ["integer", "null"], "enum": [1, None]},
                                               "c": {"type": "array", "items": {"type": "string"}},
                                               "d": True},
              "required": ["a"], "additionalProperties": False, "$defs": {"x": {"type": "string"}}}
    status, _, raw = http_request(live.port, "POST", "/v1/messages", {
        "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "f", "input_schema": schema}]})
    assert status == 200, raw[:300]


# --- 13.5: parsing / rendering / tokenizing run off the event loop ---------------------

@pytest.mark.parametrize("stage", ["parse", "render"])
def test_health_and_streams_answer_while_a_body_is_being_read(make_server, monkeypatch, stage):
    """A slow body read (a 30 MB request: seconds of JSON parsing, rendering, tokenizing) is
    simulated by blocking that step on an event; meanwhile /health and another request's
    stream must be served. On main both steps ran on the event loop, which froze."""
    import threading

    from q27py.server import app as app_mod
    from q27py.server import service as service_mod

    release, entered = threading.Event(), threading.Event()
    if stage == "parse":
        real = app_mod.parse_json_object

        def slow(raw, encoding=None):
            if b"SLOW-BODY" in raw:
                entered.set()
                release.wait(20)
            return real(raw, encoding)

        monkeypatch.setattr(app_mod, "parse_json_object", slow)
    else:
        real = service_mod.ChatService.render

        def slow(self, conv, **kw):
            if "SLOW-BODY" in conv.messages[-1].content:
                entered.set()
                release.wait(20)
            return real(self, conv, **kw)

        monkeypatch.setattr(service_mod.ChatService, "render", slow)
    live = make_server(lambda p: "streamed words here", default_thinking=False)
    slow_body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "SLOW-BODY"}]}
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        r=http_request(live.port, "POST", "/v1/messages", slow_body)))
    worker.start()
    try:
        assert entered.wait(10)
        status, _, raw = http_request(live.port, "GET", "/health")
        assert status == 200
        status, _, raw = http_request(live.port, "POST", "/v1/chat/completions", {
            "model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and b"streamed words here" not in raw  # split into deltas
        assert b"[DONE]" in raw
        assert not result  # the slow request is still being read
    finally:
        release.set()
        worker.join(20)
    assert result["r"][0] == 200


# --- 13.7: requests that should be refused; one rule for unhonoured options ------------

@pytest.mark.parametrize("path, body, mention", [
    ("/v1/responses", {"model": "m", "input": [{"type": "message", "role": "user", "content": "x"},
                                                {"type": "function_call_output", "output": "ok"}]}, "call_id"),
    ("/v1/responses", {"model": "m", "input": [{"type": "message", "role": "user", "content": "x"},
                                                {"type": "function_call_output", "call_id": "c1"}]}, "output"),
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "mystery"}, {"type": "hologram", "data": 1}]}]}, "supported type"),
    # Formats, log probabilities and penalties are honoured on every API now (server/control.py);
    # what stays refused is the same on all of them: values out of range, schemas that cannot be compiled.
    ("/v1/responses", {"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "s",
                                                                       "schema": {"type": 5}}}}, "text.format"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "s",
                                                                                         "schema": {"type": 5}}}},
     "response_format"),
    ("/v1/responses", {"model": "m", "input": "x", "top_logprobs": 99}, "top_logprobs"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ("/v1/responses", {"model": "m", "input": "x", "presence_penalty": 5}, "presence_penalty"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                              "presence_penalty": 5}, "presence_penalty"),
])
def test_requests_that_must_be_refused(make_server, path, body, mention):
    live = make_server(lambda p: "ok", default_thinking=False)
    status, _, raw = http_request(live.port, "POST", path, body)
    assert status == 400, raw[:300]
    err = json.loads(raw)["error"]
    assert err["type"] == "invalid_request_error" and mention in err["message"], err


def test_plain_text_format_and_known_blocks_still_pass(make_server):
    live = make_server(lambda p: "ok", default_thinking=False)
    ok = [("/v1/responses", {"model": "m", "input": "x", "text": {"format": {"type": "text"}, "verbosity": "low"}}),
          ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
              {"type": "mystery"}, {"type": "text", "text": "hi"}]}]})]
    for path, body in ok:
        assert http_request(live.port, "POST", path, body)[0] == 200


CALL = "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>"


def test_tool_choice_none_returns_a_written_call_as_text(make_server):
    live = make_server(lambda p: "Let me see.\n" + CALL, default_thinking=False)
    tool = {"name": "Bash", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}
    status, msg = post_json(live, "/v1/messages", {
        "model": "m", "max_tokens": 200, "messages": [{"role": "user", "content": "x"}],
        "tools": [tool], "tool_choice": {"type": "none"}})
    assert status == 200
    assert [b["type"] for b in msg["content"]] == ["text"] and msg["stop_reason"] == "end_turn"
    assert "<function=Bash>" in msg["content"][0]["text"]
    status, out = post_json(live, "/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "none",
        "tools": [{"type": "function", "function": {"name": "Bash", "parameters": tool["input_schema"]}}]})
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert "<function=Bash>" in choice["message"]["content"]
    # with tool_choice auto the same output is a call
    status, out = post_json(live, "/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "Bash", "parameters": tool["input_schema"]}}]})
    assert out["choices"][0]["finish_reason"] == "tool_calls"
