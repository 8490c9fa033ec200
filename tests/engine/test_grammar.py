"""Byte grammars: JSON Schema (the subset tools use), any JSON object, the Qwen XML call syntax.

Each schema of the corpus (tool_schemas.py) is checked both ways against an independent
validator: random valid instances, in several JSON spellings, are sentences; mutated documents
are sentences exactly when the validator says they are valid."""

import json
import random

import pytest

from q27py.chat.stream import parse_output
from q27py.chat.toolcall import schema_types
from q27py.engine.grammar import GrammarError, _json_types, json_grammar, tool_call_grammar
from tool_schemas import CORPUS, dumps_variants, generated_schema, generated_tool_schema, instance, valid

GENERATED = {f"gen{i}": generated_schema(random.Random(i)) for i in range(40)}


@pytest.mark.parametrize("name", sorted(CORPUS) + sorted(GENERATED))
def test_valid_instances_are_sentences(name):
    schema = {**CORPUS, **GENERATED}[name]
    g = json_grammar(schema)
    rng = random.Random(name)
    for _ in range(25):
        value = instance(rng, schema)
        assert valid(value, schema), "the test generator itself must make valid values"
        text = dumps_variants(value, rng)
        assert g.matches(text.encode()), text


MUTATIONS = [
    lambda v: {**v, "zz_extra": 1} if isinstance(v, dict) else v,
    lambda v: {k: x for i, (k, x) in enumerate(v.items()) if i} if isinstance(v, dict) and v else v,
    lambda v: {k: (1 if isinstance(x, str) else "s") for k, x in v.items()} if isinstance(v, dict) else [v],
    lambda v: [v] if not isinstance(v, list) else (v[1:] if v else [None]),
]


@pytest.mark.parametrize("name", sorted(CORPUS) + sorted(GENERATED))
def test_sentences_are_exactly_the_valid_documents(name):
    schema = {**CORPUS, **GENERATED}[name]
    g = json_grammar(schema)
    rng = random.Random("m" + name)
    for _ in range(20):
        value = rng.choice(MUTATIONS)(instance(rng, schema))
        text = json.dumps(value)
        assert g.matches(text.encode()) == valid(value, schema), text


@pytest.mark.parametrize("text", ['{"a": 1,}', '{"a" 1}', "{'a': 1}", '{"a": 01}', '{"a": 1.}', '{"a": .5}',
                                  '{"a": "\\x"}', '{"a": "\\u12"}', '{"a": "tab\there"}', '{"a": NaN}',
                                  '[]', '"s"', '{"a": tru}', '{"a": 1}}', '{"a": [1,]}'])
def test_malformed_json_is_refused(text):
    assert not json_grammar(None).matches(text.encode())


@pytest.mark.parametrize("text", ['{}', '{"a": {"b": [1, 2.5e-3, -0, true, null, "\\u00e9\\n"]}}', ' {"k":"v"} ',
                                  '{"\\"q": "日本"}'])
def test_any_json_object(text):
    assert json_grammar(None).matches(text.encode())


def test_refs_and_recursion():
    schema = {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                                 "required": ["v"]}}, "$ref": "#/$defs/node"}
    g = json_grammar(schema)
    assert g.matches(b'{"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}')
    assert not g.matches(b'{"v": 1, "kids": [{"kids": []}]}')


def test_unsupported_schemas_fail_naming_the_place():
    with pytest.raises(GrammarError, match="properties.x.type"):
        json_grammar({"type": "object", "properties": {"x": {"type": "date"}}})
    with pytest.raises(GrammarError, match=r"\$ref"):
        json_grammar({"$ref": "http://example.com/s.json"})


def test_the_engine_reads_types_as_the_call_parser_does():
    rng = random.Random(3)
    for _ in range(300):
        s = generated_schema(rng)
        got = _json_types(s)
        want = schema_types(s)
        assert (None if got is None else frozenset(got)) == want, s


