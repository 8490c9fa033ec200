"""Seeded random agent sessions, and the request bodies three APIs would carry for them.

A session is a list of normalized Messages shaped like real agent traffic: a
system or developer prompt, a user task, then assistant turns (reasoning, text,
tool calls) answered by tool results, with occasional new user messages and
system reminders in the middle or at the end (as Claude Code sends them).

The body builders are the inverse of q27py.chat.requests for such sessions: they
write what Claude Code (Anthropic), a Chat Completions client, and Codex
(Responses) send, including the parts that change per request (Claude Code's
billing line, moving cache_control markers), so tests can check that the mapping
recovers the session and that consecutive requests render append-only.
"""

from __future__ import annotations

import json
import random

from q27py.chat.conversation import Message, ToolCall, ToolSpec

WORDS = ["ls", "src/main.py", "fix", "the", "bug", "é", "日本", "😀", "</think>", "<tool_call>",
         "\n", "  ", '{"k": 1}', "<b>", "line\nbreak", "<tool_response>", "a\tb", "x"]

TOOLS = [
    ToolSpec("Bash", "Run a shell command.",
             {"type": "object", "properties": {"command": {"type": "string"},
                                               "timeout": {"type": "number"}},
              "required": ["command"]}),
    ToolSpec("Read", "Read a file.",
             {"type": "object", "properties": {"path": {"type": "string"},
                                               "lines": {"type": "array"}},
              "required": ["path"]}),
    ToolSpec("Edit", "Edit a file.",
             {"type": "object", "properties": {"path": {"type": "string"},
                                               "replace_all": {"type": "boolean"},
                                               "edits": {"type": "object"}}}),
]


def text(rng: random.Random, lo: int = 1, hi: int = 8) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _arguments(rng: random.Random, tool: ToolSpec) -> dict:
    values = {"string": lambda: text(rng, 1, 4), "number": lambda: rng.choice([1, 2.5, 30]),
              "array": lambda: [rng.randint(0, 9), text(rng, 1, 2)],
              "boolean": lambda: rng.random() < 0.5, "object": lambda: {"a": None, "b": [True]}}
    props = tool.parameters["properties"]
    return {k: values[v["type"]]() for k, v in props.items() if rng.random() < 0.7}


def agent_session(rng: random.Random, *, developer: bool = True, turns: int = 8) -> list[Message]:
    """A session; every assistant message has text or calls, tool results follow their calls."""
    system_roles = ["system", "developer"] if developer else ["system"]
    msgs: list[Message] = []
    if rng.random() < 0.8:
        msgs.append(Message(rng.choice(system_roles), text(rng, 3, 12)))
    msgs.append(Message("user", text(rng)))
    call_no = 0
    for _ in range(rng.randint(1, turns)):
        calls = []
        for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
            tool = rng.choice(TOOLS)
            call_no += 1
            calls.append(ToolCall(tool.name, _arguments(rng, tool), id=f"call_{call_no}"))
        content = text(rng) if (not calls or rng.random() < 0.4) else ""
        reasoning = text(rng) if rng.random() < 0.8 else ""
        msgs.append(Message("assistant", content, reasoning=reasoning, tool_calls=calls))
        for call in calls:
            msgs.append(Message("tool", text(rng, 0, 10), tool_call_id=call.id))
        if rng.random() < 0.2:  # a reminder in the middle, or trailing before the next request
            msgs.append(Message(rng.choice(system_roles), "<system-reminder>" + text(rng)
                                + "</system-reminder>"))
        if calls and rng.random() < 0.6:
            continue  # the agent loop goes on without a new user message
        msgs.append(Message("user", text(rng)))
    return msgs


def request_points(msgs: list[Message]) -> list[int]:
    """Lengths at which a client sends a request: after a user, tool or system message,
    and not between a tool result and the user text that shares its message."""
    points = []
    for k in range(1, len(msgs) + 1):
        last, nxt = msgs[k - 1], msgs[k] if k < len(msgs) else None
        if last.role == "assistant":
            continue
        if last.role == "tool" and nxt is not None and nxt.role in ("tool", "user"):
            continue
        points.append(k)
    return points


# --- Anthropic Messages (Claude Code) ------------------------------------------------

def billing_line(rng: random.Random) -> str:
    # The per-request part: the 3-hex suffix of cc_version changes between requests.
    return f"x-anthropic-billing-header: cc_version=2.1.332.{rng.randrange(4096):03x}; " \
           "cc_entrypoint=sdk-cli;"


