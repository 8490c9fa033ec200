"""Properties of the splitter over generated outputs.

1. It never raises, whatever the text and however it is chunked.
2. It never loses bytes. Precisely (``record_spans``): the spans, in order, concatenate
   to the input; text deltas concatenate to exactly the ``text`` spans and reasoning
   deltas to the ``reasoning`` spans; ``space`` spans are whitespace; ``marker`` spans are
   think markers or an empty/truncated ``<tool_call>`` wrapper (plus whitespace); all
   the rest is ``call`` spans, and every call's arguments are valid JSON equal to the
   concatenation of its fragments.
3. The result does not depend on the chunking: after merging adjacent deltas of the same
   kind, the events of every chunking are identical (1-character chunks included).
4. Round trip: outputs rendered from known text, reasoning and calls (the template's XML
   form, or the JSON form) parse back to exactly those, argument types included.
"""

from __future__ import annotations

import json
import random
import re

from q27py.chat.stream import (
    ReasoningDelta,
    StreamSplitter,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    collect,
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
        "properties": {"todos": {"type": "array"}, "meta": {"type": "object"}},
        "required": ["todos"],
    },
}

CASES = 250  # seeded examples per property (a plain generator: the design card keeps tests to pytest)


def _random_text(rng: random.Random, max_size: int) -> str:
    """Short strings over every plane: ASCII, markup characters, CJK, emoji, controls."""
    pools = ["<>/=\n \t{}\"[],:", "abcxyz_019", "\u00e9\u4e2d\u6587\U0001f600\u0301", "\x00\x1b\r"]
    return "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(0, max_size)))

# Pieces that exercise every state: markers, their fragments, drift openers, JSON, fences.
PIECES = [
    "<tool_call>", "</tool_call>", "<function=bash>", "<function=read_file>", "<function=", "<function name=\"bash\">",
    "<parameter=command>", "<parameter=path>", "<parameter=timeout>", "<parameter=", "</parameter>", "</function>",
    "<think>", "</think>", "<tool_name>", "</tool_name>", "<name>", "</name>", "<content>", "</content>",
    "\n", "\n", "\n", " ", "  ", "\t", "```", "`", "~~~", "<", ">", "/", "=", "\\", '"', "{", "}", "[", "]", ",", ":",
    '"name"', '"arguments"', '"command"', "bash", "read_file", "ls -la", "42", "true", "null", "text", "é", "😀",
    "\\u00", "<tool", "</para", "<|im_end|>", "\r",
]


def normalize(events):
    """Merge adjacent deltas of the same kind (and same call), drop empty ones."""
    out = []
    for e in events:
        if isinstance(e, (TextDelta, ReasoningDelta)):
            if out and type(out[-1]) is type(e):
                out[-1] = type(e)(out[-1].text + e.text)
            else:
                out.append(e)
        elif isinstance(e, ToolCallArgsDelta):
            if out and isinstance(out[-1], ToolCallArgsDelta) and out[-1].index == e.index:
                out[-1] = ToolCallArgsDelta(e.index, out[-1].json_fragment + e.json_fragment)
            else:
                out.append(e)
        else:
            out.append(e)
    return out


def run(text, cuts, tools, in_reasoning):
    splitter = StreamSplitter(tools, in_reasoning=in_reasoning, make_id=lambda i: f"id{i}", record_spans=True)
    events, pos = [], 0
    for cut in sorted(cuts):
        events += splitter.feed(text[pos:cut])
        pos = cut
    events += splitter.feed(text[pos:])
    events += splitter.finish()
    return events, splitter.spans


MARKER_STRINGS = re.compile(r"<think>|</think>|<tool_call>|</tool_call>")


def check_accounting(text, events, spans):
    assert "".join(raw for _, raw in spans) == text
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "".join(r for k, r in spans if k == "text")
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "".join(
        r for k, r in spans if k == "reasoning"
    )
    for kind, raw in spans:
        assert kind in ("text", "reasoning", "space", "marker", "call")
        if kind == "space":
            assert raw.strip() == ""
        if kind == "marker":
            assert MARKER_STRINGS.sub("", raw).strip() == "", raw
    calls = {}
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index == len(calls) and e.index not in calls
            calls[e.index] = []
        elif isinstance(e, ToolCallArgsDelta):
            calls[e.index].append(e.json_fragment)
        elif isinstance(e, ToolCallEnd):
            assert "".join(calls[e.index]) == e.arguments_json
            assert isinstance(json.loads(e.arguments_json), dict)
            e.arguments_json.encode("utf-8")
            calls[e.index] = None  # closed: no more fragments may come
    assert all(v is None for v in calls.values())
    # call spans cannot hide text: every run of them produced at least one call
    call_runs = sum(1 for k, (kind, _) in enumerate(spans) if kind == "call" and (k == 0 or spans[k - 1][0] != "call"))
    assert (call_runs == 0) == (not calls) and call_runs <= len(calls)


def fuzz_output(seed: int):
    rng = random.Random(seed)
    pieces = [rng.choice(PIECES) if rng.random() < 0.5 else _random_text(rng, 4) for _ in range(rng.randint(0, 60))]
    text = "".join(pieces)
    cuts = [rng.randint(0, len(text)) for _ in range(rng.randint(0, 12))]
    return text, cuts, rng.random() < 0.5, rng.random() < 0.5