# --- XML tool calls ---------------------------------------------------------------------

def render_call(name, args, newline_before_close=True):
    parts = ["<tool_call>\n<function=" + name + ">\n"]
    for k, v in args.items():
        text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        # (a value ending in a newline needs the template's own newline: the parser strips one)
        nl = newline_before_close or text.endswith("\n")
        parts.append("<parameter=" + k + ">\n" + text + ("\n" if nl else "") + "</parameter>\n")
    parts.append("</function>\n</tool_call>")
    return "".join(parts)


def test_rendered_calls_are_sentences_and_parse_back():
    """The grammar's language is what the template writes and the parser reads: every call of
    the corpus tools with valid arguments is a sentence, and parse_output gives the arguments back."""
    tools = {k.split(":", 1)[1]: v for k, v in CORPUS.items()}
    g = tool_call_grammar(tools)
    rng = random.Random(0)
    for _ in range(150):
        calls = []
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(sorted(tools))
            args = instance(rng, tools[name])
            args = {k: v for k, v in args.items() if not (isinstance(v, str) and "</parameter>" in v)}
            calls.append((name, args))
        text = "\n".join(render_call(n, a, rng.random() < 0.8) for n, a in calls)
        assert g.matches(text.encode()), text
        parsed = parse_output(text, tools)
        assert [(c["name"], c["arguments"]) for c in parsed.tool_calls] == calls


def test_xml_grammar_refuses_what_the_tools_do_not_declare():
    tools = {"Bash": CORPUS["cc:Bash"], "Read": CORPUS["cc:Read"]}
    g = tool_call_grammar(tools)
    ok = render_call("Bash", {"command": "ls"})
    assert g.matches(ok.encode())
    assert not g.matches(render_call("Bash", {"timeout": 3}).encode())  # required command missing
    assert not g.matches(render_call("Bash", {"command": "ls", "nope": 1}).encode())
    assert not g.matches(render_call("Nope", {"command": "ls"}).encode())
    assert not g.matches(render_call("Read", {"file_path": "a", "offset": "ten"}).encode())  # integer
    assert not g.matches(render_call("Bash", {"command": "a</parameter>\n<parameter=x>"}).encode())
    assert not g.matches(b"")  # at least one call
    assert not g.matches((ok + "\n" + ok).encode()) is False
    one = tool_call_grammar(tools, ["Read"], max_calls=1)
    assert one.matches(render_call("Read", {"file_path": "a"}).encode())
    assert not one.matches(ok.encode())
    assert not one.matches((render_call("Read", {"file_path": "a"}) * 2).encode())


def test_generated_tool_schemas_round_trip():
    rng = random.Random(7)
    for i in range(30):
        tools = {f"t{i}_{j}": generated_tool_schema(rng) for j in range(3)}
        g = tool_call_grammar(tools)
        for _ in range(5):
            name = rng.choice(sorted(tools))
            args = instance(rng, tools[name])
            args = {k: v for k, v in args.items() if not (isinstance(v, str) and "</parameter>" in v)}
            assert g.matches(render_call(name, args).encode()), (tools[name], args)


def test_json_dialect_calls():
    tools = {"Bash": CORPUS["cc:Bash"], "Read": CORPUS["cc:Read"]}
    g = tool_call_grammar(tools, dialect="json")
    rng = random.Random(2)
    for _ in range(40):
        name = rng.choice(sorted(tools))
        args = instance(rng, tools[name])
        call = "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
        assert g.matches(call.encode()), call
        assert [(c["name"], c["arguments"]) for c in parse_output(call, tools).tool_calls] == [(name, args)]
    assert not g.matches(b'<tool_call>\n{"name": "Bash", "arguments": {}}\n</tool_call>')  # command required
    assert not g.matches(b'<tool_call>\n{"name": "Nope", "arguments": {"command": "x"}}\n</tool_call>')
    with pytest.raises(GrammarError):
        tool_call_grammar(tools, dialect="yaml")
