"""Output control on the wire, read the same way for every API.

- structured output: OpenAI `response_format` {json_object | json_schema}, Anthropic
  `output_config.format` {json_schema}, Responses `text.format` {json_object | json_schema};
  `strict` true or false alike is enforced (the engine has no best-effort mode);
- tool_choice: OpenAI / Responses "required" or a named function, Anthropic "any" or
  {"type": "tool"}, enforced by the tool-call grammar in the checkpoint's dialect; "none" hides
  the tools (server/request.py); a tool choice that forces a call wins over a response format;
- logprobs: Chat Completions `logprobs` + `top_logprobs` (0..20), Completions `logprobs` (0..5),
  Responses `top_logprobs` (0..20) or `include: ["message.output_text.logprobs"]`; the Anthropic
  API has no such field;
- penalties: `presence_penalty`, `frequency_penalty` (-2..2) and `repetition_penalty` (> 0, vLLM's
  extension) on the two OpenAI APIs and Responses; Anthropic has none.

A schema the grammar engine cannot compile is a 400 naming the field; so is a named tool the
request does not declare, or a forced call with no tools.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from q27py.engine.api import OutputConstraint
from q27py.engine.grammar import GrammarError, json_grammar, tool_call_grammar
from q27py.server.errors import bad_request

MAX_TOP_LOGPROBS = 20
MAX_COMPLETIONS_LOGPROBS = 5
RESPONSES_LOGPROBS_INCLUDE = "message.output_text.logprobs"


@dataclass
class ResponseFormat:
    kind: str  # "json_object" | "json_schema"
    schema: dict | None
    param: str  # the field it came from (error messages)


def _obj(value: Any, param: str) -> dict:
    if not isinstance(value, dict):
        raise bad_request(f"{param}: expected an object", param)
    return value


def _format(fmt: Any, param: str, *, nested_schema: bool) -> ResponseFormat | None:
    """One format object; nested_schema: OpenAI Chat's {"json_schema": {"schema": ..}} shape."""
    if fmt is None:
        return None
    fmt = _obj(fmt, param)
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", None, param)
    if kind != "json_schema":
        raise bad_request(f"{param}.type: expected text, json_object or json_schema (got {kind!r})", param + ".type")
    holder, where = fmt, param
    if nested_schema:
        holder = _obj(fmt.get("json_schema"), param + ".json_schema")
        where = param + ".json_schema"
    schema = holder.get("schema")
    if schema is None:
        schema = {}
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{where}.schema: expected an object", where + ".schema")
    strict = holder.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.strict: expected a boolean", where + ".strict")
    return ResponseFormat("json_schema", schema if isinstance(schema, dict) else {}, where + ".schema")


def openai_format(body: dict) -> ResponseFormat | None:
    return _format(body.get("response_format"), "response_format", nested_schema=True)


def responses_format(body: dict) -> ResponseFormat | None:
    text = body.get("text")
    if text is None:
        return None
    return _format(_obj(text, "text").get("format"), "text.format", nested_schema=False)


def anthropic_format(body: dict) -> ResponseFormat | None:
    config = body.get("output_config")
    if not isinstance(config, dict):
        return None  # Claude Code sends {"effort": ..}; other shapes are ignored like unknown keys
    fmt = config.get("format")
    if fmt is None:
        return None
    fmt = _obj(fmt, "output_config.format")
    if fmt.get("type") != "json_schema":
        raise bad_request(f"output_config.format.type: expected json_schema (got {fmt.get('type')!r})",
                          "output_config.format.type")
    return _format(fmt, "output_config.format", nested_schema=False)


# --- logprobs and penalties ----------------------------------------------------------------

