"""The shared call grammar: openers, where values end, schema typing, tool names."""

from __future__ import annotations

import json

import pytest

from q27py.chat.toolcall import (
    Match,
    ToolSet,
    convert_value,
    encode_string_fragment,
    match_value_end,
    parse_opener,
    schema_types,
)

S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


@pytest.mark.parametrize(
    "raw,prop,expected",
    [
        (" 42 ", I, 42),
        ("42.0", I, 42),
        ("4.5", I, "4.5"),  # does not fit: kept raw for the client to reject
        ("4.5", N, 4.5),
        ("-1e3", N, -1000.0),
        ("true", B, True),
        ("False", B, False),  # Qwen3.5's template writes Python's str()
        ("yes", B, "yes"),
        ("null", {"type": "null"}, None),
        ("None", {"type": ["string", "null"]}, None),
        ("hello", {"type": ["string", "null"]}, "hello"),
        ("12", {"type": ["string", "integer"]}, 12),
        ('{"a": [1, 2]}', {"type": "object"}, {"a": [1, 2]}),
        ("[1, 2", {"type": "array"}, "[1, 2"),
        ('{"t": "a\nb"}', {"type": "object"}, {"t": "a\nb"}),  # raw newline inside a JSON string
        ("  spaced  ", S, "  spaced  "),
        ("42", S, "42"),
        ("42", None, 42),
        ("hello", None, "hello"),
        ("[1]", {"description": "no type"}, [1]),
        ("7", {"anyOf": [I, {"type": "null"}]}, 7),
        ("b", {"enum": ["a", "b"]}, "b"),
        ("2", {"enum": [1, 2]}, 2),
        ("NaN", N, "NaN"),
        ("Infinity", None, "Infinity"),
        ("1e999", N, "1e999"),
        ("1" * 5000, I, "1" * 5000),
        ("[" * 100000, {"type": "array"}, "[" * 100000),
        ("__import__('os')", None, "__import__('os')"),
    ],
)
def test_convert_value(raw, prop, expected):
    value = convert_value(raw, prop)
    assert value == expected and type(value) is type(expected)
    json.dumps(value, allow_nan=False)


def test_surrogate_escapes_become_encodable_text():
    assert convert_value('["\\ud83d\\ude00", "\\ud800x"]', None) == ["\U0001F600", "\ufffdx"]


def test_schema_types():
    assert schema_types({"type": ["integer", "null"]}) == {"integer", "null"}
    assert schema_types({"anyOf": [{"type": "string"}, {"type": "array"}]}) == {"string", "array"}
    assert schema_types({"anyOf": [{"type": "string"}, {}]}) is None
    assert schema_types({"enum": [True, None]}) == {"boolean", "null"}
    assert schema_types({}) is None and schema_types(None) is None


@pytest.mark.parametrize(
    "text,name,canonical",
    [
        ("<function=bash>", "bash", True),
        ("<function = bash >", "bash", False),
        ('<function="bash">', "bash", False),
        ("<function name=\"bash\">", "bash", False),
        ("<function name='bash'>", "bash", False),
        ("<function name=bash>", "bash", False),
        ("<function=\nbash\n>", "bash", False),
        ("<function>", None, False),
    ],
)
def test_function_opener_spellings(text, name, canonical):
    m, op = parse_opener(text + "rest", 0, "function", eof=False)
    assert m is Match.YES
    assert (op.name, op.canonical, op.end) == (name, canonical, len(text))


def test_opener_waits_and_refuses():
    for partial in ("<", "<func", "<function", "<function=", "<function=ba", "<function name", '<function="ba'):
        assert parse_opener(partial, 0, "function", eof=False)[0] is Match.MORE, partial
        assert parse_opener(partial, 0, "function", eof=True)[0] is Match.NO, partial
    for bad in ("<functions>", "<function=a b>", "<function=>", "<function=a<", "<function=" + "x" * 300):
        assert parse_opener(bad, 0, "function", eof=False)[0] is Match.NO, bad


def test_parameter_opener_missing_closer_at_newline():
    m, op = parse_opener("<parameter=command\nls\n", 0, "parameter", eof=False)
    assert m is Match.YES and op.unclosed and op.name == "command"
    assert op.end == len("<parameter=command")
    m, _ = parse_opener("<function=bash\nx", 0, "function", eof=False)
    assert m is Match.NO


@pytest.mark.parametrize(
    "text,result",
    [
        ("\n</parameter>\n<parameter=x>", Match.YES),
        ("</parameter></function>", Match.YES),
        ("\n</parameter>\n</tool_call>", Match.YES),
        ("\n</parameter> and more", Match.NO),
        ("\n</parameter>\n", Match.MORE),
        ("\n</param", Match.MORE),
        ("\n</parameter>\n<para", Match.MORE),
        ("\n</function>\n</tool_call>", Match.YES),
        ("\n</function> text", Match.NO),
        ("<b>", Match.NO),
    ],
)
def test_where_values_end(text, result):
    assert match_value_end(text, 0, eof=False)[0] is result


def test_value_end_at_the_end_of_output():
    assert match_value_end("\n</parameter>\n  ", 0, eof=True)[0] is Match.YES
    assert match_value_end("\n</param", 0, eof=True)[0] is Match.NO
    m, end = match_value_end("x\n</function>", 1, eof=True)
    assert m is Match.YES and end.closes_function and end.close_end == len("x\n</function>")


def test_string_fragments_concatenate():
    text = 'a"b\\c\nd\te\x01é😀</x>'
    for cut in range(len(text) + 1):
        assert encode_string_fragment(text[:cut]) + encode_string_fragment(text[cut:]) == json.dumps(
            text, ensure_ascii=False
        )[1:-1]


TOOLS = ToolSet(
    {
        "Read": {"properties": {"file_path": S, "limit": I}, "required": ["file_path"]},
        "Write": {"properties": {"file_path": S, "content": S}, "required": ["file_path", "content"]},
        "Glob": {"properties": {"pattern": S, "path": S}, "required": ["pattern"]},
        "Grep": {"properties": {"pattern": S, "path": S, "glob": S}, "required": ["pattern"]},
    }
)


def test_resolve_names():
    assert TOOLS.resolve("Read") == "Read"
    assert TOOLS.resolve(" read ") == "Read"
    assert TOOLS.resolve("Deploy") is None
    twins = ToolSet({"bash": {}, "Bash": {}})
    assert twins.resolve("BASH") is None
    assert twins.resolve("bash") == "bash"


def test_infer_from_argument_keys():
    assert TOOLS.infer(["file_path"]) == "Read"
    assert TOOLS.infer(["file_path", "content"]) == "Write"
    assert TOOLS.infer(["file_path", "limit"]) == "Read"
    assert TOOLS.infer(["pattern", "glob"]) == "Grep"
    assert TOOLS.infer(["pattern"]) is None  # Glob and Grep tie
    assert TOOLS.infer(["pattern", "path"]) is None
    assert TOOLS.infer([]) is None
    assert TOOLS.infer(["unknown"]) is None
