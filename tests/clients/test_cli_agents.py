"""Claude Code and Codex CLI, headless, each completing one shell-tool round trip against q27py.

The model side is scripted here: these tests pin the exact command and its output
through the whole path, and the bundled model does call the shell tool but does not
reliably copy the requested command (test_cli_real_model.py drives the real model and
says what it does). The script calls the client's shell tool with `echo tool-ran-ok`, and once a
<tool_response> is in the prompt it answers with what the tool printed. So the
answer can only be right if the client really ran the command and sent the
result back. Everything else is the real path: the client's own request
shapes, our request mapping, renderer, tokenizer, splitter, SSE and usage.

The CLIs are pinned npm packages that .ci/run installs into $Q27_E2E_CLIENTS
(default ~/.cache/q27py-e2e-clients); without them these tests skip.
Command lines follow ../shared/reference/clients.md section 1.6.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CLIENTS = Path(os.environ.get("Q27_E2E_CLIENTS", Path.home() / ".cache" / "q27py-e2e-clients"))
BIN = CLIENTS / "node_modules" / ".bin"
MARKER = "tool-ran-ok"


def _binary(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} not installed in {CLIENTS} (.ci/run installs it)")
    return path


def _base_env(tmp_path: Path) -> dict[str, str]:
    node = shutil.which("node")
    path = "/usr/bin:/bin" + (f":{Path(node).parent}" if node else "")
    home = tmp_path / "home"
    home.mkdir()
    return {"PATH": path, "HOME": str(home), "TERM": "dumb"}


def shell_agent(tool: str, call: str):
    """A script: call the shell tool once, then report what it printed."""

    def script(prompt: str) -> str:
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompt, re.S)
        if results:
            lines = results[-1].strip().splitlines()
            answer = "The command printed: " + (lines[-1] if lines else "")
        elif f'"name": "{tool}"' in prompt:
            answer = call
        else:  # a side request without tools (titles, summaries)
            answer = "hi"
        if prompt.endswith("<think>\n"):
            return "I will use the shell.\n</think>\n\n" + answer
        return answer

    return script


BASH_CALL = (f"<tool_call>\n<function=Bash>\n<parameter=command>\necho {MARKER}\n</parameter>\n"
             "<parameter=description>\nEcho a marker\n</parameter>\n</function>\n</tool_call>")
EXEC_CALL = f"<tool_call>\n<function=exec_command>\n<parameter=cmd>\necho {MARKER}\n</parameter>\n</function>\n</tool_call>"


def test_claude_code_tool_round_trip(make_server, tmp_path):
    claude = _binary("claude")
    live = make_server(shell_agent("Bash", BASH_CALL), max_context=262144, default_thinking=True)
    work = tmp_path / "work"
    work.mkdir()
    env = _base_env(tmp_path) | {
        "ANTHROPIC_BASE_URL": live.base_url, "ANTHROPIC_API_KEY": "dummy", "ANTHROPIC_MODEL": "qwen-local",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "qwen-local", "CLAUDE_CODE_SUBAGENT_MODEL": "qwen-local",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_MAX_CONTEXT_TOKENS": "131072", "CLAUDE_CODE_MAX_RETRIES": "1"}
    proc = subprocess.run([str(claude), "-p", "run the echo command", "--allowedTools", "Bash",
                           "--output-format", "json"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    result = json.loads(proc.stdout)
    assert result["is_error"] is False and result["num_turns"] == 2, result
    assert result["result"] == f"The command printed: {MARKER}"

    first, second = live.engine.prompts[-2:]
    assert "x-anthropic-billing-header" not in first, "the per-request billing line is stripped"
    assert f"<tool_response>\n{MARKER}\n</tool_response>" in second
    assert "<think>\nI will use the shell.\n</think>" in second, "the thinking block was echoed back"
    assert second.startswith(first[: first.rindex("<|im_start|>assistant")]), "the prefix is stable across turns"
    # Claude Code's context accounting adds up our usage
    assert result["usage"]["input_tokens"] == sum(len(r.prompt_ids) for r in live.engine.requests[-2:])


def test_codex_tool_round_trip(make_server, tmp_path):
    codex = _binary("codex")
    live = make_server(shell_agent("exec_command", EXEC_CALL), max_context=262144, default_thinking=True)
    work, codex_home = tmp_path / "work", tmp_path / "codex"
    work.mkdir()
    codex_home.mkdir()
    last = tmp_path / "last.txt"
    env = _base_env(tmp_path) | {"CODEX_HOME": str(codex_home)}
    proc = subprocess.run(
        [str(codex), "exec", "--skip-git-repo-check", "--ephemeral", "--json", "-o", str(last),
         "-c", "model=qwen-local", "-c", "model_provider=local", "-c", "model_providers.local.name=local",
         "-c", f"model_providers.local.base_url={live.base_url}/v1", "-c", "model_providers.local.wire_api=responses",
         "-c", "model_providers.local.request_max_retries=1", "-c", "model_providers.local.stream_max_retries=1",
         "run echo"],
        cwd=work, env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    commands = [e["item"] for e in events if e["type"] == "item.completed"
                and e["item"]["type"] == "command_execution"]
    assert len(commands) == 1 and commands[0]["exit_code"] == 0
    assert commands[0]["aggregated_output"].strip() == MARKER
    assert last.read_text().strip() == f"The command printed: {MARKER}"

    requests = live.engine.requests[-2:]
    assert MARKER in live.engine.prompts[-1].split("<tool_response>")[-1]
    assert "web_search" not in live.engine.prompts[-1], "the hosted tool is not shown to the model"
    usage = [e["usage"] for e in events if e["type"] == "turn.completed"][0]
    # Codex compacts from response.completed usage, so it must add up to what was prefilled
    assert usage["input_tokens"] == sum(len(r.prompt_ids) for r in requests)
    assert usage["reasoning_output_tokens"] > 0
