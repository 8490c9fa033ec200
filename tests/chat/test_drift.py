"""Drift-mode recovery: one fixture file per catalogued mode (q27-design.md 7.7).

Each fixture holds the registered tools and cases: recovered ones (the calls, text and
reasoning expected, and the mode's log line) and refused ones (ambiguous or
unregistered: no call, the text kept). Every case is checked whole and streamed in
one-character and random chunks.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest

from q27py.chat.stream import StreamSplitter, collect, parse_output
from q27py.chat.toolcall import DRIFT_MODES

FIXTURES = Path(__file__).parent / "drift_fixtures"


def _load():
    return {json.loads(p.read_text())["mode"]: json.loads(p.read_text()) for p in sorted(FIXTURES.glob("*.json"))}


ALL = _load()
CASES = [(mode, i) for mode, fx in sorted(ALL.items()) for i in range(len(fx["cases"]))]


def test_one_fixture_per_catalogued_mode():
    assert sorted(ALL) == sorted(DRIFT_MODES)
    for mode, fx in ALL.items():
        assert fx["name"] == DRIFT_MODES[mode]
        assert any(not c.get("refused") for c in fx["cases"]), f"mode {mode} has no recovered case"


def _streamed(text, tools, in_reasoning, sizes):
    splitter = StreamSplitter(tools, in_reasoning=in_reasoning, make_id=lambda i: f"call_{i}")
    events, pos = [], 0
    for size in sizes:
        events += splitter.feed(text[pos : pos + size])
        pos += size
    events += splitter.feed(text[pos:])
    return collect(events + splitter.finish())


def _calls(parsed):
    return [{"name": c["name"], "arguments": c["arguments"]} for c in parsed.tool_calls]


@pytest.mark.parametrize("mode,index", CASES, ids=[f"{ALL[m]['name']}-{i}" for m, i in CASES])
def test_drift_case(mode, index, caplog):
    fx = ALL[mode]
    case = fx["cases"][index]
    with caplog.at_level(logging.INFO, logger="q27py.toolcall"):
        parsed = parse_output(case["input"], fx["tools"], case["in_reasoning"])
    assert _calls(parsed) == case["tool_calls"]
    assert parsed.text == case["text"]
    assert parsed.reasoning == case["reasoning"]
    label = f"mode {mode} {fx['name']}"
    logged = [r.getMessage() for r in caplog.records if r.name == "q27py.toolcall"]
    if case.get("refused"):
        assert not any("recovered" in line for line in logged), logged
    else:
        assert any(label in line for line in logged), logged

    rng = random.Random(mode * 100 + index)
    text = case["input"]
    for sizes in ([1] * len(text), [rng.randint(1, 7) for _ in range(len(text))]):
        streamed = _streamed(text, fx["tools"], case["in_reasoning"], sizes)
        assert _calls(streamed) == case["tool_calls"]
        assert (streamed.text, streamed.reasoning) == (parsed.text, parsed.reasoning)


def test_inference_needs_tools():
    """Without registered tools nothing can be inferred or resolved: drift stays text."""
    fx = ALL[21]
    case = fx["cases"][0]
    parsed = parse_output(case["input"], None)
    assert parsed.tool_calls == []
    assert parsed.text == case["input"].strip()


def test_recovered_arguments_are_valid_json_in_events():
    fx = ALL[11]
    splitter = StreamSplitter(fx["tools"])
    events = splitter.feed(fx["cases"][0]["input"]) + splitter.finish()
    ends = [e for e in events if type(e).__name__ == "ToolCallEnd"]
    assert len(ends) == 1
    fragments = "".join(e.json_fragment for e in events if type(e).__name__ == "ToolCallArgsDelta")
    assert fragments == ends[0].arguments_json
    assert json.loads(fragments)["content"].startswith('print("hello")')
