"""`q27py render`: request body on stdin -> the exact prompt (or JSON with token ids)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.chat.render import render
from q27py.chat.requests import parse_conversation
from q27py.cli import main

OPENAI = {"model": "m", "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "weather in Zürich?"},
    {"role": "assistant", "content": None, "reasoning_content": "call it", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
    "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object",
                                              "properties": {"city": {"type": "string"}}}}}]}

ANTHROPIC = {"model": "m", "max_tokens": 64, "thinking": {"type": "disabled"},
             "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.2.3;"},
                        {"type": "text", "text": "S"}],
             "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}


def run_cli(monkeypatch, capsys, body, *args: str) -> tuple[int, str, str]:
    stdin = body if isinstance(body, str) else json.dumps(body)
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = main(["render", *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_prints_the_exact_prompt(monkeypatch, capsys):
    rc, out, _ = run_cli(monkeypatch, capsys, OPENAI, "--api", "openai")
    conv, _ = parse_conversation("openai", OPENAI)
    # The server default applies: thinking on, old thinking preserved.
    assert rc == 0
    assert out == render(conv, enable_thinking=True, preserve_thinking=True).text
    assert out.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_thinking_follows_the_request(monkeypatch, capsys):
    rc, out, _ = run_cli(monkeypatch, capsys, ANTHROPIC, "--api", "anthropic")
    assert rc == 0
    assert out == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                   "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_override(monkeypatch, capsys):
    body = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": {"b": True}}}]},
            {"role": "tool", "content": "r"}]}
    _, out36, _ = run_cli(monkeypatch, capsys, body)
    _, out35, _ = run_cli(monkeypatch, capsys, body, "--template", "qwen3.5")
    assert "<parameter=b>\ntrue\n" in out36 and "<parameter=b>\nTrue\n" in out35


def test_json_output_token_ids_and_stable_len(monkeypatch, capsys):
    from q27py.tokenizer import Tokenizer

    rc, out, _ = run_cli(monkeypatch, capsys, OPENAI, "--json", "--model", str(DEFAULT_MODEL_DIR))
    assert rc == 0
    data = json.loads(out)
    assert set(data) == {"prompt", "token_ids", "stable_len", "stable_chars"}
    tokenizer = Tokenizer.from_model_dir(DEFAULT_MODEL_DIR)
    assert data["token_ids"] == tokenizer.encode(data["prompt"])  # split-encoding changes nothing
    stable = tokenizer.encode(data["prompt"][: data["stable_chars"]])
    assert data["stable_len"] == len(stable) and data["token_ids"][: len(stable)] == stable
    assert data["prompt"][data["stable_chars"]:] == "<|im_start|>assistant\n<think>\n"


@pytest.mark.parametrize("stdin, api, message", [
    ("{not json", "openai", "not valid JSON"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), "openai",
     "messages[0].content[0]: images are not supported"),
    (json.dumps({"input": []}), "responses", "input: the conversation has no messages"),
])
def test_errors_are_one_clean_line(monkeypatch, capsys, stdin, api, message):
    rc, out, err = run_cli(monkeypatch, capsys, stdin, "--api", api)
    assert rc == 1 and out == ""
    assert err.startswith("q27py render: error: ") and message in err
    assert "Traceback" not in err


def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "q27py", "render", "--api", "openai"],
                          input=json.dumps(OPENAI).encode(), capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode("utf-8").startswith("<|im_start|>system\n# Tools\n")
