"""Output control through the three APIs on a real engine (the bundled model, speculation on):
a forced tool call and a JSON schema answer are valid on every API, logprobs come back on Chat
Completions, Completions and Responses, streamed output equals non-streamed output."""

import json

import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.commands.serve import build_app
from q27py.config import Q27Config
from q27py.engine.engine import LocalEngine
from server_harness import LiveServer, fast_limits, http_request, sse_events

BASH = {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
        "required": ["command"]}
TITLE = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
USER = "List the files in this directory."


@pytest.fixture(scope="module")
def live():
    cfg = Q27Config()
    cfg.engine.model_dir = DEFAULT_MODEL_DIR
    cfg.spec.enabled = True
    engine = LocalEngine.load(cfg)
    app = build_app(cfg, engine)
    bridge = app.service.bridge
    server = LiveServer(app.http_server(fast_limits(body_timeout_s=60)), on_start=bridge.start, on_stop=bridge.stop)
    with server:
        yield server


def post(live, path, body):
    status, _, raw = http_request(live.port, "POST", path, body, timeout=300)
    return status, raw


def chat_body(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": USER}], "max_tokens": 60,
            "chat_template_kwargs": {"enable_thinking": False}, **kw}


def test_forced_tool_call_on_all_three_apis(live):
    tools_chat = [{"type": "function", "function": {"name": "Bash", "parameters": BASH}}]
    s, raw = post(live, "/v1/chat/completions", chat_body(tools=tools_chat, tool_choice="required"))
    assert s == 200, raw
    msg = json.loads(raw)["choices"][0]
    calls = msg["message"].get("tool_calls") or []
    assert msg["finish_reason"] == "tool_calls" and calls and calls[0]["function"]["name"] == "Bash"
    assert isinstance(json.loads(calls[0]["function"]["arguments"])["command"], str)

    s, raw = post(live, "/v1/messages", {"model": "m", "max_tokens": 60, "messages": [{"role": "user", "content": USER}],
                                         "thinking": {"type": "disabled"}, "tools": [{"name": "Bash", "input_schema": BASH}],
                                         "tool_choice": {"type": "tool", "name": "Bash"}})
    assert s == 200, raw
    out = json.loads(raw)
    uses = [b for b in out["content"] if b["type"] == "tool_use"]
    assert out["stop_reason"] == "tool_use" and uses[0]["name"] == "Bash" and "command" in uses[0]["input"]

    s, raw = post(live, "/v1/responses", {"model": "m", "input": USER, "max_output_tokens": 60,
                                          "reasoning": {"effort": "none"},
                                          "tools": [{"type": "function", "name": "Bash", "parameters": BASH}],
                                          "tool_choice": "required"})
    assert s == 200, raw
    items = [i for i in json.loads(raw)["output"] if i["type"] == "function_call"]
    assert items and items[0]["name"] == "Bash" and "command" in json.loads(items[0]["arguments"])


def test_json_schema_on_all_three_apis(live):
    s, raw = post(live, "/v1/chat/completions", chat_body(
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": TITLE, "strict": True}}))
    texts = [json.loads(raw)["choices"][0]["message"]["content"]]
    s2, raw2 = post(live, "/v1/messages", {"model": "m", "max_tokens": 60, "thinking": {"type": "disabled"},
                                           "messages": [{"role": "user", "content": USER}],
                                           "output_config": {"format": {"type": "json_schema", "schema": TITLE}}})
    texts.append("".join(b.get("text", "") for b in json.loads(raw2)["content"] if b["type"] == "text"))
    s3, raw3 = post(live, "/v1/responses", {"model": "m", "input": USER, "max_output_tokens": 60,
                                            "reasoning": {"effort": "none"},
                                            "text": {"format": {"type": "json_schema", "name": "t", "schema": TITLE}}})
    out3 = json.loads(raw3)
    texts.append("".join(c["text"] for i in out3["output"] if i["type"] == "message" for c in i["content"]))
    assert (s, s2, s3) == (200, 200, 200)
    assert out3["text"]["format"]["type"] == "json_schema"
    for text in texts:
        assert isinstance(json.loads(text)["title"], str), text
    assert texts[0] == texts[1] == texts[2]  # same prompt, same greedy constrained answer


def test_logprobs_streamed_equal_non_streamed(live):
    body = chat_body(logprobs=True, top_logprobs=2, max_tokens=12)
    s, raw = post(live, "/v1/chat/completions", body)
    whole = json.loads(raw)["choices"][0]
    entries = whole["logprobs"]["content"]
    assert s == 200 and entries and all(len(e["top_logprobs"]) == 2 for e in entries)
    assert all(e["logprob"] <= 0 and e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-9 for e in entries)
    s, raw = post(live, "/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(d) for _, d in sse_events(raw) if d != "[DONE]"]
    streamed = [e for c in chunks for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert streamed == entries and text == (whole["message"]["content"] or "")

    s, raw = post(live, "/v1/completions", {"model": "m", "prompt": "def add(a, b):", "max_tokens": 8, "logprobs": 3})
    lp = json.loads(raw)["choices"][0]["logprobs"]
    assert s == 200 and len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) > 0
    s, raw = post(live, "/v1/completions", {"model": "m", "prompt": "def add(a, b):", "max_tokens": 8, "logprobs": 3,
                                            "stream": True})
    chunks = [json.loads(d) for _, d in sse_events(raw) if d != "[DONE]"]
    tokens = [t for c in chunks for ch in c["choices"] if ch.get("logprobs") for t in ch["logprobs"]["tokens"]]
    assert tokens == lp["tokens"]

    rbody = {"model": "m", "input": USER, "max_output_tokens": 12, "reasoning": {"effort": "none"}, "top_logprobs": 2}
    s, raw = post(live, "/v1/responses", rbody)
    part = [c for i in json.loads(raw)["output"] if i["type"] == "message" for c in i["content"]][0]
    s2, raw2 = post(live, "/v1/responses", {**rbody, "stream": True})
    done = [json.loads(d) for n, d in sse_events(raw2) if n == "response.output_text.done"]
    assert s == s2 == 200 and part["logprobs"] and done[0]["logprobs"] == part["logprobs"]


def test_penalties_change_output_and_stream_matches(live):
    base = chat_body(max_tokens=20)
    s, raw = post(live, "/v1/chat/completions", base)
    plain = json.loads(raw)["choices"][0]["message"]["content"]
    body = {**base, "frequency_penalty": 1.5, "presence_penalty": 1.0, "repetition_penalty": 1.3}
    s, raw = post(live, "/v1/chat/completions", body)
    penalized = json.loads(raw)["choices"][0]["message"]["content"]
    s, raw = post(live, "/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(d) for _, d in sse_events(raw) if d != "[DONE]"]
    streamed = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert penalized != plain and streamed == penalized


def test_a_call_written_without_declared_tools_comes_back_as_text(live):
    """The bundled agent model writes tool calls even when a request declares no tools (seen with
    this prompt); a client that offered none must get text, never tool_calls (as with tool_choice none)."""
    s, raw = post(live, "/v1/chat/completions", chat_body(max_tokens=20))
    msg = json.loads(raw)["choices"][0]["message"]
    assert s == 200 and not msg.get("tool_calls") and msg["content"]
