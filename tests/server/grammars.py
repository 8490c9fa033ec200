"""Checkers for the three streaming grammars, written from the specs in clients.md.

Each takes the parsed SSE events of one response, asserts the grammar and
returns what the stream said (text, reasoning, tool calls, finish, usage), so
tests can compare streaming with non-streaming.
"""

from __future__ import annotations

import json


def check_anthropic(events: list[tuple[str | None, str]]) -> dict:
    assert events, "empty stream"
    payloads = []
    for name, data in events:
        assert name is not None, f"Claude Code needs an event: line ({data[:80]})"
        obj = json.loads(data)
        assert obj["type"] == name, (name, obj)
        payloads.append(obj)
    assert payloads[0]["type"] == "message_start"
    start = payloads[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["role"] == "assistant"
    assert payloads[-1]["type"] == "message_stop"
    assert payloads[-2]["type"] == "message_delta"
    out = {"thinking": "", "text": "", "tools": [], "signatures": [], "usage_start": start["usage"],
           "kinds": []}
    expected_index = 0
    open_block = None
    for p in payloads[1:-2]:
        t = p["type"]
        if t == "ping":
            continue
        if t == "content_block_start":
            assert open_block is None, "blocks must not interleave"
            assert p["index"] == expected_index, "indices are contiguous from 0"
            block = p["content_block"]
            open_block = {"kind": block["type"], "json": "", "signature": None, "block": block}
            out["kinds"].append(block["type"])
            if block["type"] == "tool_use":
                assert block["input"] == {} and block["id"].startswith("toolu_") and block["name"]
        elif t == "content_block_delta":
            assert open_block is not None and p["index"] == expected_index
            d = p["delta"]
            kind = open_block["kind"]
            if d["type"] == "thinking_delta":
                assert kind == "thinking" and open_block["signature"] is None
                out["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                assert kind == "thinking" and d["signature"]
                open_block["signature"] = d["signature"]
            elif d["type"] == "text_delta":
                assert kind == "text"
                out["text"] += d["text"]
            elif d["type"] == "input_json_delta":
                assert kind == "tool_use"
                open_block["json"] += d["partial_json"]
            else:
                raise AssertionError(f"unexpected delta {d}")
        elif t == "content_block_stop":
            assert open_block is not None and p["index"] == expected_index
            if open_block["kind"] == "thinking":
                assert open_block["signature"], "a thinking block ends with a signature_delta"
                out["signatures"].append(open_block["signature"])
            if open_block["kind"] == "tool_use":
                args = json.loads(open_block["json"]) if open_block["json"] else {}
                assert isinstance(args, dict)
                out["tools"].append((open_block["block"]["name"], args))
            open_block = None
            expected_index += 1
        else:
            raise AssertionError(f"unexpected event {t}")
    assert open_block is None
    delta = payloads[-2]
    out["stop_reason"] = delta["delta"]["stop_reason"]
    out["stop_sequence"] = delta["delta"]["stop_sequence"]
    out["usage"] = delta["usage"]
    return out


def check_chat(events: list[tuple[str | None, str]], *, include_usage: bool = False) -> dict:
    assert events and events[-1][1] == "[DONE]"
    chunks = [json.loads(d) for name, d in events[:-1]]
    assert all(name is None for name, _ in events), "Chat Completions streams use data: lines only"
    out = {"text": "", "reasoning": "", "tools": {}, "finish": None, "usage": None}
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1
    for c in chunks:
        assert c["object"] == "chat.completion.chunk"
        if include_usage:
            assert "usage" in c
        if not c["choices"]:
            assert include_usage and c is chunks[-1]
            out["usage"] = c["usage"]
            continue
        assert out["finish"] is None, "nothing after the finish_reason chunk but usage"
        if include_usage:
            assert c["usage"] is None
        choice = c["choices"][0]
        d = choice["delta"]
        out["text"] += d.get("content") or ""
        out["reasoning"] += d.get("reasoning_content") or ""
        for tc in d.get("tool_calls") or []:
            slot = out["tools"].get(tc["index"])
            if slot is None:
                assert tc["id"] and tc["type"] == "function" and tc["function"]["name"]
                slot = out["tools"][tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
            else:
                assert "id" not in tc and "name" not in tc["function"]
            slot["arguments"] += tc["function"].get("arguments", "")
        if choice["finish_reason"] is not None:
            assert d == {}
            out["finish"] = choice["finish_reason"]
    assert out["finish"] is not None
    if include_usage:
        assert out["usage"] is not None
    for slot in out["tools"].values():
        slot["arguments"] = json.loads(slot["arguments"])
    return out


def check_responses(events: list[tuple[str | None, str]]) -> dict:
    payloads = []
    for name, data in events:
        obj = json.loads(data)
        assert name == obj["type"], (name, obj["type"])
        payloads.append(obj)
    seqs = [p["sequence_number"] for p in payloads]
    assert seqs == list(range(len(seqs))), "sequence_number counts up from 0"
    assert payloads[0]["type"] == "response.created"
    final = payloads[-1]
    assert final["type"] in ("response.completed", "response.incomplete", "response.failed")
    rid = payloads[0]["response"]["id"]
    assert final["response"]["id"] == rid
    added, done = {}, {}
    text_deltas, arg_deltas, reasoning_deltas = {}, {}, {}
    for p in payloads[1:-1]:
        t = p["type"]
        if t == "response.in_progress":
            continue
        if t == "response.output_item.added":
            assert p["output_index"] == len(added), "items are added in order"
            added[p["output_index"]] = p["item"]
        elif t == "response.output_item.done":
            assert p["output_index"] in added and p["output_index"] not in done
            assert p["item"]["id"] == added[p["output_index"]]["id"]
            done[p["output_index"]] = p["item"]
        elif t == "response.output_text.delta":
            text_deltas[p["item_id"]] = text_deltas.get(p["item_id"], "") + p["delta"]
        elif t == "response.reasoning_text.delta":
            reasoning_deltas[p["item_id"]] = reasoning_deltas.get(p["item_id"], "") + p["delta"]
        elif t == "response.function_call_arguments.delta":
            arg_deltas[p["item_id"]] = arg_deltas.get(p["item_id"], "") + p["delta"]
        elif t == "response.function_call_arguments.done":
            assert arg_deltas.get(p["item_id"], "") == p["arguments"]
        elif t in ("response.content_part.added", "response.content_part.done", "response.output_text.done",
                   "response.reasoning_text.done", "response.custom_tool_call_input.delta",
                   "response.custom_tool_call_input.done"):
            pass
        else:
            raise AssertionError(f"unexpected event {t}")
    assert sorted(added) == sorted(done), "every added item is done"
    items = [done[i] for i in sorted(done)]
    assert final["response"]["output"] == items
    for item in items:
        if item["type"] == "message":
            assert item["content"][0]["text"] == text_deltas.get(item["id"], "")
        if item["type"] == "reasoning":
            assert item["content"][0]["text"] == reasoning_deltas.get(item["id"], "")
        if item["type"] == "function_call":
            json.loads(item["arguments"])
    return {"items": items, "status": final["response"]["status"], "usage": final["response"].get("usage"),
            "final": final, "events": [p["type"] for p in payloads]}
