"""The wire readers for output control: one reading for all APIs, 400s naming the field."""

import pytest

from q27py.chat.conversation import ToolSpec
from q27py.chat.requests import ToolChoice
from q27py.server import control
from q27py.server.errors import ApiError

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}


def test_three_apis_read_the_same_format():
    a = control.openai_format({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA,
                                                                                           "strict": True}}})
    b = control.responses_format({"text": {"format": {"type": "json_schema", "name": "t", "schema": SCHEMA}}})
    c = control.anthropic_format({"output_config": {"effort": "low", "format": {"type": "json_schema", "schema": SCHEMA}}})
    assert (a.kind, a.schema) == (b.kind, b.schema) == (c.kind, c.schema) == ("json_schema", SCHEMA)
    assert control.openai_format({"response_format": {"type": "json_object"}}).kind == "json_object"
    assert control.responses_format({"text": {"format": {"type": "json_object"}}}).kind == "json_object"
    assert control.openai_format({"response_format": {"type": "text"}}) is None
    assert control.anthropic_format({"output_config": {"effort": "high"}}) is None


@pytest.mark.parametrize("reader,body,param", [
    (control.openai_format, {"response_format": {"type": "yaml"}}, "response_format.type"),
    (control.openai_format, {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (control.openai_format, {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
     "response_format.json_schema.schema"),
    (control.responses_format, {"text": {"format": {"type": "json_schema", "schema": SCHEMA, "strict": "yes"}}},
     "text.format.strict"),
    (control.anthropic_format, {"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type"),
])
def test_bad_formats_are_400s_naming_the_field(reader, body, param):
    with pytest.raises(ApiError) as e:
        reader(body)
    assert e.value.status == 400 and e.value.param == param


def test_logprobs_readers():
    assert control.chat_logprobs({}) is None
    assert control.chat_logprobs({"logprobs": True}) == 0
    assert control.chat_logprobs({"logprobs": True, "top_logprobs": 5}) == 5
    assert control.completions_logprobs({"logprobs": 3}) == 3
    assert control.responses_logprobs({"top_logprobs": 2}) == 2
    assert control.responses_logprobs({"include": ["message.output_text.logprobs"]}) == 0
    assert control.responses_logprobs({"include": ["reasoning.encrypted_content"]}) is None
    for reader, body, param in ((control.chat_logprobs, {"top_logprobs": 2}, "top_logprobs"),
                                (control.chat_logprobs, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                (control.completions_logprobs, {"logprobs": 6}, "logprobs"),
                                (control.chat_logprobs, {"logprobs": "yes"}, "logprobs")):
        with pytest.raises(ApiError) as e:
            reader(body)
        assert e.value.param == param


def test_penalties_reader():
    p = control.penalties({"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2})
    assert (p.presence, p.frequency, p.repetition) == (0.5, -1.0, 1.2)
    for body, param in (({"presence_penalty": 3}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
                        ({"frequency_penalty": "x"}, "frequency_penalty")):
        with pytest.raises(ApiError) as e:
            control.penalties(body)
        assert e.value.param == param


TOOLS = [ToolSpec("Bash", "", {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}),
         ToolSpec("Read", "", {"type": "object", "properties": {"path": {"type": "string"}}})]


def test_constraint_for_tool_choice_and_formats():
    spec = control.constraint_for(ToolChoice("required"), TOOLS, None, starts_in_reasoning=True)
    assert spec.kind == "tool_calls" and set(spec.tools) == {"Bash", "Read"} and spec.after_think
    spec = control.constraint_for(ToolChoice("tool", "Read"), TOOLS, None, one_call=True)
    assert spec.names == ("Read",) and spec.max_calls == 1
    fmt = control.ResponseFormat("json_schema", SCHEMA, "response_format.json_schema.schema")
    assert control.constraint_for(ToolChoice(), TOOLS, fmt).kind == "json_schema"
    assert control.constraint_for(ToolChoice("required"), TOOLS, fmt).kind == "tool_calls"  # the forced call wins
    assert control.constraint_for(ToolChoice(), TOOLS, None) is None
    for choice, tools, param in ((ToolChoice("tool", "Nope"), TOOLS, "tool_choice"), (ToolChoice("required"), [], "tool_choice")):
        with pytest.raises(ApiError) as e:
            control.constraint_for(choice, tools, None)
        assert e.value.param == param
    bad = control.ResponseFormat("json_schema", {"type": "object", "properties": {"x": {"type": "date"}}}, "text.format.schema")
    with pytest.raises(ApiError) as e:
        control.constraint_for(ToolChoice(), [], bad)
    assert e.value.param == "text.format.schema" and "properties.x.type" in str(e.value)
