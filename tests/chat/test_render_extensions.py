"""Documented extensions (docs/CHAT.md), the errors that remain, template variants
and template detection, each with a small hand-written expectation."""

from __future__ import annotations

import json

import pytest

from q27py.chat.conversation import Conversation, Message, ToolCall, ToolSpec
from q27py.chat.render import (
    DEFAULT_TEMPLATE,
    TOOLS_HEADER,
    RenderError,
    detect_template,
    render,
    render_messages,
    template_variant,
)

GEN = "<|im_start|>assistant\n<think>\n"


def turn(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def test_mid_conversation_system_renders_in_place():
    out = render_messages([
        {"role": "system", "content": "first"},
        {"role": "user", "content": "a"},
        {"role": "system", "content": "  reminder  "},
        {"role": "user", "content": "b"},
    ])
    assert out.text == (turn("system", "first") + turn("user", "a") + turn("system", "reminder")
                        + turn("user", "b") + GEN)


def test_trailing_system_is_followed_by_the_generation_prompt():
    out = render_messages([{"role": "user", "content": "hi"},
                           {"role": "system", "content": "env: linux"}])
    assert out.text == turn("user", "hi") + turn("system", "env: linux") + GEN
    assert out.stable_len == len(turn("user", "hi") + turn("system", "env: linux"))


def test_developer_is_a_system_turn_first_and_later():
    tool = {"type": "function", "function": {"name": "f"}}
    out = render_messages([{"role": "developer", "content": "base"},
                           {"role": "developer", "content": "skills"},
                           {"role": "user", "content": "go"}], [tool])
    head = out.text[: out.system_len]
    assert head.startswith("<|im_start|>system\n" + TOOLS_HEADER)
    assert head.endswith("</IMPORTANT>\n\nbase<|im_end|>\n")  # merged like a first system message
    assert out.text[out.system_len:] == turn("system", "skills") + turn("user", "go") + GEN


def test_tool_only_history_keeps_thinking_of_every_assistant_turn():
    out = render_messages([
        {"role": "assistant", "reasoning_content": "r1", "content": "",
         "tool_calls": [{"function": {"name": "ls", "arguments": {}}}]},
        {"role": "tool", "content": "out"},
    ])
    assert out.text == (
        "<|im_start|>assistant\n<think>\nr1\n</think>\n\n<tool_call>\n<function=ls>\n"
        "</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nout\n</tool_response><|im_end|>\n" + GEN)


def test_user_turns_that_only_wrap_tool_responses_are_not_queries():
    # Same rule as the template: such a user turn does not end the current turn.
    out = render_messages([
        {"role": "assistant", "content": "x", "reasoning_content": "r"},
        {"role": "user", "content": "<tool_response>\nz\n</tool_response>"},
    ], enable_thinking=False)
    assert out.text.startswith("<|im_start|>assistant\n<think>\nr\n</think>\n\nx<|im_end|>\n")


def test_first_message_tool_result_opens_a_user_turn():
    out = render_messages([{"role": "tool", "content": "r"}, {"role": "user", "content": "q"}])
    assert out.text == ("<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n"
                        + turn("user", "q") + GEN)


@pytest.mark.parametrize("content", [
    [{"type": "image", "image": "data:..."}],
    [{"type": "image_url", "image_url": {"url": "http://x"}}],
    [{"type": "text", "text": "see"}, {"type": "video", "video": "v.mp4"}],
])
def test_images_and_videos_are_a_clear_error(content):
    with pytest.raises(RenderError, match="text only"):
        render_messages([{"role": "user", "content": content}])


@pytest.mark.parametrize("messages, match", [
    ([], "No messages"),
    ([{"role": "critic", "content": "x"}], "Unexpected message role"),
    ([{"role": "user", "content": 5}], "Unexpected content type"),
    ([{"role": "user", "content": {"text": "x"}}], "Unexpected content type"),
    ([{"role": "user", "content": [{"type": "audio"}]}], "Unexpected item type"),
    ([{"role": "user", "content": "q"},
      {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}],
     "arguments must be an object"),
    ([{"role": "user", "content": "q"},
      {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}], "has no name"),
])
def test_template_errors_that_remain(messages, match):
    with pytest.raises(RenderError, match=match):
        render_messages(messages)


def test_unknown_template_name():
    with pytest.raises(RenderError, match="unknown chat template"):
        render_messages([{"role": "user", "content": "q"}], template="qwen9")


def test_template_content_list_joins_text_items():
    out = render_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                        {"text": "b"}]}])
    assert out.text == turn("user", "ab") + GEN


ARGS = {"flag": True, "none": None, "n": 2, "x": 1.5, "s": "two words", "l": [1, "a"],
        "o": {"k": False}}


