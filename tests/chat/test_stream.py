"""The streaming splitter: routing, streaming, the call grammar and its edge cases."""

from __future__ import annotations

import json

import pytest

from q27py.chat.stream import (
    ReasoningDelta,
    StreamSplitter,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    parse_output,
)

TOOLS = {
    "bash": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}, "background": {"type": "boolean"}},
        "required": ["command"],
    },
    "read_file": {
        "type": "object",
        "properties": {"path": {"type": "string"}, "offset": {"type": "integer"}},
        "required": ["path"],
    },
    "write_todos": {
        "type": "object",
        "properties": {"todos": {"type": "array"}, "meta": {"type": "object"}, "note": {"type": ["string", "null"]}},
        "required": ["todos"],
    },
}


def xml_call(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def parse(text, tools=TOOLS, in_reasoning=False):
    return parse_output(text, tools, in_reasoning, make_id=lambda i: f"call_{i}")


def calls_of(parsed):
    return [(c["name"], c["arguments"]) for c in parsed.tool_calls]


def feed_chars(text, tools=TOOLS, **kw):
    splitter = StreamSplitter(tools, make_id=lambda i: f"call_{i}", **kw)
    steps = [splitter.feed(c) for c in text]
    return splitter, steps


# --- routing -------------------------------------------------------------------------


def test_plain_text_is_text():
    p = parse("Hello, world.\nSecond line.")
    assert (p.text, p.reasoning, p.tool_calls) == ("Hello, world.\nSecond line.", "", [])


def test_prompt_opened_think_block():
    p = parse("Let me think.\nMore.\n</think>\n\nThe answer is 4.", in_reasoning=True)
    assert p.reasoning == "Let me think.\nMore."
    assert p.text == "The answer is 4."


def test_prompt_closed_think_block_keeps_everything_visible():
    p = parse("The answer is 4.\n</think> is just text here", in_reasoning=False)
    assert p.reasoning == ""
    assert p.text == "The answer is 4.\n</think> is just text here"


def test_model_reopening_think_at_start():
    p = parse("<think>\nhmm\n</think>\n\nDone.")
    assert (p.reasoning, p.text) == ("hmm", "Done.")


def test_think_later_in_text_is_text():
    p = parse("Done.\n<think>\nnot reasoning")
    assert p.reasoning == ""
    assert p.text == "Done.\n<think>\nnot reasoning"


def test_reasoning_never_ending_stays_reasoning():
    p = parse("thinking forever", in_reasoning=True)
    assert (p.reasoning, p.text) == ("thinking forever", "")


# --- calls ---------------------------------------------------------------------------


def test_canonical_xml_call_with_typed_values():
    text = "Running it.\n\n" + xml_call("bash", command="ls -la", timeout="30", background="true")
    p = parse(text)
    assert p.text == "Running it."
    assert calls_of(p) == [("bash", {"command": "ls -la", "timeout": 30, "background": True})]
    assert p.tool_calls[0]["id"] == "call_0"


def test_qwen35_python_literals():
    """Qwen3.5's template renders non-string values with Python's str()."""
    text = xml_call("bash", command="x", background="False") + "\n" + xml_call("write_todos", todos="[]", note="None")
    assert calls_of(parse(text)) == [
        ("bash", {"command": "x", "background": False}),
        ("write_todos", {"todos": [], "note": None}),
    ]


def test_strings_stay_raw_even_when_they_look_like_json():
    text = xml_call("bash", command='{"a": 1}') + xml_call("read_file", path="123", offset="7")
    assert calls_of(parse(text)) == [
        ("bash", {"command": '{"a": 1}'}),
        ("read_file", {"path": "123", "offset": 7}),
    ]


def test_value_not_matching_its_type_is_kept_as_string():
    assert calls_of(parse(xml_call("read_file", path="a", offset="ten"))) == [
        ("read_file", {"path": "a", "offset": "ten"})
    ]


def test_unknown_parameters_and_tools_guess_json_then_string():
    text = xml_call("mystery", a="5", b="hello", c='{"k": [1]}', d="NaN")
    assert calls_of(parse(text)) == [("mystery", {"a": 5, "b": "hello", "c": {"k": [1]}, "d": "NaN"})]


def test_objects_and_arrays():
    todos = [{"id": 1, "text": "a\nb", "done": False}]
    text = xml_call("write_todos", todos=json.dumps(todos), meta='{"x": null}')
    assert calls_of(parse(text)) == [("write_todos", {"todos": todos, "meta": {"x": None}})]


def test_several_calls_and_several_functions_in_one_wrapper():
    one = xml_call("bash", command="a")
    two = (
        "<tool_call>\n<function=read_file>\n<parameter=path>\nx\n</parameter>\n</function>\n"
        "<function=bash>\n<parameter=command>\nb\n</parameter>\n</function>\n</tool_call>"
    )
    p = parse(one + "\n" + two)
    assert calls_of(p) == [("bash", {"command": "a"}), ("read_file", {"path": "x"}), ("bash", {"command": "b"})]
    assert [c["id"] for c in p.tool_calls] == ["call_0", "call_1", "call_2"]
    assert p.text == ""


def test_call_inside_reasoning_is_a_call_and_reasoning_continues():
    text = "I need the file.\n" + xml_call("read_file", path="/a") + "\nNow decide.\n</think>\n\nDone."
    p = parse(text, in_reasoning=True)
    assert calls_of(p) == [("read_file", {"path": "/a"})]
    assert p.reasoning == "I need the file.\nNow decide."
    assert p.text == "Done."


def test_literal_parameter_closer_inside_value():
    value = "<a>\n</parameter>\n</b>\nend </parameter> here"
    p = parse(xml_call("bash", command=value))
    assert calls_of(p) == [("bash", {"command": value})]


def test_closer_without_newlines_and_empty_values():
    text = (
        "<tool_call>\n<function=bash>\n<parameter=command>ls</parameter>\n"
        "<parameter=timeout>\n\n</parameter></function></tool_call>"
    )
    assert calls_of(parse(text)) == [("bash", {"command": "ls", "timeout": ""})]


def test_value_keeps_inner_newlines_but_not_the_template_ones():
    value = "\nline1\n\nline2\n"
    assert calls_of(parse(xml_call("bash", command=value))) == [("bash", {"command": value})]


def test_whitespace_only_text_around_calls_is_dropped():
    text = "\n\n" + xml_call("bash", command="a") + "\n\n  \n" + xml_call("bash", command="b") + "\n\n"
    p = parse(text)
    assert p.text == ""
    assert len(p.tool_calls) == 2


def test_text_on_both_sides_of_a_call_keeps_one_separator():
    p = parse("Before.\n\n" + xml_call("bash", command="a") + "\n\nAfter.")
    assert p.text == "Before.\n\nAfter."


def test_json_dialect():
    text = 'Sure.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "/x", "offset": 3}}\n</tool_call>'
    p = parse(text)
    assert p.text == "Sure."
    assert calls_of(p) == [("read_file", {"path": "/x", "offset": 3})]


def test_json_escapes_for_surrogates_in_drift_repairs():
    text = '<tool_call>\n{"name": "bash", "arguments": {"command": "\\ud83d\\ude00 \\ud800 \n"}}\n</tool_call>'
    assert calls_of(parse(text)) == [("bash", {"command": "\U0001F600 \ufffd \n"})]


def test_canonical_forms_accept_unregistered_names():
    """The explicit forms are calls whatever the name: the client can answer 'no such
    tool', which keeps the agent going; a text turn would end it."""
    p = parse(xml_call("other", x="1") + '\n<tool_call>\n{"name": "other2", "arguments": {}}\n</tool_call>', tools=None)
    assert calls_of(p) == [("other", {"x": 1}), ("other2", {})]


def test_name_case_resolves_to_the_registered_tool():
    assert calls_of(parse(xml_call("Bash", command="a"))) == [("bash", {"command": "a"})]


# --- prose that talks about calls ----------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Use the <tool_call> tag to call tools.",
        "Mid-line <tool_call><function=bash><parameter=command>ls</parameter></function></tool_call> is prose.",
        'A JSON string: {"example": "<tool_call>\\n<function=bash>\\n</function>\\n</tool_call>"}',
        "Example:\n```xml\n" + xml_call("bash", command="ls") + "\n```\nThat is the format.",
        "Inline `<tool_call>\n<function=bash>` code spanning a line.",
        "<tool_call> is the opening tag.",
        '```json\n{"name": "bash", "arguments": {"command": "ls"}}\n```',
        "<functionality> matters\n<parameters are things\n<name>nobody</name>",
    ],
)
def test_prose_mentioning_calls_stays_text(text):
    p = parse(text)
    assert p.tool_calls == []
    assert p.text == text.strip()


