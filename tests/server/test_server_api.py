"""The three APIs end to end over HTTP: real tokenizer, renderer and splitter; scripted model side."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest

from grammars import check_anthropic, check_chat, check_responses
from server_harness import HOST, http_request, sse_events

BASH = {"name": "Bash", "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"},
                                                           "timeout": {"type": "integer"}},
                         "required": ["command"]}}
CHAT_BASH = {"type": "function", "function": {"name": "Bash", "description": BASH["description"],
                                              "parameters": BASH["input_schema"]}}
CALL = ("<tool_call>\n<function=Bash>\n<parameter=command>\necho ok\n</parameter>\n"
        "<parameter=timeout>\n5\n</parameter>\n</function>\n</tool_call>")


def reply(prompt: str, reasoning: str, answer: str) -> str:
    """What a model says after `prompt`: reasoning only if the prompt left the think block open."""
    if prompt.endswith("<think>\n"):
        return f"{reasoning}\n</think>\n\n{answer}"
    return answer


def agent(prompt: str) -> str:
    if "<tool_response>" in prompt:
        return reply(prompt, "The tool said ok.", "The command printed ok.")
    return reply(prompt, "I should run the command.", "Running it.\n" + CALL)


def post(live, path, body, headers=None):
    status, hdrs, raw = http_request(live.port, "POST", path, body, headers)
    return status, hdrs, raw


def post_json(live, path, body, headers=None):
    status, _, raw = post(live, path, body, headers)
    return status, json.loads(raw)


def anthropic_body(**kw):
    body = {"model": "claude-whatever", "max_tokens": 200, "messages": [{"role": "user", "content": "run echo ok"}],
            "tools": [BASH]}
    body.update(kw)
    return body


# ---------------------------------------------------------------------------
# Anthropic Messages


def test_anthropic_stream_grammar_and_round_trip(make_server):
    live = make_server(agent)
    status, hdrs, raw = post(live, "/v1/messages?beta=true", anthropic_body(stream=True),
                             {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219,xyz"})
    assert status == 200 and hdrs["content-type"] == "text/event-stream"
    out = check_anthropic(sse_events(raw))
    assert out["kinds"] == ["thinking", "text", "tool_use"]
    assert out["thinking"] == "I should run the command."
    assert out["text"] == "Running it."
    assert out["tools"] == [("Bash", {"command": "echo ok", "timeout": 5})]
    assert out["stop_reason"] == "tool_use"

    # the client runs the tool and sends the result back, echoing the thinking block
    history = [{"role": "user", "content": "run echo ok"},
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": out["thinking"], "signature": out["signatures"][0]},
                   {"type": "text", "text": out["text"]},
                   {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": out["tools"][0][1]}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok\n",
                                             "cache_control": {"type": "ephemeral"}}]}]
    status, msg = post_json(live, "/v1/messages", anthropic_body(messages=history))
    assert status == 200
    assert msg["stop_reason"] == "end_turn"
    assert [b["type"] for b in msg["content"]] == ["thinking", "text"]
    assert msg["content"][1]["text"] == "The command printed ok."
    prompt = live.engine.prompts[-1]
    assert "<tool_response>\nok\n</tool_response>" in prompt
    assert "<function=Bash>\n<parameter=command>\necho ok\n</parameter>" in prompt


def test_anthropic_stream_and_whole_agree(make_server):
    live = make_server(agent)
    _, whole = post_json(live, "/v1/messages", anthropic_body())
    _, _, raw = post(live, "/v1/messages", anthropic_body(stream=True))
    streamed = check_anthropic(sse_events(raw))
    blocks = whole["content"]
    assert blocks[0] == {"type": "thinking", "thinking": streamed["thinking"], "signature": streamed["signatures"][0]}
    assert blocks[1] == {"type": "text", "text": streamed["text"]}
    assert (blocks[2]["name"], blocks[2]["input"]) == streamed["tools"][0]
    assert whole["usage"] == streamed["usage"]
    # every generated token counts, the end-of-turn token included
    assert whole["usage"]["output_tokens"] == len(live.engine.tokenizer.encode(agent("<think>\n"))) + 1


def test_count_tokens_equals_prefill(make_server):
    live = make_server(agent)
    body = anthropic_body(system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.2.3.abc;"},
                                  {"type": "text", "text": "You are helpful.", "cache_control": {"type": "ephemeral"}}],
                          messages=[{"role": "user", "content": "hi"}, {"role": "system", "content": "env: linux"}],
                          thinking={"type": "enabled", "budget_tokens": 50})
    count_body = {k: v for k, v in body.items() if k != "max_tokens"}
    status, counted = post_json(live, "/v1/messages/count_tokens?beta=true", count_body)
    assert status == 200
    _, msg = post_json(live, "/v1/messages", body)
    assert counted["input_tokens"] == msg["usage"]["input_tokens"] == len(live.engine.requests[-1].prompt_ids)
    assert "billing" not in live.engine.prompts[-1]
    # the trailing system message is rendered in place, after the user turn
    assert live.engine.prompts[-1].index("<|im_start|>user\nhi") < live.engine.prompts[-1].index("env: linux")


def test_anthropic_context_overflow_is_the_compaction_signal(make_server):
    live = make_server(agent, max_context=300)
    body = anthropic_body(messages=[{"role": "user", "content": "word " * 400}])
    status, err = post_json(live, "/v1/messages", dict(body, stream=True))
    assert status == 400
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert re.fullmatch(r"prompt is too long: \d+ tokens > \d+ maximum", err["error"]["message"])
    n, limit = map(int, re.findall(r"\d+", err["error"]["message"]))
    assert n > limit and limit < 300
    assert not live.engine.requests, "an overflow never reaches the engine"


def test_max_tokens_clamped_to_context(make_server):
    live = make_server(agent, max_context=1000)
    status, _ = post_json(live, "/v1/messages", anthropic_body(max_tokens=128000))
    assert status == 200
    req = live.engine.requests[-1]
    assert len(req.prompt_ids) + req.max_tokens == 1000


@pytest.mark.parametrize("thinking, server_default, opened", [
    (None, True, True), (None, False, False), ({"type": "adaptive", "display": "omitted"}, False, False),
    ({"type": "adaptive"}, True, True), ({"type": "enabled", "budget_tokens": 64}, False, True),
    ({"type": "disabled"}, True, False)])
def test_thinking_default_and_override(make_server, thinking, server_default, opened):
    live = make_server(agent, default_thinking=server_default)
    body = anthropic_body(thinking=thinking) if thinking else anthropic_body()
    status, msg = post_json(live, "/v1/messages", body)
    assert status == 200
    prompt = live.engine.prompts[-1]
    assert prompt.endswith("<think>\n") == opened
    assert prompt.endswith("<think>\n\n</think>\n\n") == (not opened)
    assert (msg["content"][0]["type"] == "thinking") == opened


def test_reasoning_budget_forces_close_and_still_answers(make_server):
    long_thought = " ".join(f"step{i}" for i in range(60))

    def script(prompt):
        if prompt.endswith("\n</think>\n\n"):  # the continuation after the forced close
            return "Final answer: 42."
        return reply(prompt, long_thought, "never reached")

    live = make_server(script)
    body = anthropic_body(thinking={"type": "enabled", "budget_tokens": 7}, tools=None)
    _, _, raw = post(live, "/v1/messages", dict(body, stream=True))
    out = check_anthropic(sse_events(raw))
    assert out["kinds"] == ["thinking", "text"]
    assert out["text"] == "Final answer: 42."
    first, second = live.engine.requests
    tok = live.engine.tokenizer
    continuation = second.prompt_ids[len(first.prompt_ids):]
    close_ids = tok.encode("\n</think>\n\n")
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
    assert continuation[-len(close_ids):] == close_ids and len(continuation) == 7 + len(close_ids)
    assert tok.decode(continuation[:7]) == out["thinking"]
    assert second.max_tokens == 200 - 7 - len(close_ids)
    assert out["usage"]["output_tokens"] == 7 + len(close_ids) + len(tok.encode("Final answer: 42.")) + 1


def test_stop_sequences(make_server):
    live = make_server(lambda p: reply(p, "hmm", "one two STOP three"))
    _, msg = post_json(live, "/v1/messages", anthropic_body(stop_sequences=["STOP", "zzz"], tools=None))
    assert msg["stop_reason"] == "stop_sequence" and msg["stop_sequence"] == "STOP"
    assert msg["content"][-1] == {"type": "text", "text": "one two "}
    _, _, raw = post(live, "/v1/messages", anthropic_body(stop_sequences=["STOP"], tools=None, stream=True))
    out = check_anthropic(sse_events(raw))
    assert (out["text"], out["stop_reason"], out["stop_sequence"]) == ("one two ", "stop_sequence", "STOP")
    assert live.engine.cancelled.is_set() or live.engine.requests[-1].cancel.is_set()


def test_max_tokens_reached(make_server):
    live = make_server(lambda p: "a b c d e f g h i j k l m n o p")
    _, msg = post_json(live, "/v1/messages", anthropic_body(max_tokens=4, thinking={"type": "disabled"}))
    assert msg["stop_reason"] == "max_tokens" and msg["usage"]["output_tokens"] == 4


def test_cached_tokens_reported(make_server):
    live = make_server(agent, cached_tokens=100)
    _, msg = post_json(live, "/v1/messages", anthropic_body())
    total = len(live.engine.requests[-1].prompt_ids)
    assert msg["usage"]["cache_read_input_tokens"] == 100
    assert msg["usage"]["input_tokens"] == total - 100
    # prompts longer than the 100 cached tokens: cached is never more than the prompt (issue 13.1)
    long = "x " * 200
    _, chat = post_json(live, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": long}]})
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == 100
    _, resp = post_json(live, "/v1/responses", {"model": "m", "input": long})
    assert resp["usage"]["input_tokens_details"]["cached_tokens"] == 100


def test_sampling_parameters_reach_the_engine(make_server):
    live = make_server(agent)
    post_json(live, "/v1/messages", anthropic_body(temperature=0.7, top_p=0.9, top_k=20))
    s = live.engine.requests[-1].sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.7, 0.9, 20)
    post_json(live, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                             "temperature": 0.3, "top_p": 0.5, "top_k": 5, "min_p": 0.1, "seed": 7})
    s = live.engine.requests[-1].sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.3, 0.5, 5, 0.1, 7)


def test_unknown_anthropic_fields_tolerated(make_server):
    live = make_server(agent)
    body = anthropic_body(
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high", "format": {"type": "json_schema", "schema": {}}},
        metadata={"user_id": "{\"device_id\": \"x\"}"}, service_tier="auto",
        thinking={"type": "adaptive", "display": "omitted"},
        tools=[dict(BASH, cache_control={"type": "ephemeral"}, eager_input_streaming=True),
               {"name": "WebFetch", "description": "fetch", "input_schema": {"type": "object"}, "defer_loading": True},
               {"type": "web_search_20250305", "name": "web_search"}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"},
                                                "citations": None}], "clear_at": 3},
                  {"role": "system", "content": "mid-conversation env", "output_config": {}}])
    status, msg = post_json(live, "/v1/messages", body)
    assert status == 200, msg
    assert "WebFetch" not in live.engine.prompts[-1], "deferred tools stay out of the prompt"


# ---------------------------------------------------------------------------
# Chat Completions and Completions


def chat_body(**kw):
    body = {"model": "gpt-whatever", "messages": [{"role": "user", "content": "run echo ok"}], "tools": [CHAT_BASH]}
    body.update(kw)
    return body


def test_chat_stream_grammar_with_usage(make_server):
    live = make_server(agent)
    _, _, raw = post(live, "/v1/chat/completions", chat_body(stream=True, stream_options={"include_usage": True}))
    out = check_chat(sse_events(raw), include_usage=True)
    assert out["reasoning"] == "I should run the command."
    assert out["text"] == "Running it."
    assert out["tools"] == {0: {"name": "Bash", "arguments": {"command": "echo ok", "timeout": 5}}}
    assert out["finish"] == "tool_calls"
    u = out["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["prompt_tokens"] == len(live.engine.requests[-1].prompt_ids)
    assert u["completion_tokens_details"]["reasoning_tokens"] > 0


def test_chat_whole_response_and_tool_history(make_server):
    live = make_server(agent)
    status, resp = post_json(live, "/v1/chat/completions", chat_body())
    assert status == 200
    msg = resp["choices"][0]["message"]
    assert resp["choices"][0]["finish_reason"] == "tool_calls"
    assert msg["reasoning_content"] == "I should run the command." and msg["content"] == "Running it."
    call = msg["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"command": "echo ok", "timeout": 5}
    history = [{"role": "user", "content": "run echo ok"},
               dict(msg, role="assistant"),
               {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]
    _, resp2 = post_json(live, "/v1/chat/completions", chat_body(messages=history))
    assert resp2["choices"][0]["message"]["content"] == "The command printed ok."
    assert resp2["choices"][0]["finish_reason"] == "stop"


def test_chat_thinking_switches(make_server):
    live = make_server(agent, default_thinking=True)
    post_json(live, "/v1/chat/completions", chat_body(chat_template_kwargs={"enable_thinking": False}))
    assert live.engine.prompts[-1].endswith("</think>\n\n")
    post_json(live, "/v1/chat/completions", chat_body(reasoning_effort="none"))
    assert live.engine.prompts[-1].endswith("</think>\n\n")
    post_json(live, "/v1/chat/completions", chat_body())
    assert live.engine.prompts[-1].endswith("<think>\n")


def test_chat_parallel_tool_calls_off_ends_after_first_call(make_server):
    live = make_server(lambda p: CALL + "\n" + CALL.replace("echo ok", "echo two"))
    _, resp = post_json(live, "/v1/chat/completions", chat_body(chat_template_kwargs={"enable_thinking": False}))
    assert len(resp["choices"][0]["message"]["tool_calls"]) == 2
    _, resp = post_json(live, "/v1/chat/completions", chat_body(parallel_tool_calls=False,
                                                                chat_template_kwargs={"enable_thinking": False}))
    assert len(resp["choices"][0]["message"]["tool_calls"]) == 1


def test_chat_overflow_error_shape(make_server):
    live = make_server(agent, max_context=200)
    status, err = post_json(live, "/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "w " * 300}]))
    assert status == 400
    assert err["error"]["code"] == "context_length_exceeded" and err["error"]["type"] == "invalid_request_error"


def test_completions_raw_text(make_server):
    live = make_server(lambda p: " world, and more text after that")
    status, resp = post_json(live, "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 50,
                                                       "stop": [","]})
    assert status == 200
    assert resp["choices"][0]["text"] == " world" and resp["choices"][0]["finish_reason"] == "stop"
    assert live.engine.prompts[-1] == "hello", "no chat template on /v1/completions"
    _, resp = post_json(live, "/v1/completions", {"model": "m", "prompt": "hello", "echo": True, "max_tokens": 2})
    assert resp["choices"][0]["text"].startswith("hello world") and resp["choices"][0]["finish_reason"] == "length"
    _, _, raw = post(live, "/v1/completions", {"model": "m", "prompt": [[1, 2, 3]], "max_tokens": 50, "stream": True,
                                               "stream_options": {"include_usage": True}})
    events = sse_events(raw)
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " world, and more text after that"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 3
    assert live.engine.requests[-1].prompt_ids == [1, 2, 3]


# ---------------------------------------------------------------------------
# Responses (Codex)

CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Run a command",
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}, "strict": False},
    {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
     "tools": [{"type": "function", "name": "spawn_agent", "description": "spawn",
                "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}]},
    {"type": "custom", "name": "apply_patch", "description": "patch files",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: 'x'"}},
    {"type": "web_search", "external_web_access": False},
]


def codex_input(*extra):
    return [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context/>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "run echo"}]}, *extra]


def test_responses_stream_function_call_and_round_trip(make_server):
    def script(prompt):
        if "<tool_response>" in prompt:
            return reply(prompt, "It worked.", "Done: tool-ran-ok")
        return reply(prompt, "Use exec_command.", "<tool_call>\n<function=exec_command>\n<parameter=cmd>\n"
                                                  "echo tool-ran-ok\n</parameter>\n</function>\n</tool_call>")

    live = make_server(script)
    body = {"model": "qwen-local", "stream": True, "input": codex_input(), "tools": CODEX_TOOLS,
            "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "abc", "client_metadata": {"x": 1}}
    status, _, raw = post(live, "/v1/responses", body, {"accept": "text/event-stream", "originator": "codex_exec"})
    assert status == 200
    out = check_responses(sse_events(raw))
    assert out["status"] == "completed"
    kinds = [i["type"] for i in out["items"]]
    assert kinds == ["reasoning", "function_call"]
    call = out["items"][1]
    assert call["name"] == "exec_command" and json.loads(call["arguments"]) == {"cmd": "echo tool-ran-ok"}
    u = out["usage"]
    assert u["input_tokens"] == len(live.engine.requests[-1].prompt_ids)
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    prompt = live.engine.prompts[-1]
    assert "You are Codex." in prompt and "web_search" not in prompt
    assert "multi_agent_v1__spawn_agent" in prompt

    follow = body | {"input": codex_input(out["items"][0], call,
                                          {"type": "function_call_output", "call_id": call["call_id"],
                                           "output": "Process exited with code 0\nOutput:\ntool-ran-ok\n"})}
    _, _, raw = post(live, "/v1/responses", follow)
    out2 = check_responses(sse_events(raw))
    assert [i["type"] for i in out2["items"]] == ["reasoning", "message"]
    assert out2["items"][1]["content"][0]["text"] == "Done: tool-ran-ok"
    assert "Use exec_command." in live.engine.prompts[-1], "echoed reasoning items reach the prompt"


def test_responses_namespace_and_custom_tools_restored(make_server):
    def script(prompt):
        return ("<tool_call>\n<function=multi_agent_v1__spawn_agent>\n<parameter=task>\nlook around\n</parameter>\n"
                "</function>\n</tool_call>\n<tool_call>\n<function=apply_patch>\n<parameter=input>\n"
                "*** Begin Patch\n*** End Patch\n</parameter>\n</function>\n</tool_call>")

    live = make_server(script, default_thinking=False)
    body = {"model": "m", "input": codex_input(), "tools": CODEX_TOOLS}
    _, resp = post_json(live, "/v1/responses", body)
    spawn, patch = resp["output"]
    assert spawn["type"] == "function_call" and spawn["namespace"] == "multi_agent_v1"
    assert spawn["name"] == "spawn_agent" and json.loads(spawn["arguments"]) == {"task": "look around"}
    assert patch["type"] == "custom_tool_call" and patch["name"] == "apply_patch"
    assert patch["input"] == "*** Begin Patch\n*** End Patch"
    _, _, raw = post(live, "/v1/responses", dict(body, stream=True))
    out = check_responses(sse_events(raw))
    assert [(i["type"], i.get("namespace"), i["name"]) for i in out["items"]] == [
        ("function_call", "multi_agent_v1", "spawn_agent"), ("custom_tool_call", None, "apply_patch")]
    assert out["items"][1]["input"] == patch["input"]
    # history with both call kinds is accepted back
    follow = body | {"input": codex_input(*resp["output"],
                                          {"type": "function_call_output", "call_id": spawn["call_id"],
                                           "output": [{"type": "input_text", "text": "spawned"}]},
                                          {"type": "custom_tool_call_output", "call_id": patch["call_id"],
                                           "output": "applied"})}
    status, _ = post_json(live, "/v1/responses", follow)
    assert status == 200


def test_responses_overflow_and_incomplete(make_server):
    live = make_server(lambda p: "a b c d e f g h i j k", max_context=300)
    status, err = post_json(live, "/v1/responses", {"model": "m", "input": "w " * 400})
    assert status == 400 and err["error"]["code"] == "context_length_exceeded"
    _, _, raw = post(live, "/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 3, "stream": True})
    out = check_responses(sse_events(raw))
    assert out["status"] == "incomplete" and out["final"]["response"]["incomplete_details"]["reason"] == "max_output_tokens"


# ---------------------------------------------------------------------------
# Keep-alive, disconnects, concurrency, metrics


def test_keepalive_events_during_long_prefill(make_server):
    live = make_server(agent, prefill_delay_s=0.7, ping_interval_s=0.15)
    _, _, raw = post(live, "/v1/messages", anthropic_body(stream=True))
    names = [n for n, _ in sse_events(raw)]
    first_block = names.index("content_block_start")
    assert names[:2] == ["message_start", "ping"] and names[2:first_block].count("ping") >= 2
    check_anthropic(sse_events(raw))
    _, _, raw = post(live, "/v1/responses", {"model": "m", "input": "x", "stream": True})
    out = check_responses(sse_events(raw))
    assert out["events"][:4] == ["response.created"] + ["response.in_progress"] * 3
    _, _, raw = post(live, "/v1/chat/completions", chat_body(stream=True))
    assert raw.count(b": keep-alive") >= 2
    check_chat(sse_events(raw))


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", anthropic_body(stream=True)),
    ("/v1/chat/completions", chat_body(stream=True)),
    ("/v1/responses", {"model": "m", "input": "x", "stream": True}),
    ("/v1/messages", anthropic_body()),  # not streaming: the disconnect is noticed all the same
])
def test_client_disconnect_cancels_generation(make_server, path, body):
    live = make_server(lambda p: "word " * 500, token_delay_s=0.02, tokens_per_chunk=1)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((HOST, live.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    deadline = time.monotonic() + 5
    while not live.engine.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    sock.close()
    assert live.engine.cancelled.wait(3), "generation kept running after the client left"
    deadline = time.monotonic() + 3
    while live.app.service.bridge.load().running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live.app.service.bridge.load().running == 0
    assert http_request(live.port, "GET", "/health")[0] == 200


def test_queued_request_of_a_departed_client_never_runs(make_server):
    live = make_server(lambda p: "tok " * 40, token_delay_s=0.01, tokens_per_chunk=1, default_thinking=False)
    first = threading.Thread(target=post, args=(live, "/v1/chat/completions", chat_body(tools=None)))
    first.start()
    while not live.engine.requests:
        time.sleep(0.01)
    payload = json.dumps(chat_body(tools=None, stream=True)).encode()
    sock = socket.create_connection((HOST, live.port))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\n\r\n"
                 .encode() + payload)
    deadline = time.monotonic() + 3
    while live.app.service.bridge.load().waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live.app.service.bridge.load().waiting == 1
    sock.close()
    first.join(10)
    time.sleep(0.1)
    assert len(live.engine.requests) == 1, "the departed client's request was generated anyway"
    assert live.app.service.bridge.load().waiting == 0


def test_concurrent_requests_queue_and_metrics_stay_responsive(make_server):
    live = make_server(lambda p: "tok " * 30, token_delay_s=0.01, tokens_per_chunk=1)
    results = []

    def one(i):
        status, _, raw = post(live, "/v1/chat/completions", chat_body(tools=None, stream=i % 2 == 0))
        results.append(status)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.15)
    status, hdrs, raw = http_request(live.port, "GET", "/metrics")
    text = raw.decode()
    running = int(re.search(r'^vllm:num_requests_running\{[^}]*\} (\d+)$', text, re.M).group(1))
    waiting = int(re.search(r'^vllm:num_requests_waiting\{[^}]*\} (\d+)$', text, re.M).group(1))
    assert running == 1 and waiting >= 3
    usage = float(re.search(r'^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$', text, re.M).group(1))
    assert 0 < usage <= 1
    for t in threads:
        t.join(20)
    assert results == [200] * 6
    text = http_request(live.port, "GET", "/metrics")[2].decode()
    assert re.search(r'^vllm:num_requests_running\{[^}]*\} 0$', text, re.M)
    assert re.search(r'^q27py_http_requests_total\{api="chat",status="200"\} 6$', text, re.M)


def test_engine_failure_is_a_500_in_the_api_shape(make_server):
    def broken(prompt):
        raise RuntimeError("model exploded")

    live = make_server(broken)
    status, err = post_json(live, "/v1/messages", anthropic_body())
    assert status == 500 and err["error"]["type"] == "api_error"
    status, err = post_json(live, "/v1/chat/completions", chat_body())
    assert status == 500 and err["error"]["type"] == "server_error"
    _, _, raw = post(live, "/v1/responses", {"model": "m", "input": "x", "stream": True})
    assert check_responses(sse_events(raw))["status"] == "failed"
    _, _, raw = post(live, "/v1/messages", anthropic_body(stream=True))
    assert sse_events(raw)[-1][0] == "error"
    assert http_request(live.port, "GET", "/health")[0] == 200


def test_models_health_probes_and_unknown_paths(make_server):
    live = make_server(agent)
    status, _, raw = http_request(live.port, "GET", "/v1/models?limit=1000")
    models = json.loads(raw)
    assert status == 200 and models["data"][0]["id"] == "scripted-tiny" and models["object"] == "list"
    assert json.loads(http_request(live.port, "GET", "/v1/models/qwen-local")[2])["id"] == "qwen-local"
    assert json.loads(http_request(live.port, "GET", "/health")[2])["status"] == "ok"
    for path in ("/", "/api/hello", "/v1/messages"):
        status, hdrs, body = http_request(live.port, "HEAD", path)
        assert status == 200 and body == b""
    status, _, raw = http_request(live.port, "GET", "/v1/nope")
    assert status == 404 and "error" in json.loads(raw)
    status, _, raw = http_request(live.port, "GET", "/v1/messages")
    assert status == 405 and json.loads(raw)["type"] == "error"
    status, _, raw = http_request(live.port, "DELETE", "/v1/models")
    assert status == 405