def _cache(rng: random.Random, block: dict) -> dict:
    if rng.random() < 0.3:
        block["cache_control"] = {"type": "ephemeral"}
    return block


def anthropic_body(msgs: list[Message], rng: random.Random) -> dict:
    body = {"model": "qwen-local", "max_tokens": 32000, "stream": True,
            "thinking": {"type": "adaptive", "display": "omitted"},
            "output_config": {"effort": "high"}, "metadata": {"user_id": "{}"},
            "context_management": {"edits": []},
            "tools": [_cache(rng, {"name": t.name, "description": t.description,
                                   "input_schema": t.parameters}) for t in TOOLS]}
    rest = msgs
    if msgs and msgs[0].role == "system":
        body["system"] = [{"type": "text", "text": billing_line(rng)},
                          _cache(rng, {"type": "text", "text": msgs[0].content})]
        rest = msgs[1:]
    out: list[dict] = []
    for m in rest:
        if m.role == "assistant":
            blocks = []
            if m.reasoning:
                blocks.append({"type": "thinking", "thinking": m.reasoning, "signature": "sig"})
            if m.content:
                blocks.append(_cache(rng, {"type": "text", "text": m.content}))
            blocks += [_cache(rng, {"type": "tool_use", "id": c.id, "name": c.name,
                                    "input": c.arguments}) for c in m.tool_calls]
            out.append({"role": "assistant", "content": blocks})
        elif m.role == "tool":
            block = _cache(rng, {"type": "tool_result", "tool_use_id": m.tool_call_id,
                                 "content": m.content})
            if out and out[-1]["role"] == "user" and out[-1].get("_open"):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block], "_open": True})
        elif m.role == "user":
            block = _cache(rng, {"type": "text", "text": m.content})
            if out and out[-1]["role"] == "user" and out[-1].get("_open"):
                out[-1]["content"].append(block)  # text after the tool results, same message
                out[-1]["_open"] = False
            else:
                out.append({"role": "user", "content": [block]})
        else:
            out.append({"role": "system", "content": m.content})
    for m in out:
        m.pop("_open", None)
    body["messages"] = out
    return body


# --- OpenAI Chat Completions ---------------------------------------------------------

def openai_body(msgs: list[Message]) -> dict:
    out = []
    for m in msgs:
        if m.role == "assistant":
            msg = {"role": "assistant", "content": m.content or None,
                   "reasoning_content": m.reasoning}
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name,
                                                   "arguments": json.dumps(c.arguments)}}
                                     for c in m.tool_calls]
            out.append(msg)
        elif m.role == "tool":
            out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": m.content})
        else:
            out.append({"role": m.role, "content": m.content})
    return {"model": "qwen-local", "messages": out, "stream": True,
            "chat_template_kwargs": {"enable_thinking": True},
            "tools": [{"type": "function", "function": {"name": t.name,
                                                        "description": t.description,
                                                        "parameters": t.parameters}}
                      for t in TOOLS]}


# --- OpenAI Responses (Codex) --------------------------------------------------------

def responses_body(msgs: list[Message]) -> dict:
    items = []
    for m in msgs:
        if m.role == "assistant":
            if m.reasoning:
                items.append({"type": "reasoning", "id": "rs_1", "summary": [],
                              "content": [{"type": "reasoning_text", "text": m.reasoning}],
                              "encrypted_content": None})
            if m.content:
                items.append({"type": "message", "role": "assistant", "id": "msg_1",
                              "content": [{"type": "output_text", "text": m.content,
                                           "annotations": []}]})
            items += [{"type": "function_call", "call_id": c.id, "name": c.name,
                       "arguments": json.dumps(c.arguments)} for c in m.tool_calls]
        elif m.role == "tool":
            items.append({"type": "function_call_output", "call_id": m.tool_call_id,
                          "output": m.content})
        else:
            items.append({"type": "message", "role": m.role,
                          "content": [{"type": "input_text", "text": m.content}]})
    return {"model": "qwen-local", "input": items, "stream": True, "store": False,
            "reasoning": {"effort": "medium", "summary": "auto"},
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "abc",
            "tools": [{"type": "function", "name": t.name, "description": t.description,
                       "strict": False, "parameters": t.parameters} for t in TOOLS]
            + [{"type": "web_search", "external_web_access": False}]}