@pytest.mark.parametrize("template, expected", [
    ("qwen3.6", ["true", "null", "2", "1.5", "two words", '[1, "a"]', '{"k": false}']),
    ("qwen3.5", ["True", "None", "2", "1.5", "two words", '[1, "a"]', '{"k": false}']),
])
def test_argument_formatting_per_template(template, expected):
    conv = Conversation([Message("user", "q"),
                         Message("assistant", "", tool_calls=[ToolCall("f", ARGS)])])
    text = render(conv, template=template).text
    values = [text.split(f"<parameter={k}>\n", 1)[1].split("\n</parameter>", 1)[0] for k in ARGS]
    assert values == expected


@pytest.mark.parametrize("template, thinking, suffix", [
    ("qwen3.6", None, "<think>\n"), ("qwen3.6", True, "<think>\n"),
    ("qwen3.6", False, "<think>\n\n</think>\n\n"),
    ("qwen3.5", None, "<think>\n"), ("qwen3.5", False, "<think>\n\n</think>\n\n"),
    ("qwen3.5-0.8b", None, "<think>\n\n</think>\n\n"), ("qwen3.5-0.8b", True, "<think>\n"),
])
def test_generation_prompt_thinking(template, thinking, suffix):
    out = render(Conversation([Message("user", "q")]), template=template, enable_thinking=thinking)
    assert out.text == turn("user", "q") + "<|im_start|>assistant\n" + suffix


@pytest.mark.parametrize("template, kept", [("qwen3.6", True), ("qwen3.5", False)])
def test_preserve_thinking_only_in_qwen36(template, kept):
    conv = Conversation([Message("user", "a"), Message("assistant", "b", reasoning="why"),
                         Message("user", "c")])
    text = render(conv, template=template, preserve_thinking=True).text
    assert ("<think>\nwhy\n</think>" in text) == kept
    # Without preserve_thinking the old turn's thinking is dropped in both.
    assert "why" not in render(conv, template=template).text


def test_explicit_empty_reasoning_leaves_a_literal_think_close_in_content():
    conv = Conversation([Message("user", "a"),
                         Message("assistant", "x </think> y", reasoning="")])
    assert "<think>\n\n</think>\n\nx </think> y<|im_end|>" in render(conv).text
    # Not given (None): split out of the content as the template does (only newlines
    # after the close are stripped, so the space stays).
    conv.messages[1].reasoning = None
    assert "<think>\nx\n</think>\n\n y<|im_end|>" in render(conv).text


def test_deferred_tools_are_not_listed():
    conv = Conversation([Message("user", "q")],
                        [ToolSpec("a", "A", {"type": "object"}),
                         ToolSpec("b", "B", {"type": "object"}, deferred=True)])
    text = render(conv).text
    assert '"name": "a"' in text and '"name": "b"' not in text


def test_system_len_and_stable_len():
    conv = Conversation([Message("system", "s"), Message("user", "q")])
    out = render(conv)
    assert out.text[: out.system_len] == turn("system", "s")
    assert out.stable_len == len(turn("system", "s") + turn("user", "q"))
    assert render(conv, add_generation_prompt=False).stable_len == out.stable_len
    assert render(Conversation([Message("user", "q")])).system_len == 0


# --- template detection -----------------------------------------------------------


@pytest.mark.parametrize("name, variant", [
    ("qwen3_6_chat_template.jinja", "qwen3.6"),
    ("qwen3_5_chat_template.jinja", "qwen3.5"),
    ("qwen3_5_0_8b_chat_template.jinja", "qwen3.5-0.8b"),
])
def test_template_variant_of_reference_files(shared_dir, name, variant):
    assert template_variant((shared_dir / "reference" / name).read_text()) == variant


def test_detect_template_from_model_dirs(tmp_path, shared_dir):
    ref = shared_dir / "reference"
    jinja_dir = tmp_path / "jinja"
    jinja_dir.mkdir()
    (jinja_dir / "chat_template.jinja").write_text((ref / "qwen3_5_chat_template.jinja").read_text())
    assert detect_template(jinja_dir) == "qwen3.5"

    config_dir = tmp_path / "config"
    config_dir.mkdir()
    small = (ref / "qwen3_5_0_8b_chat_template.jinja").read_text()
    (config_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": small}))
    assert detect_template(config_dir) == "qwen3.5-0.8b"
    (config_dir / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "x"},
                                      {"name": "default", "template": small}]}))
    assert detect_template(config_dir) == "qwen3.5-0.8b"

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "chat_template.jinja").write_text("{{ messages }}")
    assert detect_template(unknown) == DEFAULT_TEMPLATE
    assert detect_template(tmp_path / "missing") == DEFAULT_TEMPLATE


def test_bundled_model_uses_qwen36():
    from q27py import DEFAULT_MODEL_DIR

    assert detect_template(DEFAULT_MODEL_DIR) == "qwen3.6"


@pytest.mark.parametrize("message", [
    Message("user", None),
    Message("assistant", "", reasoning=3),
    Message("assistant", "", tool_calls=[ToolCall("f", '{"a": 1}')]),
    Message("assistant", "", tool_calls=[ToolCall(None, {})]),
])
def test_malformed_conversation_objects_are_a_render_error(message):
    with pytest.raises(RenderError):
        render(Conversation([Message("user", "q"), message]))
