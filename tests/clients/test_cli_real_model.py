"""Claude Code and Codex CLI, headless, against the real engine on the bundled model.

Everything is real: `q27py serve`'s own config (the CPU path's default max_tokens, ceiling and
reasoning budget), the bundled q36-tiny-agent on the fast CPU path, greedy decoding, and the
pinned CLIs that .ci/run installs (skipped without them). Each test must finish a turn: the
client exits 0 with a non-error result, and the engine ended every generation by itself (a
stop token or a tool call), not by running into a limit. The subprocess timeout only bounds
CI; the speed bar (a turn in under 2 minutes on a 2-core machine) is measured, not asserted:
docs/PERF.md, "CPU path".

What the small model does reliably, and so what is asserted:
- It answers a plain request and closes its turn.
- Offered a shell tool, it calls it (a well-formed XML tool call the client executes) and,
  given the tool's result, answers. Under Codex it copies the requested `echo hello`; under
  Claude Code, whose request puts a long environment system message after the user's, it
  calls a tool of its own choosing: Bash with a command of its own (seen: `ls -lamiddleware`,
  `mixer`), or a search tool the client did not offer (which the client answers with a
  tool_use_error). So the Claude Code test asserts the round trip (a well-formed call, the
  client's tool_result back in the prompt, an answer), not the tool or the command; the
  exact command / output round trip
  of both clients stays pinned by the scripted model in test_cli_agents.py.
Claude Code's print mode auto-runs read-only commands and refuses the rest, and Codex runs
commands in its read-only sandbox, so whatever the model invents cannot change the machine.
"""

from __future__ import annotations

import json
import re

from test_cli_agents import _base_env, _binary

TIMEOUT_S = 300  # bounds CI only (see the module docstring)


def _new_turns(server, before):
    turns = server.engine.turns[before:]
    assert turns, "the engine was never called"
    return turns


def _ended_by_itself(turns):
    for t in turns:
        assert t["finish"] == "stop", (t["finish"], t["output"][-300:])


def _claude(server, tmp_path, prompt, *extra):
    import subprocess

    claude = _binary("claude")
    work = tmp_path / "work"
    work.mkdir()
    env = _base_env(tmp_path) | {
        "ANTHROPIC_BASE_URL": server.base_url, "ANTHROPIC_API_KEY": "dummy", "ANTHROPIC_MODEL": "qwen-local",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "qwen-local", "CLAUDE_CODE_SUBAGENT_MODEL": "qwen-local",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_MAX_RETRIES": "1"}
    proc = subprocess.run([str(claude), "-p", prompt, *extra, "--output-format", "json"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    result = json.loads(proc.stdout)
    assert result["is_error"] is False, result
    return result


def _codex(server, tmp_path, prompt):
    import subprocess

    codex = _binary("codex")
    work, codex_home = tmp_path / "work", tmp_path / "codex"
    work.mkdir()
    codex_home.mkdir()
    last = tmp_path / "last.txt"
    env = _base_env(tmp_path) | {"CODEX_HOME": str(codex_home)}
    proc = subprocess.run(
        [str(codex), "exec", "--skip-git-repo-check", "--ephemeral", "--json", "-o", str(last),
         "-c", "model=qwen-local", "-c", "model_provider=local", "-c", "model_providers.local.name=local",
         "-c", f"model_providers.local.base_url={server.base_url}/v1", "-c", "model_providers.local.wire_api=responses",
         "-c", "model_providers.local.request_max_retries=1", "-c", "model_providers.local.stream_max_retries=1",
         prompt],
        cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert any(e["type"] == "turn.completed" for e in events), events[-3:]
    return events, last.read_text().strip()


def test_claude_code_completes_a_turn(real_server, tmp_path):
    before = len(real_server.engine.turns)
    result = _claude(real_server, tmp_path, "Write a Python function that reverses a string.")
    assert result["result"].strip() and result["stop_reason"] == "end_turn"
    turns = _new_turns(real_server, before)
    _ended_by_itself(turns)
    assert turns[-1]["max_tokens"] <= 4096, "Claude Code asks for 32,000: the CPU ceiling applies"
    assert result["result"].strip() in turns[-1]["output"]


def test_claude_code_tool_round_trip_by_the_model(real_server, tmp_path):
    before = len(real_server.engine.turns)
    result = _claude(real_server, tmp_path, "Run echo hello", "--tools", "Bash")
    turns = _new_turns(real_server, before)
    _ended_by_itself(turns)
    calls = [t for t in turns if re.search(r"<tool_call>\n<function=\w+>\n", t["output"])]
    assert calls, [t["output"][-300:] for t in turns]
    i = turns.index(calls[0])
    assert i + 1 < len(turns), "the client never came back with the tool's result"
    # the client executed (or refused) the model's call and sent the outcome back to the model
    assert re.search(r"<tool_response>\n.+\n</tool_response>", turns[i + 1]["prompt"], re.S)
    assert result["num_turns"] >= 2 and result["result"].strip()
    assert result["result"].strip() in turns[-1]["output"]


def test_codex_completes_a_turn(real_server, tmp_path):
    before = len(real_server.engine.turns)
    events, last = _codex(real_server, tmp_path, "Write a Python function that reverses a string.")
    turns = _new_turns(real_server, before)
    _ended_by_itself(turns)
    assert turns[-1]["max_tokens"] <= 1024, "Codex sends no max_tokens: the CPU default applies"
    assert last and last in turns[-1]["output"]


def test_codex_tool_round_trip_by_the_model(real_server, tmp_path):
    before = len(real_server.engine.turns)
    events, last = _codex(real_server, tmp_path, "Run echo hello")
    turns = _new_turns(real_server, before)
    _ended_by_itself(turns)
    commands = [e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "command_execution"]
    assert commands, [e["type"] for e in events]
    assert commands[0]["command"].endswith("'echo hello'") and commands[0]["exit_code"] == 0
    assert commands[0]["aggregated_output"].strip() == "hello"
    # the tool's output went back to the model, which then answered
    assert re.search(r"<tool_response>\n(?:.*\n)?Output:\nhello\n</tool_response>", turns[-1]["prompt"].split("<tool_call>")[-1], re.S)
    assert last and last in turns[-1]["output"]