def test_code_fence_closes_and_calls_count_again():
    text = "```\n<tool_call>\n```\n" + xml_call("bash", command="a")
    p = parse(text)
    assert p.text == "```\n<tool_call>\n```"
    assert calls_of(p) == [("bash", {"command": "a"})]


def test_mid_line_wrapper_followed_by_function_is_a_call():
    p = parse("Let me run it." + xml_call("bash", command="ls"))
    assert p.text == "Let me run it."
    assert calls_of(p) == [("bash", {"command": "ls"})]


def test_bare_parameter_tag_in_reasoning_does_not_swallow_the_answer():
    text = "I will pass\n<parameter=command> to bash, then\n</think>\n\nThe answer."
    p = parse(text, in_reasoning=True)
    assert p.tool_calls == []
    assert p.reasoning == "I will pass\n<parameter=command> to bash, then"
    assert p.text == "The answer."


def test_bare_json_in_reasoning_is_reasoning():
    text = '{"name": "bash", "arguments": {"command": "ls"}}\n</think>\n\nok'
    p = parse(text, in_reasoning=True)
    assert p.tool_calls == []
    assert p.reasoning == '{"name": "bash", "arguments": {"command": "ls"}}'


# --- truncation ----------------------------------------------------------------------


def test_truncated_xml_call_still_ends_with_valid_json():
    p = parse("<tool_call>\n<function=bash>\n<parameter=command>\nls -l")
    assert calls_of(p) == [("bash", {"command": "ls -l"})]
    p = parse("<tool_call>\n<function=bash>\n<parameter=timeout>\n3")
    assert calls_of(p) == [("bash", {"timeout": 3})]
    p = parse("<tool_call>\n<function=bash>\n<parameter=comm")
    assert calls_of(p) == [("bash", {})]


