"""Issue 13.11: a seeded, bounded fuzz of every API's request reader and of the streaming splitter.

Valid bodies of each API are mutated at random paths (wrong types, missing and extra keys,
odd numbers and strings) and run through what a request runs before the engine: the API
module's `read`, then rendering. Whatever the body, the outcome is a validated request or an
ApiError with a 4xx status whose body has the API's error shape; nothing else may escape (a
500). The splitter is fed random model output whole and in random pieces: the same events
either way. A few hundred mutated bodies also go through the live server over HTTP.
Seeded, so a failure reproduces: the message names the seed.
"""

from __future__ import annotations

import copy
import json
import random

from q27py.chat import stream as cs
from q27py.chat.render import RenderError, render
from q27py.chat.stream import StreamSplitter
from q27py.server import anthropic, completions, openai_chat, responses
from q27py.server.errors import ANTHROPIC, OPENAI, ApiError, error_body

from server_harness import http_request

CASES_PER_API = 5000
SPLITTER_CASES = 3000
HTTP_CASES = 300

SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["command"]}
BASES = {
    "anthropic": {"model": "m", "max_tokens": 50, "stream": False, "system": [{"type": "text", "text": "sys"}],
                  "thinking": {"type": "enabled", "budget_tokens": 10}, "temperature": 0.5, "top_p": 0.9,
                  "stop_sequences": ["END"], "tool_choice": {"type": "auto"},
                  "tools": [{"name": "Bash", "description": "run", "input_schema": SCHEMA}],
                  "messages": [{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": [
                                   {"type": "thinking", "thinking": "t", "signature": "s"},
                                   {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}}]},
                               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                             "content": "ok"}, {"type": "text", "text": "go"}]}]},
    "openai": {"model": "m", "max_tokens": 50, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "seed": 1,
               "stop": ["END"], "stream_options": {"include_usage": True}, "parallel_tool_calls": True,
               "chat_template_kwargs": {"enable_thinking": True}, "tool_choice": "auto",
               "tools": [{"type": "function", "function": {"name": "Bash", "parameters": SCHEMA}}],
               "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                            {"role": "assistant", "content": None, "tool_calls": [
                                {"id": "c1", "type": "function",
                                 "function": {"name": "Bash", "arguments": "{\"command\": \"ls\"}"}}]},
                            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]},
    "responses": {"model": "m", "max_output_tokens": 50, "instructions": "sys", "reasoning": {"effort": "low"},
                  "parallel_tool_calls": False, "tool_choice": "auto", "text": {"format": {"type": "text"}},
                  "tools": [{"type": "function", "name": "Bash", "parameters": SCHEMA},
                            {"type": "custom", "name": "apply_patch", "description": "edit"}],
                  "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
                            {"type": "function_call", "call_id": "c1", "name": "Bash", "arguments": "{}"},
                            {"type": "function_call_output", "call_id": "c1", "output": "ok"}]},
    "completions": {"model": "m", "prompt": "def f(x):", "max_tokens": 10, "temperature": 0, "stop": ["\n\n"],
                    "echo": False, "stream": False},
}
MODULES = {"anthropic": anthropic, "openai": openai_chat, "responses": responses, "completions": completions}
PATHS = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions", "responses": "/v1/responses",
         "completions": "/v1/completions"}
ODD = [None, True, False, 0, -1, 1, 2, 0.5, -0.0, 1e-310, 1e308, 10**20, "", "x", "none", "auto", "text",
       "<think>", "</tool_call>", "user", "function", [], [1], ["a", 1], {}, {"type": 5}, {"type": "text"},
       {"anyOf": 5}, [{"type": "text", "text": 3}], [{}], "\u0000", "é" * 3]
KEYS = ["type", "role", "content", "text", "name", "input", "arguments", "call_id", "output", "tools",
        "tool_choice", "thinking", "budget_tokens", "format", "schema", "properties", "n", "logprobs",
        "top_logprobs", "max_tokens", "stream", "stop", "items", "anyOf", "enable_thinking", "zzz"]


def _odd(rng):
    return copy.deepcopy(rng.choice(ODD))


def mutate(rng: random.Random, value, depth: int = 0):
    if depth > 6 or rng.random() < 0.15:
        return _odd(rng)
    if isinstance(value, dict):
        out = dict(value)
        op = rng.random()
        if out and op < 0.25:
            out.pop(rng.choice(list(out)))
        elif op < 0.4:
            out[rng.choice(KEYS)] = _odd(rng)
        elif out:
            key = rng.choice(list(out))
            out[key] = mutate(rng, out[key], depth + 1)
        return out
    if isinstance(value, list):
        out = list(value)
        op = rng.random()
        if out and op < 0.2:
            out.pop(rng.randrange(len(out)))
        elif out and op < 0.35:
            out.append(copy.deepcopy(rng.choice(out)))
        elif op < 0.45:
            out.insert(rng.randrange(len(out) + 1), _odd(rng))
        elif out:
            i = rng.randrange(len(out))
            out[i] = mutate(rng, out[i], depth + 1)
        return out
    return _odd(rng)


