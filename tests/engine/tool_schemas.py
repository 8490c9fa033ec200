"""A corpus of tool parameter schemas shaped like what agent clients send, and a seeded
generator of more, with a small independent validator for the subset the grammar enforces.

The Claude Code and Codex entries follow the tool lists in ../shared/reference/clients.md
(names and argument keys as observed there); descriptions are left out (they do not change
the language). Written here for the tests; not copied from either client.
"""

from __future__ import annotations

import json
import random

S = {"type": "string"}
N = {"type": "number"}
I = {"type": "integer"}
B = {"type": "boolean"}


def obj(props, required=(), **extra):
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False,
            "$schema": "https://json-schema.org/draft/2020-12/schema", **extra}


CLAUDE_CODE = {
    "Agent": obj({"description": S, "prompt": S, "subagent_type": S}, ["description", "prompt"]),
    "Bash": obj({"command": S, "timeout": N, "description": S, "run_in_background": B}, ["command"]),
    "Edit": obj({"file_path": S, "old_string": S, "new_string": S, "replace_all": {"type": "boolean", "default": False}},
                ["file_path", "old_string", "new_string"]),
    "Read": obj({"file_path": S, "offset": I, "limit": I}, ["file_path"]),
    "Write": obj({"file_path": S, "content": S}, ["file_path", "content"]),
    "ToolSearch": obj({"query": S, "max_results": I}, ["query"]),
    "Skill": obj({"skill": S, "args": S}, ["skill"]),
    "ScheduleWakeup": obj({"delay_seconds": I, "reason": S}, ["delay_seconds"]),
    "WebFetch": obj({"url": {"type": "string", "format": "uri"}, "prompt": S}, ["url", "prompt"]),
    "WebSearch": obj({"query": {"type": "string", "minLength": 2}, "allowed_domains": {"type": "array", "items": S},
                      "blocked_domains": {"type": "array", "items": S}}, ["query"]),
    "NotebookEdit": obj({"notebook_path": S, "cell_id": S, "new_source": S,
                         "cell_type": {"type": "string", "enum": ["code", "markdown"]},
                         "edit_mode": {"type": "string", "enum": ["replace", "insert", "delete"]}},
                        ["notebook_path", "new_source"]),
    "TaskStop": obj({"task_id": S}, ["task_id"]),
    "CronCreate": obj({"cron": S, "prompt": S, "recurring": B}, ["cron", "prompt"]),
    "ReportFindings": obj({"findings": {"type": "array", "items": obj(
        {"file": S, "line": I, "severity": {"enum": ["low", "medium", "high"]}, "message": S},
        ["file", "message"])}}, ["findings"]),
    "Workflow": obj({"steps": {"type": "array", "minItems": 1, "items": {"anyOf": [
        obj({"tool": S, "input": {"type": "object"}}, ["tool"]), S]}}}, ["steps"]),
    "Title": obj({"title": S}, ["title"]),  # the title request's output_config.format schema
}

CODEX = {
    "exec_command": obj({"cmd": S, "workdir": S, "tty": B, "yield_time_ms": I, "max_output_tokens": I,
                         "sandbox_permissions": {"type": "string", "enum": ["use_default", "require_escalated"]},
                         "justification": S}, ["cmd"]),
    "write_stdin": obj({"session_id": I, "chars": S, "yield_time_ms": I}, ["session_id"]),
    "request_user_input": obj({"questions": {"type": "array", "items": obj(
        {"id": S, "question": S, "options": {"type": "array", "items": obj({"label": S, "description": S},
                                                                            ["label"])}}, ["id", "question"])}},
                              ["questions"]),
    "view_image": obj({"path": S}, ["path"]),
    "multi_agent_v1__spawn_agent": obj({"message": S, "agent_type": {"type": ["string", "null"]}}, ["message"]),
    "multi_agent_v1__wait_agent": obj({"ids": {"type": "array", "items": S}, "timeout_ms": {"type": ["integer", "null"]}},
                                      ["ids"]),
    "update_goal": obj({"status": {"type": "string", "enum": ["active", "complete", "blocked"]},
                        "note": {"anyOf": [S, {"type": "null"}]}}, ["status"]),
    "apply_patch": obj({"input": S}, ["input"]),  # the freeform (custom) tool as the server maps it
    "get_goal": obj({}, []),
}

CORPUS = {**{"cc:" + k: v for k, v in CLAUDE_CODE.items()}, **{"codex:" + k: v for k, v in CODEX.items()}}