def test_truncated_wrapper_is_suppressed_not_shown():
    p = parse("Let me check.\n<tool_call>\n")
    assert (p.text, p.tool_calls) == ("Let me check.", [])
    p = parse("Let me check.\n<tool_ca")
    assert p.text == "Let me check.\n<tool_ca"


def test_garbage_inside_a_wrapper_stays_text():
    text = "<tool_call>\n<garbage attr>\nstuff\n</tool_call>"
    p = parse(text)
    assert p.tool_calls == []
    assert p.text == text


# --- streaming behaviour -------------------------------------------------------------


def test_string_values_stream_before_the_call_ends():
    text = xml_call("bash", command="echo " + "x" * 200)
    splitter, steps = feed_chars(text)
    cut = text.index("x" * 100) + 100
    so_far = [e for step in steps[:cut] for e in step]
    fragments = "".join(e.json_fragment for e in so_far if isinstance(e, ToolCallArgsDelta))
    assert fragments.startswith('{"command": "echo ' + "x" * 90)
    assert not any(isinstance(e, ToolCallEnd) for e in so_far)
    assert isinstance(so_far[0], ToolCallStart) and so_far[0].name == "bash"


def test_only_a_possible_marker_is_held_back():
    splitter = StreamSplitter(TOOLS)
    events = splitter.feed("Hello <tool")
    assert events == [TextDelta("Hello")]
    events = splitter.feed("s are great")
    assert events == [TextDelta(" <tools are great")]
    splitter = StreamSplitter(TOOLS, in_reasoning=True)
    assert splitter.feed("step one\n</thi") == [ReasoningDelta("step one")]
    assert splitter.feed("nk>\n\nanswer") == [TextDelta("answer")]


def test_non_string_values_are_emitted_whole_when_complete():
    text = xml_call("bash", timeout="12345")
    splitter, steps = feed_chars(text)
    fragments = [e.json_fragment for step in steps for e in step if isinstance(e, ToolCallArgsDelta)]
    assert "12345" in fragments


def test_args_fragments_concatenate_to_the_final_json():
    text = "x\n" + xml_call("bash", command='quote " backslash \\ tab \t nl\nend', timeout="1.5")
    splitter, steps = feed_chars(text)
    events = [e for step in steps for e in step] + splitter.finish()
    fragments = "".join(e.json_fragment for e in events if isinstance(e, ToolCallArgsDelta))
    (end,) = [e for e in events if isinstance(e, ToolCallEnd)]
    assert fragments == end.arguments_json
    assert json.loads(fragments) == {"command": 'quote " backslash \\ tab \t nl\nend', "timeout": 1.5}


def test_feed_after_finish_is_an_error():
    splitter = StreamSplitter()
    splitter.finish()
    with pytest.raises(RuntimeError):
        splitter.feed("x")


def test_unclosed_opener_name_does_not_hold_forever():
    splitter = StreamSplitter(TOOLS)
    text = "<function=" + "a" * 400
    events = splitter.feed(text)
    assert "".join(e.text for e in events) == text