def body_for(api: str, seed: int) -> dict:
    rng = random.Random(seed)
    body = copy.deepcopy(BASES[api])
    for _ in range(rng.randint(1, 3)):
        body = mutate(rng, body, 1)
    if not isinstance(body, dict):
        body = {"model": body}
    return body


def _check_error(api: str, err: ApiError, seed: int) -> None:
    assert 400 <= err.status < 500, (api, seed, err.status, err.message)
    shape = error_body(ANTHROPIC if api == "anthropic" else OPENAI, err)
    json.dumps(shape)
    if api == "anthropic":
        assert shape["type"] == "error" and set(shape["error"]) == {"type", "message"}, (seed, shape)
    else:
        assert set(shape["error"]) == {"message", "type", "param", "code"}, (seed, shape)
    assert shape["error"]["message"], seed


def test_request_readers_never_raise_anything_but_a_4xx():
    outcomes = {"ok": 0, "4xx": 0}
    for api, module in MODULES.items():
        for seed in range(CASES_PER_API):
            body = body_for(api, seed)
            try:
                req = module.read(body)
                if req.conv is not None:
                    try:
                        render(req.conv, enable_thinking=req.enable_thinking is not False)
                    except RenderError:  # service.render answers it with a 400
                        outcomes["4xx"] += 1
                        continue
                outcomes["ok"] += 1
            except ApiError as err:
                _check_error(api, err, seed)
                outcomes["4xx"] += 1
            except Exception as exc:  # noqa: BLE001 - this is what the test is looking for
                raise AssertionError(f"{api} seed {seed}: {type(exc).__name__}: {exc}\nbody: {body}") from exc
    # the mutations reach both sides: the corpus is neither all-valid nor all-broken
    assert outcomes["ok"] > 1000 and outcomes["4xx"] > 1000, outcomes


FRAGMENTS = ["Hello", " world", "\n", "\n\n", "<think>\n", "\n</think>\n\n", "</think>", "<tool_call>",
             "</tool_call>", "\n<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n</function>\n"
             "</tool_call>", "<function=Bash>", "<parameter=command>", "</parameter>", "</function>", "{",
             "}", '{"name": "Bash", "arguments": {"command": "ls"}}', "```", "`", "é", "🙂", " ", "\t", "x" * 7]


def _merged(events) -> list:
    """Events with consecutive deltas of one kind joined (chunking may split them differently)."""
    out = []
    for ev in events:
        if isinstance(ev, (cs.TextDelta, cs.ReasoningDelta)):
            if out and type(out[-1]) is type(ev):
                out[-1] = type(ev)(out[-1].text + ev.text)
                continue
            out.append(type(ev)(ev.text))
        elif isinstance(ev, cs.ToolCallStart):
            out.append(("start", ev.index, ev.name))
        elif isinstance(ev, cs.ToolCallEnd):
            out.append(("end", ev.index, ev.arguments_json))
    return out


def test_splitter_streamed_equals_whole():
    tools = {"Bash": SCHEMA}
    for seed in range(SPLITTER_CASES):
        rng = random.Random(seed)
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12)))
        in_reasoning = rng.random() < 0.5
        calls = rng.random() < 0.8

        def run(pieces):
            splitter = StreamSplitter(tools, in_reasoning=in_reasoning, tool_calls=calls,
                                      make_id=lambda i: f"id{i}")
            events = []
            for piece in pieces:
                events += splitter.feed(piece)
            return _merged(events + splitter.finish())

        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        try:
            whole, streamed = run([text]), run(pieces)
        except Exception as exc:  # noqa: BLE001
            raise AssertionError(f"splitter seed {seed}: {type(exc).__name__}: {exc}\ntext: {text!r}") from exc
        assert streamed == whole, (seed, text, pieces)


def test_live_server_answers_mutated_bodies_without_a_500(make_server):
    live = make_server(lambda p: "ok", default_thinking=False)
    rng = random.Random(13)
    for i in range(HTTP_CASES):
        api = rng.choice(list(MODULES))
        seed = 10**6 + i
        status, _, raw = http_request(live.port, "POST", PATHS[api], body_for(api, seed))
        assert status < 500, (api, seed, status, raw[:300])
        payload = json.loads(raw) if raw and not raw.startswith(b"event:") and not raw.startswith(b"data:") else None
        if status >= 400:
            assert payload is not None and "error" in payload, (api, seed, raw[:300])
    assert http_request(live.port, "GET", "/health")[0] == 200
