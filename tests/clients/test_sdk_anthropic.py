"""The official `anthropic` Python SDK against a live server: streaming and not, tools, thinking, count_tokens."""

from __future__ import annotations

import pytest

anthropic = pytest.importorskip("anthropic")

TOOL = {"name": "get_weather", "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                         "required": ["city"]}}
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def script(prompt: str) -> str:
    thinking = prompt.endswith("<think>\n")
    if "<tool_response>" in prompt:
        answer = "Sunny in Paris for 3 days."
        return ("The tool answered.\n</think>\n\n" + answer) if thinking else answer
    if "get_weather" in prompt:
        return ("The user wants weather.\n</think>\n\n" + CALL) if thinking else CALL
    return ("Just greet.\n</think>\n\nHello there!") if thinking else "Hello there!"


@pytest.fixture
def client(make_server):
    live = make_server(script, keys=("sk-test",), default_thinking=False)
    c = anthropic.Anthropic(base_url=live.base_url, api_key="sk-test", max_retries=0, timeout=30)
    c.live = live
    return c


def test_create_text_and_usage(client):
    msg = client.messages.create(model="claude-sonnet-x", max_tokens=50, messages=[{"role": "user", "content": "hi"}])
    assert msg.content[0].type == "text" and msg.content[0].text == "Hello there!"
    assert msg.stop_reason == "end_turn" and msg.model == "claude-sonnet-x"
    assert msg.usage.input_tokens == len(client.live.engine.requests[-1].prompt_ids)
    assert msg.usage.output_tokens > 0


def test_tool_round_trip_streaming_with_thinking(client):
    messages = [{"role": "user", "content": "weather in Paris?"}]
    with client.messages.stream(model="m", max_tokens=300, messages=messages, tools=[TOOL],
                                thinking={"type": "enabled", "budget_tokens": 100}) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == "The user wants weather." and final.content[0].signature
    use = final.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 3}
    assert final.stop_reason == "tool_use"

    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    with client.messages.stream(model="m", max_tokens=300, messages=messages, tools=[TOOL],
                                thinking={"type": "enabled", "budget_tokens": 100}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Sunny in Paris for 3 days."
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens == len(client.live.engine.requests[-1].prompt_ids)
    assert "<tool_response>\nsunny\n</tool_response>" in client.live.engine.prompts[-1]


def test_raw_stream_events(client):
    events = list(client.messages.create(model="m", max_tokens=100, stream=True, tools=[TOOL],
                                         messages=[{"role": "user", "content": "weather?"}]))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) and "Paris" in "".join(deltas)


def test_count_tokens_matches_create(client):
    kwargs = dict(model="m", messages=[{"role": "user", "content": "weather in Paris?"}], tools=[TOOL],
                  system="Be brief.")
    counted = client.messages.count_tokens(**kwargs)
    msg = client.messages.create(max_tokens=100, **kwargs)
    assert counted.input_tokens == msg.usage.input_tokens


def test_errors_map_to_sdk_exceptions(client, make_server):
    bad_key = anthropic.Anthropic(base_url=client.live.base_url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad_key.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    small = make_server(script, max_context=200)
    c = anthropic.Anthropic(base_url=small.base_url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as info:
        c.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "word " * 300}])
    assert "prompt is too long" in str(info.value)
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model="m", max_tokens=5, messages=[{"role": "wizard", "content": "x"}])
