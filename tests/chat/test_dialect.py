"""Template variant and tool dialect chosen from the checkpoint (Qwen3.8 included), with overrides."""

import json
import logging

import pytest

from q27py.chat.conversation import Conversation, Message, ToolCall
from q27py.chat.render import RenderError, choose_dialect, render, template_variant, tool_dialect_of


def test_reference_templates_are_xml_and_keep_their_variant(shared_dir):
    text = (shared_dir / "reference" / "qwen3_6_chat_template.jinja").read_text()
    assert template_variant(text) == "qwen3.6" and tool_dialect_of(text) == "xml"


def test_a_38_template_text_is_recognized(shared_dir, tmp_path):
    """A 3.6-style template that keeps every turn's thinking (no last-query rule) or carries a
    reasoning-effort switch is Qwen3.8."""
    text = (shared_dir / "reference" / "qwen3_6_chat_template.jinja").read_text()
    assert template_variant(text.replace("last_query_index", "lqi")) == "qwen3.8"
    assert template_variant(text + "{%- if reasoning_effort is defined %}{%- endif %}") == "qwen3.8"
    d = tmp_path / "m"
    d.mkdir()
    (d / "chat_template.jinja").write_text(text + "{# reasoning_effort #}")
    assert choose_dialect(d).template == "qwen3.8"


def test_name_picks_38_when_the_checkpoint_has_no_template(tmp_path, caplog):
    d = tmp_path / "Qwen3.8-27B-MTP"
    d.mkdir()
    with caplog.at_level(logging.INFO, logger="q27py.chat.render"):
        chosen = choose_dialect(d)
    assert (chosen.template, chosen.tool_dialect) == ("qwen3.8", "xml")
    assert "qwen3.8" in caplog.text and "name" in caplog.text
    other = tmp_path / "plain"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"_name_or_path": "Qwen/Qwen3.8-27B"}))
    assert choose_dialect(other).template == "qwen3.8"
    assert choose_dialect(tmp_path / "nothing").template == "qwen3.6"


def test_json_dialect_from_the_template_text_and_overrides(tmp_path):
    d = tmp_path / "q3"
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'}))
    assert choose_dialect(d).tool_dialect == "json"
    assert choose_dialect(d, tool_dialect="xml").tool_dialect == "xml"
    assert choose_dialect(d, template="qwen3.5").template == "qwen3.5"
    with pytest.raises(RenderError):
        choose_dialect(d, template="qwen9")
    with pytest.raises(RenderError):
        choose_dialect(d, tool_dialect="yaml")


def test_38_keeps_old_thinking_where_36_drops_it():
    conv = Conversation(messages=[
        Message("user", "q1"), Message("assistant", "a1", reasoning="r1"),
        Message("user", "q2"), Message("assistant", "", reasoning="r2", tool_calls=[ToolCall("Bash", {"n": 1})]),
    ])
    r36 = render(conv, template="qwen3.6").text
    r38 = render(conv, template="qwen3.8").text
    assert "r1" not in r36 and "<think>\nr1\n</think>" in r38
    assert r38.replace("<think>\nr1\n</think>\n\n", "") == r36
