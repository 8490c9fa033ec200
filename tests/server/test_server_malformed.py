"""A corpus of malformed requests: each gets a 4xx in its API's own error shape, and the server lives on."""

from __future__ import annotations

import json

import pytest

from server_harness import http_request

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
ALL_PATHS = (MESSAGES, COUNT, CHAT, COMPLETIONS, RESPONSES)

USER = [{"role": "user", "content": "hi"}]


def ant(**kw):
    body = {"model": "m", "max_tokens": 10, "messages": USER}
    body.update(kw)
    return {k: v for k, v in body.items() if v is not ...}


def chat(**kw):
    body = {"model": "m", "messages": USER}
    body.update(kw)
    return {k: v for k, v in body.items() if v is not ...}


def cmpl(**kw):
    body = {"model": "m", "prompt": "hi"}
    body.update(kw)
    return {k: v for k, v in body.items() if v is not ...}


def resp(**kw):
    body = {"model": "m", "input": "hi"}
    body.update(kw)
    return {k: v for k, v in body.items() if v is not ...}


# (name, path, body as bytes or JSON-able object, substring the error message must contain or None)
CASES: list[tuple[str, str, object, str | None]] = []

for path in ALL_PATHS:
    CASES += [
        ("empty body", path, b"", "empty"),
        ("whitespace body", path, b"  \n ", "empty"),
        ("not json", path, b"hello there", "not valid JSON"),
        ("truncated json", path, b'{"model": "m", "messages": [', "not valid JSON"),
        ("invalid utf-8", path, b'{"model": "m\xff\xfe"}', "UTF-8"),
        ("top-level array", path, b"[1, 2]", "JSON object"),
        ("top-level string", path, b'"just a string"', "JSON object"),
        ("top-level null", path, b"null", "JSON object"),
        ("NaN constant", path, b'{"model": "m", "temperature": NaN}', "not valid JSON"),
        ("lone surrogate", path, b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}],'
                                 b' "input": "\\udfff", "prompt": "\\ud800"}', "surrogate"),
        ("deep nesting", path, b"[" * 100000 + b"]" * 100000, None),
        ("huge integer", path, b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}", None),
        ("trailing garbage", path, b'{"model": "m"} trailing', "not valid JSON"),
        ("model is a number", path, {"model": 5, "max_tokens": 5, "messages": USER, "input": "x", "prompt": "x"},
         "model"),
    ]