def generated_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random schema of the enforced subset."""
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "array", "object", "anyOf", "typelist"]
    if depth >= 3:
        kinds = kinds[:6]
    k = rng.choice(kinds)
    if k == "enum":
        return {"enum": rng.sample(["a", "b c", 'q"uote', 1, 2.5, True, None, "日本"], rng.randint(1, 4))}
    if k == "array":
        s = {"type": "array", "items": generated_schema(rng, depth + 1)}
        if rng.random() < 0.3:
            s["minItems"] = rng.randint(0, 2)
        if rng.random() < 0.3:
            s["maxItems"] = s.get("minItems", 0) + rng.randint(0, 2)
        return s
    if k == "object":
        names = rng.sample(["a", "path", "x_y", "Name", "with space", "ü", "n1", "deep"], rng.randint(0, 4))
        props = {n: generated_schema(rng, depth + 1) for n in names}
        return {"type": "object", "properties": props, "required": [n for n in names if rng.random() < 0.5]}
    if k == "anyOf":
        return {"anyOf": [generated_schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    if k == "typelist":
        return {"type": rng.sample(["string", "integer", "null", "boolean"], 2)}
    return {"type": k}


def generated_tool_schema(rng: random.Random) -> dict:
    names = rng.sample(["command", "path", "count", "flag", "items", "mode", "opts"], rng.randint(1, 4))
    props = {n: generated_schema(rng, 1) for n in names}
    return {"type": "object", "properties": props, "required": [n for n in names if rng.random() < 0.6]}


# --- a small validator (independent of the grammar code) ---------------------------------

def _type_ok(value, t) -> bool:
    return {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
    }[t](value)


def valid(value, schema) -> bool:
    if schema is True or schema == {} or schema is None:
        return True
    if "const" in schema:
        return value == schema["const"] and type(value) is type(schema["const"])
    if "enum" in schema:
        return any(value == e and type(value) is type(e) for e in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return any(valid(value, br) for br in schema[key])
    t = schema.get("type")
    if t is None:
        t = "object" if "properties" in schema else None
    if t is None:
        return True
    types = t if isinstance(t, list) else [t]
    if not any(_type_ok(value, x) for x in types):
        return False
    if isinstance(value, dict) and "object" in types:
        props = schema.get("properties") or {}
        if any(r not in value for r in schema.get("required") or []):
            return False
        for k, v in value.items():
            if k in props:
                if not valid(v, props[k]):
                    return False
            elif props or schema.get("additionalProperties") is False:
                return False
    if isinstance(value, list) and "array" in types:
        if len(value) < schema.get("minItems", 0):
            return False
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            return False
        return all(valid(v, schema.get("items", True)) for v in value)
    return True


def instance(rng: random.Random, schema, depth=0):
    """A random value valid for schema (the generator side of the validator)."""
    if schema is True or schema == {} or schema is None:
        return rng.choice([1, "x", None, {"k": [1, 2]}])
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return instance(rng, rng.choice(schema[key]), depth)
    t = schema.get("type", "object" if "properties" in schema else None)
    if isinstance(t, list):
        t = rng.choice(t)
    if t == "string":
        return rng.choice(["", "ls -la", 'say "hi"\n', "back\\slash", "tab\tend", "日本語 😀", "</parameter", "<b>x</b>"])
    if t == "integer":
        return rng.choice([0, -7, 42, 10**12])
    if t == "number":
        return rng.choice([0, 1.5, -2e-3, 3])
    if t == "boolean":
        return rng.random() < 0.5
    if t == "null":
        return None
    if t == "array":
        lo = schema.get("minItems", 0)
        hi = schema.get("maxItems", lo + 2)
        return [instance(rng, schema.get("items", True), depth + 1) for _ in range(rng.randint(lo, hi))]
    if t == "object" or t is None:
        props = schema.get("properties") or {}
        req = set(schema.get("required") or [])
        out = {k: instance(rng, v, depth + 1) for k, v in props.items() if k in req or rng.random() < 0.5}
        if not props and depth < 2 and schema.get("additionalProperties") is not False:
            out = {"free": instance(rng, True, depth + 1)}
        keys = list(out)
        rng.shuffle(keys)
        return {k: out[k] for k in keys}
    return None


def dumps_variants(value, rng: random.Random) -> str:
    return rng.choice([
        lambda: json.dumps(value),
        lambda: json.dumps(value, ensure_ascii=False),
        lambda: json.dumps(value, separators=(",", ":")),
        lambda: json.dumps(value, indent=2, ensure_ascii=False),
    ])()
