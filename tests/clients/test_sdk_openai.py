"""The official `openai` Python SDK against a live server: Chat Completions, Completions, Responses."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS}}
RESP_TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": PARAMS}
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def script(prompt: str) -> str:
    thinking = prompt.endswith("<think>\n")
    if "<tool_response>" in prompt:
        answer = "Sunny in Paris."
    elif "get_weather" in prompt:
        answer = CALL
    else:
        answer = "Hello there!"
    return ("Let me think.\n</think>\n\n" + answer) if thinking else answer


@pytest.fixture
def client(make_server):
    live = make_server(script, keys=("sk-test",), default_thinking=True)
    c = openai.OpenAI(base_url=live.base_url + "/v1", api_key="sk-test", max_retries=0, timeout=30)
    c.live = live
    return c


def test_models_list(client):
    assert [m.id for m in client.models.list()] == ["scripted-tiny"]


def test_chat_tool_round_trip(client):
    messages = [{"role": "user", "content": "weather in Paris?"}]
    resp = client.chat.completions.create(model="gpt-x", messages=messages, tools=[CHAT_TOOL])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert resp.usage.prompt_tokens == len(client.live.engine.requests[-1].prompt_ids)
    assert resp.usage.completion_tokens_details.reasoning_tokens > 0
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    resp = client.chat.completions.create(model="gpt-x", messages=messages, tools=[CHAT_TOOL])
    assert resp.choices[0].message.content == "Sunny in Paris." and resp.choices[0].finish_reason == "stop"


def test_chat_streaming_with_usage_and_reasoning(client):
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "weather?"}],
                                            tools=[CHAT_TOOL], stream=True, stream_options={"include_usage": True})
    args, reasoning, usage, finish = "", "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            for tc in choice.delta.tool_calls or []:
                args += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert json.loads(args) == {"city": "Paris", "days": 3}
    assert reasoning == "Let me think." and finish == "tool_calls"
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_stream_helper(client):
    with client.chat.completions.stream(model="m", messages=[{"role": "user", "content": "hi"}],
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}}) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "Hello there!"
    assert client.live.engine.prompts[-1].endswith("</think>\n\n")


def test_completions(client):
    resp = client.completions.create(model="m", prompt="Once upon", max_tokens=40)
    assert resp.choices[0].text == "Hello there!" and resp.usage.prompt_tokens == 2
    text = "".join(c.choices[0].text for c in client.completions.create(model="m", prompt="x", max_tokens=3,
                                                                           stream=True) if c.choices)
    assert len(client.live.engine.tokenizer.encode(text)) == 3


def test_responses_streaming_tool_call_and_follow_up(client):
    events = list(client.responses.create(model="m", input="weather in Paris?", tools=[RESP_TOOL], stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    final = events[-1].response
    kinds = [item.type for item in final.output]
    assert kinds == ["reasoning", "function_call"]
    call = final.output[1]
    assert json.loads(call.arguments) == {"city": "Paris", "days": 3}
    assert final.usage.input_tokens == len(client.live.engine.requests[-1].prompt_ids)
    assert final.usage.output_tokens_details.reasoning_tokens > 0

    follow = [{"role": "user", "content": "weather in Paris?"}, *[i.model_dump(exclude_none=True) for i in final.output],
              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    with client.responses.stream(model="m", input=follow, tools=[RESP_TOOL]) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        response = stream.get_final_response()
    assert text == "Sunny in Paris." and response.output_text == "Sunny in Paris."


def test_responses_non_streaming(client):
    resp = client.responses.create(model="m", input=[{"role": "developer", "content": "Be brief."},
                                                     {"role": "user", "content": "hi"}],
                                   reasoning={"effort": "none"})
    assert resp.status == "completed" and resp.output_text == "Hello there!"
    assert "Be brief." in client.live.engine.prompts[-1]


def test_errors_map_to_sdk_exceptions(client, make_server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="bad", max_retries=0).models.list()
    small = make_server(script, max_context=200)
    c = openai.OpenAI(base_url=small.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "w " * 400}])
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.create(model="m", input="w " * 400)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=3)
    assert info.value.param == "n"