def check_properties(case):
    text, cuts, with_tools, in_reasoning = case
    tools = TOOLS if with_tools else None
    whole, spans = run(text, [], tools, in_reasoning)
    check_accounting(text, whole, spans)
    chunked, spans = run(text, cuts, tools, in_reasoning)
    check_accounting(text, chunked, spans)
    assert normalize(chunked) == normalize(whole)
    by_char, _ = run(text, range(len(text)), tools, in_reasoning)
    assert normalize(by_char) == normalize(whole)


def test_fuzz_never_raises_loses_nothing_and_ignores_chunking():
    for seed in range(CASES):
        check_properties(fuzz_output(seed))


# --- round trip from known structure -------------------------------------------------

WORDS = ["the", "file", "run", "ls", "é", "日本", "😀", "x=1", "<b>", "a<tool_call>b", '{"k": 1}', "'q'", "</", "`x`"]
VALUE_PIECES = ["a", " ", "\n", "\t", "<", ">", "/", "</parameter>", "<tool_call>", "</think>", "{", "}", '"', "\\",
                "é", "😀", "</function>", "<parameter=x>", "</tool_call>", "end"]
FALSE_CLOSER = re.compile(
    r"</(?:parameter|function)>\s*(?:<parameter|</function>|</tool_call>|<function|<tool_call>|<tool_name>|$)"
)


def prose(rng, lines=3):
    out = []
    for _ in range(rng.randint(1, lines)):
        out.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))))
    return "\n".join(out)


def string_value(rng):
    while True:
        value = "".join(rng.choice(VALUE_PIECES) for _ in range(rng.randint(0, 12)))
        if not FALSE_CLOSER.search(value):
            return value


def arguments(rng, tool):
    if tool == "bash":
        args = {"command": string_value(rng)}
        if rng.random() < 0.5:
            args["timeout"] = rng.choice([0, 7, 2.5, -1e3, 12345678901234])
        if rng.random() < 0.5:
            args["background"] = rng.random() < 0.5
    elif tool == "read_file":
        args = {"path": string_value(rng)}
        if rng.random() < 0.5:
            args["offset"] = rng.randint(-5, 10**6)
    else:
        todos = [{"id": i, "text": string_value(rng), "done": rng.random() < 0.5} for i in range(rng.randint(0, 3))]
        args = {"todos": todos}
        if rng.random() < 0.5:
            args["meta"] = {"n": None, "nested": {"list": [1, "two", 3.5]}}
    return args


def render_call(rng, name, args):
    if rng.random() < 0.8:
        body = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
            for k, v in args.items()
        )
        return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def generated_output(seed):
    """(output, in_reasoning, expected reasoning, expected text, expected calls)."""
    rng = random.Random(seed)
    calls = []

    def make_calls(k):
        rendered = []
        for _ in range(k):
            name = rng.choice(list(TOOLS))
            args = arguments(rng, name)
            calls.append((name, args))
            rendered.append(render_call(rng, name, args))
        return "\n".join(rendered)

    in_reasoning = rng.random() < 0.5
    out, reasoning, text = "", "", ""
    if in_reasoning:
        reasoning = prose(rng)
        out = reasoning
        if rng.random() < 0.3:
            out += "\n" + make_calls(1)
            more = prose(rng)
            out += "\n" + more
            reasoning += "\n" + more
        out += "\n</think>\n\n"
    if rng.random() < 0.7:
        text = prose(rng)
        out += text
    k = rng.randint(0, 3)
    if k:
        out += ("\n\n" if text else "") + make_calls(k)
        if rng.random() < 0.3:
            after = prose(rng, 1)
            out += "\n\n" + after
            text = text + "\n\n" + after if text else after
    return out, in_reasoning, reasoning, text, calls


def mutated_output(seed: int):
    """A well-formed generated output, then cut, spliced and salted with pieces: this
    reaches the call states (and the drift paths) far more often than free text."""
    rng = random.Random(10**7 + seed)
    text = generated_output(rng.randint(0, 10**6))[0]
    for _ in range(rng.randint(0, 4)):
        pos = rng.randint(0, len(text))
        op = rng.choice(["insert", "delete", "truncate"])
        if op == "insert":
            text = text[:pos] + rng.choice(PIECES) + text[pos:]
        elif op == "delete":
            text = text[:pos] + text[pos + rng.randint(1, 12) :]
        else:
            text = text[:pos]
    cuts = [rng.randint(0, len(text)) for _ in range(rng.randint(0, 12))]
    return text, cuts, rng.random() < 0.5, rng.random() < 0.5


def test_mutated_outputs_never_raise_lose_nothing_and_ignore_chunking():
    for seed in range(CASES):
        check_properties(mutated_output(seed))


def test_round_trip_of_generated_outputs():
    for seed in range(300):
        out, in_reasoning, reasoning, text, calls = generated_output(seed)
        rng = random.Random(seed)
        for cuts in ([], sorted(rng.sample(range(len(out) + 1), min(len(out), 25))), range(len(out))):
            events, spans = run(out, cuts, TOOLS, in_reasoning)
            check_accounting(out, events, spans)
            parsed = collect(events)
            assert [(c["name"], c["arguments"]) for c in parsed.tool_calls] == calls, (seed, out)
            assert parsed.reasoning == reasoning, (seed, out)
            assert parsed.text == text, (seed, out)
            call_text = "".join(raw for kind, raw in spans if kind == "call")
            for _, args in calls:
                for value in args.values():
                    if isinstance(value, str):
                        assert value in call_text or json.dumps(value, ensure_ascii=False)[1:-1] in call_text
