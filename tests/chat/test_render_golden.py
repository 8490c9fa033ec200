"""The renderer against the official templates' own output.

- ../shared/fixtures/render: 800 conversations the official Qwen3.6 / Qwen3.5
  templates accept, with what jinja2 renders for them (transformers' settings).
- tests/chat/data/render_extension_goldens.jsonl: 160 conversations the official
  templates reject or mis-render (system/developer turns after the first message,
  tool-only histories, a tool result first), with what the official template
  renders after the four edits docs/CHAT.md lists (a raise replaced by the in-place
  system turn, developer treated as system, last_query_index = -1 when there is no
  user query, a first tool result opening its user turn). Made outside the project
  (jinja2 is not a dependency), the same way as the shared fixtures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from q27py.chat.render import IM_END, THINK_CLOSED, THINK_OPEN, render_messages

FIXTURE_FILES = {"qwen3.6": "qwen3_6_renders.jsonl", "qwen3.5": "qwen3_5_renders.jsonl"}
EXTENSION_GOLDENS = Path(__file__).parent / "data" / "render_extension_goldens.jsonl"


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _first_difference(got: str, want: str) -> str:
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"at char {i}: got {got[i - 40:i + 40]!r}, want {want[i - 40:i + 40]!r}"


def _check_cases(cases: list[dict], template_of) -> list[str]:
    failures = []
    for case in cases:
        assert "error" not in case, "error cases are not expected in these files"
        out = render_messages(case["messages"], case["tools"], template=template_of(case),
                              add_generation_prompt=case["add_generation_prompt"], **case["kwargs"])
        if out.text != case["expected"]:
            failures.append(f"case {case['id']}: {_first_difference(out.text, case['expected'])}")
            continue
        # The stable boundary: the text ends a turn there; only the generation prompt follows.
        assert out.text[: out.stable_len].endswith(IM_END + "\n"), case["id"]
        tail = out.text[out.stable_len:]
        if case["add_generation_prompt"]:
            assert tail in ("<|im_start|>assistant\n" + THINK_OPEN,
                            "<|im_start|>assistant\n" + THINK_CLOSED), case["id"]
        else:
            assert tail == "", case["id"]
    return failures


@pytest.mark.parametrize("template", sorted(FIXTURE_FILES))
def test_official_golden_renders(fixtures_dir, template):
    cases = _read_jsonl(fixtures_dir / "render" / FIXTURE_FILES[template])
    assert len(cases) == 400
    failures = _check_cases(cases, lambda case: template)
    assert not failures, f"{len(failures)} of {len(cases)} differ; " + "; ".join(failures[:5])


def test_reference_rendering_example(shared_dir):
    """The four cases of ../shared/reference/render_example.py (checked against transformers)."""
    cases = json.loads((shared_dir / "reference" / "qwen3_6_rendered_example.json").read_text())
    for case in cases:
        out = render_messages(case["messages"], case["tools"], **case["kwargs"])
        assert out.text == case["rendered"], case["case"]


def test_extension_goldens():
    cases = _read_jsonl(EXTENSION_GOLDENS)
    shapes = {case["shape"] for case in cases}
    assert {"mid_system", "trailing_system", "developer", "tool_only", "tool_first"} <= shapes
    failures = _check_cases(cases, lambda case: case["template"])
    assert not failures, f"{len(failures)} of {len(cases)} differ; " + "; ".join(failures[:5])