def _int(body: dict, key: str, lo: int, hi: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{key}: expected an integer", key)
    if not lo <= value <= hi:
        raise bad_request(f"{key}: must be in {lo}..{hi} (got {value})", key)
    return value


def chat_logprobs(body: dict) -> int | None:
    """Chat Completions: None when off, else how many alternatives per token."""
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise bad_request("logprobs: expected a boolean", "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and on is not True:
        raise bad_request("top_logprobs: requires logprobs: true", "top_logprobs")
    return (top or 0) if on else None


def completions_logprobs(body: dict) -> int | None:
    return _int(body, "logprobs", 0, MAX_COMPLETIONS_LOGPROBS)


def responses_logprobs(body: dict) -> int | None:
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    include = body.get("include")
    wanted = isinstance(include, list) and RESPONSES_LOGPROBS_INCLUDE in include
    if top is None and not wanted:
        return None
    return top or 0


@dataclass
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0


def _num(body: dict, key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{key}: expected a number", key)
    return float(value)


def penalties(body: dict) -> Penalties:
    p = Penalties(_num(body, "presence_penalty", 0.0), _num(body, "frequency_penalty", 0.0),
                  _num(body, "repetition_penalty", 1.0))
    for key, value in (("presence_penalty", p.presence), ("frequency_penalty", p.frequency)):
        if not -2.0 <= value <= 2.0:
            raise bad_request(f"{key}: must be in -2..2 (got {value})", key)
    if not p.repetition > 0.0:
        raise bad_request(f"repetition_penalty: must be > 0 (got {p.repetition})", "repetition_penalty")
    return p


# --- the constraint -------------------------------------------------------------------------

def constraint_for(tool_choice, tools, fmt: ResponseFormat | None, *, dialect: str = "xml",
                   starts_in_reasoning: bool = False, one_call: bool = False) -> OutputConstraint | None:
    """The engine constraint a request asks for. tool_choice: chat.requests.ToolChoice;
    tools: the conversation's ToolSpecs."""
    mode = getattr(tool_choice, "mode", "auto")
    if mode in ("required", "tool"):
        declared = {t.name: (t.parameters if isinstance(t.parameters, dict) else {}) for t in tools}
        if not declared:
            raise bad_request("tool_choice: a tool call is required but the request declares no tools", "tool_choice")
        names: tuple[str, ...] = ()
        if mode == "tool":
            if tool_choice.name not in declared:
                raise bad_request(f"tool_choice: tool {tool_choice.name!r} is not among the declared tools",
                                  "tool_choice")
            names = (tool_choice.name,)
        else:
            # Deferred tools are not in the prompt: a forced call picks among the listed ones.
            listed = [t.name for t in tools if not getattr(t, "deferred", False)]
            names = tuple(listed) if listed and len(listed) < len(declared) else ()
        spec = OutputConstraint("tool_calls", tools=declared, names=names, max_calls=1 if one_call else None,
                                after_think=starts_in_reasoning, dialect=dialect)
        _check(spec, "tools")
        return spec
    if fmt is None:
        return None
    spec = OutputConstraint(fmt.kind, schema=fmt.schema, after_think=starts_in_reasoning)
    _check(spec, fmt.param)
    return spec


def _check(spec: OutputConstraint, param: str) -> None:
    """Compile once here so an unusable schema is a 400 before anything streams."""
    try:
        if spec.kind == "tool_calls":
            tool_call_grammar(spec.tools or {}, list(spec.names) or None, spec.max_calls, spec.dialect)
        else:
            json_grammar(spec.schema if spec.kind == "json_schema" else None)
    except GrammarError as exc:
        raise bad_request(f"{param}: {exc} (this server enforces the JSON Schema subset in docs/SERVER.md)",
                          param) from None
    except RecursionError:
        raise bad_request(f"{param}: schema nests too deeply", param) from None


# --- logprobs on the wire -------------------------------------------------------------------

def _token_entry(tokenizer, token: int, logprob: float) -> dict:
    data = tokenizer.token_bytes(token)
    return {"token": data.decode("utf-8", errors="replace"), "logprob": _finite(logprob), "bytes": list(data)}


def _finite(x: float) -> float:
    # JSON has no -Infinity; a token of zero probability reports the most negative double.
    return x if math.isfinite(x) else -1.7976931348623157e308


def content_logprobs(records, tokenizer) -> list[dict]:
    """Chat Completions `choices[].logprobs.content` / Responses `output_text.logprobs` entries."""
    out = []
    for r in records:
        entry = _token_entry(tokenizer, r.token, r.logprob)
        entry["top_logprobs"] = [_token_entry(tokenizer, t, lp) for t, lp in r.top]
        out.append(entry)
    return out


def legacy_logprobs(entries: list[dict], text_offset: int = 0) -> dict:
    """Completions' `choices[].logprobs` from content entries: parallel lists, top_logprobs as
    {token: logprob}, text_offset counted in characters from `text_offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    pos = text_offset
    for e in entries:
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        top: dict = {}
        for alt in e["top_logprobs"]:
            top.setdefault(alt["token"], alt["logprob"])
        out["top_logprobs"].append(top)
        out["text_offset"].append(pos)
        pos += len(e["token"])
    return out
