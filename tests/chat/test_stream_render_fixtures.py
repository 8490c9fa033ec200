"""Round trip through the official templates' own renders (../shared/fixtures/render).

Every assistant turn the Qwen3.5/3.6 templates rendered is exactly what the model is
trained to emit, so parsing the rendered turn must give back the message: its
reasoning, its text and its tool calls with arguments typed by the tool schemas. The
fixture's contents are adversarial on purpose (`<tool_call>`, `</think>`, `<b>`, JSON
and newlines in text and in argument values).
"""

from __future__ import annotations

import json

import pytest

from q27py.chat.stream import parse_output

TEMPLATES = ("qwen3_6_renders.jsonl", "qwen3_5_renders.jsonl")


def _assistant_turns(expected: str):
    for segment in expected.split("<|im_start|>")[1:]:
        if segment.startswith("assistant\n") and "<|im_end|>" in segment:
            yield segment[len("assistant\n") : segment.index("<|im_end|>")]


def _expected(message: dict) -> tuple[str, str]:
    """(reasoning, text) as the template splits them. One documented difference: a
    `<tool_call>` line that ends the output is a truncated call and is suppressed."""
    content = (message.get("content") or "").strip()
    reasoning = message.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
    content = content.strip()
    if content.endswith("<tool_call>") and not message.get("tool_calls"):
        head = content[: -len("<tool_call>")]
        if head.rstrip(" \t").endswith("\n") or not head.strip(" \t"):
            content = head.rstrip()
    return reasoning.strip(), content


def _cases(fixtures_dir, name):
    path = fixtures_dir / "render" / name
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "expected" not in row:
            continue
        tools = {t["function"]["name"]: t["function"]["parameters"] for t in row.get("tools") or []}
        assistants = [m for m in row["messages"] if m["role"] == "assistant"]
        turns = list(_assistant_turns(row["expected"]))
        assert len(turns) == len(assistants)
        yield from ((tools, m, turn) for m, turn in zip(assistants, turns))


@pytest.mark.parametrize("name", TEMPLATES)
def test_rendered_turns_parse_back(fixtures_dir, name):
    checked = calls = 0
    for tools, message, turn in _cases(fixtures_dir, name):
        reasoning, text = _expected(message)
        if "</think>" in reasoning:
            continue  # not invertible: the rendered block closes at the first </think>
        parsed = parse_output(turn, tools, in_reasoning=False)
        expected_calls = [
            {"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}
            for tc in message.get("tool_calls") or []
        ]
        got_calls = [{"name": c["name"], "arguments": c["arguments"]} for c in parsed.tool_calls]
        assert got_calls == expected_calls, turn
        if turn.startswith("<think>\n"):
            assert parsed.reasoning == reasoning, turn
        else:
            assert parsed.reasoning == ""
        assert parsed.text == text, turn
        checked += 1
        calls += len(expected_calls)
    assert checked > 1000 and calls > 600