CASES += [
    # Anthropic Messages
    ("missing model", MESSAGES, ant(model=...), "model"),
    ("missing messages", MESSAGES, ant(messages=...), "messages"),
    ("messages is an object", MESSAGES, ant(messages={"role": "user"}), "messages"),
    ("empty messages", MESSAGES, ant(messages=[]), "messages"),
    ("message is a string", MESSAGES, ant(messages=["hi"]), "messages[0]"),
    ("unknown role", MESSAGES, ant(messages=[{"role": "robot", "content": "hi"}]), "role"),
    ("missing role", MESSAGES, ant(messages=[{"content": "hi"}]), "role"),
    ("content is a number", MESSAGES, ant(messages=[{"role": "user", "content": 5}]), "content"),
    ("content missing", MESSAGES, ant(messages=[{"role": "user"}]), "content"),
    ("block not an object", MESSAGES, ant(messages=[{"role": "user", "content": ["hi"]}]), "content[0]"),
    ("text block text is a number", MESSAGES,
     ant(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), "text"),
    ("image block", MESSAGES, ant(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]), "image"),
    ("tool_use input not json", MESSAGES, ant(messages=[USER[0], {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "Bash", "input": "{not json"}]}]), "input"),
    ("tool_use without name", MESSAGES, ant(messages=[USER[0], {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "input": {}}]}]), "name"),
    ("thinking block text a number", MESSAGES, ant(messages=[USER[0], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": 7, "signature": "s"}]}]), "thinking"),
    ("missing max_tokens", MESSAGES, ant(max_tokens=...), "max_tokens"),
    ("max_tokens zero", MESSAGES, ant(max_tokens=0), "max_tokens"),
    ("max_tokens a string", MESSAGES, ant(max_tokens="10"), "max_tokens"),
    ("max_tokens a boolean", MESSAGES, ant(max_tokens=True), "max_tokens"),
    ("max_tokens fractional", MESSAGES, ant(max_tokens=10.5), "max_tokens"),
    ("negative temperature", MESSAGES, ant(temperature=-1), "temperature"),
    ("temperature a string", MESSAGES, ant(temperature="hot"), "temperature"),
    ("top_p above one", MESSAGES, ant(top_p=5), "top_p"),
    ("top_k negative", MESSAGES, ant(top_k=-3), "top_k"),
    ("stop_sequences a number", MESSAGES, ant(stop_sequences=5), "stop_sequences"),
    ("stop_sequences of numbers", MESSAGES, ant(stop_sequences=[1, 2]), "stop_sequences"),
    ("thinking a string", MESSAGES, ant(thinking="yes"), "thinking"),
    ("thinking type unknown", MESSAGES, ant(thinking={"type": "maybe"}), "thinking.type"),
    ("thinking budget negative", MESSAGES, ant(thinking={"type": "enabled", "budget_tokens": -5}), "budget_tokens"),
    ("thinking budget a string", MESSAGES, ant(thinking={"type": "enabled", "budget_tokens": "lots"}),
     "budget_tokens"),
    ("tools an object", MESSAGES, ant(tools={"name": "Bash"}), "tools"),
    ("tool without name", MESSAGES, ant(tools=[{"input_schema": {"type": "object"}}]), "name"),
    ("tool schema a string", MESSAGES, ant(tools=[{"name": "Bash", "input_schema": "object"}]), "input_schema"),
    ("duplicate tool names", MESSAGES, ant(tools=[{"name": "A"}, {"name": "A"}]), "duplicate"),
    ("tool_choice unknown", MESSAGES, ant(tool_choice={"type": "sometimes"}), "tool_choice"),
    ("tool_choice tool without name", MESSAGES, ant(tool_choice={"type": "tool"}), "tool_choice.name"),
    ("tool_choice tool undeclared", MESSAGES, ant(tool_choice={"type": "tool", "name": "Nope"}), "tool_choice"),
    ("tool_choice any without tools", MESSAGES, ant(tool_choice={"type": "any"}), "tool_choice"),
    ("output_config.format json_object", MESSAGES, ant(output_config={"format": {"type": "json_object"}}),
     "output_config.format.type"),
    ("output_config.format schema uncompilable", MESSAGES, ant(output_config={"format": {
        "type": "json_schema", "schema": {"$ref": "http://example.com/x"}}}), "output_config.format.schema"),
    ("system a number", MESSAGES, ant(system=5), "system"),
    ("system block a string", MESSAGES, ant(system=["be nice"]), "system[0]"),
    ("stream a string", MESSAGES, ant(stream="yes"), "stream"),
    ("document of pdf", MESSAGES, ant(messages=[{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "AA"}}]}]),
     "document"),
    # count_tokens
    ("count: missing messages", COUNT, {"model": "m"}, "messages"),
    ("count: unknown role", COUNT, {"model": "m", "messages": [{"role": "bot", "content": "x"}]}, "role"),
    ("count: missing model", COUNT, {"messages": USER}, "model"),
    ("count: thinking bad", COUNT, {"model": "m", "messages": USER, "thinking": {"type": 1}}, "thinking"),
    # Chat Completions
    ("chat: missing model", CHAT, chat(model=...), "model"),
    ("chat: missing messages", CHAT, chat(messages=...), "messages"),
    ("chat: empty messages", CHAT, chat(messages=[]), "messages"),
    ("chat: unknown role", CHAT, chat(messages=[{"role": "narrator", "content": "x"}]), "role"),
    ("chat: content an object", CHAT, chat(messages=[{"role": "user", "content": {"text": "x"}}]), "content"),
    ("chat: content part unknown", CHAT, chat(messages=[{"role": "user", "content": [{"type": "audio"}]}]),
     "content[0]"),
    ("chat: image part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), "image"),
    ("chat: tool_calls an object", CHAT, chat(messages=[USER[0], {"role": "assistant", "tool_calls": {"id": "c"}}]),
     "tool_calls"),
    ("chat: bad arguments json", CHAT, chat(messages=[USER[0], {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]), "arguments"),
    ("chat: n=2", CHAT, chat(n=2), "n"),
    # Output control (server/control.py): the same refusals on every API that has the option.
    ("chat: top_logprobs without logprobs", CHAT, chat(top_logprobs=2), "top_logprobs"),
    ("chat: top_logprobs 50", CHAT, chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    ("chat: presence penalty 5", CHAT, chat(presence_penalty=5), "presence_penalty"),
    ("chat: repetition penalty 0", CHAT, chat(repetition_penalty=0), "repetition_penalty"),
    ("chat: response_format yaml", CHAT, chat(response_format={"type": "yaml"}), "response_format.type"),
    ("chat: json_schema missing", CHAT, chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
    ("chat: schema with an unknown type", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"d": {"type": "date"}}}}}),
     "response_format.json_schema.schema"),
    ("chat: tool_choice names an undeclared tool", CHAT, chat(tool_choice={"type": "function", "function": {"name": "Nope"}}),
     "tool_choice"),
    ("chat: tool_choice required without tools", CHAT, chat(tool_choice="required"), "tool_choice"),
    ("chat: stop numbers", CHAT, chat(stop=[1, 2]), "stop"),
    ("chat: negative max_tokens", CHAT, chat(max_tokens=-1), "max_tokens"),
    ("chat: max_completion_tokens zero", CHAT, chat(max_completion_tokens=0), "max_completion_tokens"),
    ("chat: temperature 3", CHAT, chat(temperature=3), "temperature"),
    ("chat: top_k a string", CHAT, chat(top_k="a"), "top_k"),
    ("chat: min_p above one", CHAT, chat(min_p=2), "min_p"),
    ("chat: seed a float", CHAT, chat(seed=1.5), "seed"),
    ("chat: stream_options a string", CHAT, chat(stream_options="x"), "stream_options"),
    ("chat: tool without function", CHAT, chat(tools=[{"type": "function"}]), "function"),
    ("chat: tool_choice unknown", CHAT, chat(tool_choice="maybe"), "tool_choice"),
    ("chat: enable_thinking a string", CHAT, chat(chat_template_kwargs={"enable_thinking": "yes"}),
     "enable_thinking"),
    ("chat: logit_bias", CHAT, chat(logit_bias={"50": 10}), "logit_bias"),
    # Completions
    ("cmpl: missing prompt", COMPLETIONS, cmpl(prompt=...), "prompt"),
    ("cmpl: prompt a number", COMPLETIONS, cmpl(prompt=5), "prompt"),
    ("cmpl: prompt of floats", COMPLETIONS, cmpl(prompt=[1.5, 2.5]), "prompt"),
    ("cmpl: negative token id", COMPLETIONS, cmpl(prompt=[-1]), "prompt"),
    ("cmpl: token id past the vocabulary", COMPLETIONS, cmpl(prompt=[10**9]), "prompt"),
    ("cmpl: two prompts", COMPLETIONS, cmpl(prompt=["a", "b"]), "prompt"),
    ("cmpl: empty prompt list", COMPLETIONS, cmpl(prompt=[]), "prompt"),
    ("cmpl: suffix", COMPLETIONS, cmpl(suffix="end"), "suffix"),
    ("cmpl: logprobs 9", COMPLETIONS, cmpl(logprobs=9), "logprobs"),
    ("cmpl: frequency penalty 3", COMPLETIONS, cmpl(frequency_penalty=3), "frequency_penalty"),
    ("cmpl: response_format", COMPLETIONS, cmpl(response_format={"type": "json_object"}), "response_format"),
    ("cmpl: best_of", COMPLETIONS, cmpl(best_of=3), "best_of"),
    ("cmpl: echo a string", COMPLETIONS, cmpl(echo="yes"), "echo"),
    ("cmpl: max_tokens zero", COMPLETIONS, cmpl(max_tokens=0), "max_tokens"),
    ("cmpl: empty prompt", COMPLETIONS, cmpl(prompt=""), "empty"),
    # Responses
    ("resp: missing model", RESPONSES, resp(model=...), "model"),
    ("resp: top_logprobs 50", RESPONSES, resp(top_logprobs=50), "top_logprobs"),
    ("resp: presence penalty 5", RESPONSES, resp(presence_penalty=5), "presence_penalty"),
    ("resp: text.format yaml", RESPONSES, resp(text={"format": {"type": "yaml"}}), "text.format.type"),
    ("resp: schema with an unknown type", RESPONSES, resp(text={"format": {"type": "json_schema", "name": "x",
     "schema": {"type": "object", "properties": {"d": {"type": "date"}}}}}), "text.format.schema"),
    ("resp: tool_choice undeclared", RESPONSES, resp(tool_choice={"type": "function", "name": "Nope"}), "tool_choice"),
    ("resp: missing input", RESPONSES, resp(input=...), "input"),
    ("resp: input a number", RESPONSES, resp(input=5), "input"),
    ("resp: empty input list", RESPONSES, resp(input=[]), "input"),
    ("resp: item not an object", RESPONSES, resp(input=["hi"]), "input[0]"),
    ("resp: unknown message role", RESPONSES, resp(input=[{"type": "message", "role": "oracle", "content": "x"}]),
     "role"),
    ("resp: previous_response_id", RESPONSES, resp(previous_response_id="resp_1"), "previous_response_id"),
    ("resp: background", RESPONSES, resp(background=True), "background"),
    ("resp: bad arguments json", RESPONSES, resp(input=[
        {"type": "message", "role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{nope"}]), "arguments"),
    ("resp: input_image", RESPONSES, resp(input=[{"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]), "image"),
    ("resp: max_output_tokens zero", RESPONSES, resp(max_output_tokens=0), "max_output_tokens"),
    ("resp: tools an object", RESPONSES, resp(tools={"type": "function"}), "tools"),
    ("resp: namespace tools not a list", RESPONSES, resp(tools=[{"type": "namespace", "name": "ns",
                                                                 "tools": "x"}]), "tools"),
    ("resp: instructions a number", RESPONSES, resp(instructions=5), "instructions"),
    ("resp: reasoning effort a number", RESPONSES, resp(reasoning={"effort": 3}), "effort"),
    ("resp: temperature negative", RESPONSES, resp(temperature=-0.5), "temperature"),
]


def _id(case):
    return f"{case[1]}:{case[0]}"


@pytest.fixture(scope="module")
def live(tokenizer):
    from server_harness import ServerFactory

    factory = ServerFactory(tokenizer)
    server = factory(lambda p: "ok", default_thinking=False)
    yield server
    factory.close()


def test_corpus_is_large_enough():
    assert len(CASES) >= 100


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_malformed_request_gets_4xx_in_api_shape(live, case):
    name, path, body, mention = case
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, headers, raw = http_request(live.port, "POST", path, payload,
                                        {"Content-Type": "application/json"})
    assert 400 <= status < 500, (status, raw[:300])
    err = json.loads(raw)
    if path.startswith("/v1/messages"):
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        message = err["error"]["message"]
    else:
        assert set(err) == {"error"} and err["error"]["type"] == "invalid_request_error"
        message = err["error"]["message"]
    assert message
    if mention:
        assert mention.lower() in message.lower(), message


def test_content_encoding_refused_in_shape(live):
    status, _, raw = http_request(live.port, "POST", MESSAGES, b"\x1f\x8b\x08\x00",
                                  {"Content-Encoding": "gzip"})
    assert status == 415 and json.loads(raw)["type"] == "error"


@pytest.mark.parametrize("path", [MESSAGES, CHAT, RESPONSES])
def test_oversized_body_is_413_in_api_shape(tokenizer, path):
    from server_harness import ServerFactory
    from server_harness import fast_limits

    factory = ServerFactory(tokenizer)
    try:
        live = factory(lambda p: "ok", limits=fast_limits(max_body_bytes=10_000))
        body = json.dumps(ant(messages=[{"role": "user", "content": "x" * 20_000}])).encode()
        status, _, raw = http_request(live.port, "POST", path, body)
        assert status == 413
        err = json.loads(raw)
        if path == MESSAGES:
            assert err["error"]["type"] == "request_too_large"
        else:
            assert "limit" in err["error"]["message"]
        assert http_request(live.port, "GET", "/health")[0] == 200
    finally:
        factory.close()


def test_server_still_answers_after_the_corpus(live):
    status, _, raw = http_request(live.port, "POST", CHAT, chat())
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == "ok"
