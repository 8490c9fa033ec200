"""Request bodies of the three APIs -> (Conversation, ToolChoice): the chat part.

One mapping per API: Anthropic Messages, OpenAI Chat Completions, OpenAI
Responses. Only what the chat template renders is read here (messages, system /
instructions, tools, tool_choice); the options around it (sampling, limits,
thinking, streaming) are read, range-checked, once by the API's own module in
q27py/server/, which calls parse_conversation as one step of its single pass. What real clients send (../shared/reference/clients.md) decides the
tolerance: unknown keys, unknown history items and hosted tools are ignored
(with a log line where something the client sent is dropped), because a 400 on
a later turn kills an agent session; structure we cannot read raises
RequestError naming the parameter, so the server can answer 400 in the API's
own error shape. Images raise a RequestError: this model reads text only.

Conventions shared by the three (docs/CHAT.md has the full list):
- text blocks of one Anthropic message / Responses item join with a blank line;
  Chat Completions content parts join with nothing, as the chat template does;
- Claude Code's `x-anthropic-billing-header:` line (per-request fields) is
  dropped from the system prompt so the prompt prefix stays byte-stable;
- namespaced Responses tools are flattened to "namespace__name"; custom
  (freeform) tools become a function with one string parameter `input`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from q27py.chat.conversation import (
    CUSTOM_TOOL_INPUT,
    NAMESPACE_SEPARATOR,
    Conversation,
    Message,
    ToolCall,
    ToolSpec,
)
from q27py.errors import Q27Error

log = logging.getLogger(__name__)

APIS = ("anthropic", "openai", "responses")
BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
BLOCK_SEPARATOR = "\n\n"  # between text blocks of one Anthropic message or Responses item


class RequestError(Q27Error):
    """A request body we cannot map; `param` names the offending field (OpenAI style)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message if param is None else f"{param}: {message}")
        self.message = message
        self.param = param


@dataclass
class ToolChoice:
    mode: str = "auto"  # "auto" | "none" | "required" | "tool"
    name: str | None = None  # mode "tool": the (model-facing) name of the tool to call


def parse_conversation(api: str, body: Any) -> tuple[Conversation, ToolChoice]:
    """Map the chat part of a request body of `api` ("anthropic" | "openai" | "responses")."""
    parsers = {"anthropic": from_anthropic, "openai": from_openai_chat, "responses": from_responses}
    if api not in parsers:
        raise RequestError(f"unknown API {api!r}; known: {', '.join(APIS)}")
    return parsers[api](body)


def strip_billing_header(text: str) -> str:
    """Drop leading `x-anthropic-billing-header: ...` lines (their fields change per request)."""
    while text.startswith(BILLING_HEADER_PREFIX):
        _, _, text = text.partition("\n")
    return text


# ---------------------------------------------------------------------------
# Field readers: each raises RequestError naming the parameter.


def _object(value: Any, param: str) -> dict:
    if not isinstance(value, dict):
        raise RequestError("expected an object", param)
    return value


def _list(value: Any, param: str) -> list:
    if not isinstance(value, list):
        raise RequestError("expected an array", param)
    return value


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise RequestError("expected a string", param)
    return value


def _opt(body: dict, key: str, kind: type, param: str | None = None) -> Any:
    """body[key] if present and not null, checked to be `kind` (bool is not a number here)."""
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise RequestError(f"expected {_KIND_NAMES[kind]}", param or key)
    return value


_KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               dict: "an object", list: "an array"}


# JSON Schema keywords whose values the tool-call parser (chat/toolcall.py) walks, by shape.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [schema, ...]
_SCHEMA_ONE = ("not", "if", "then", "else", "contains", "propertyNames")  # schema
_MAX_SCHEMA_DEPTH = 64


def _schema(value: Any, param: str, depth: int = 0) -> dict | bool:
    """A tool's parameter schema, checked where the parser will walk it: a schema whose
    `anyOf` is 5 would crash the call parser on the first call to that tool, so it is a 400
    naming the keyword instead (issue 13.3). Unknown keywords are left alone."""
    if isinstance(value, bool):
        return value  # JSON Schema allows true / false as a schema
    if not isinstance(value, dict):
        raise RequestError("expected a JSON Schema object", param)
    if depth > _MAX_SCHEMA_DEPTH:
        raise RequestError(f"schema nested deeper than {_MAX_SCHEMA_DEPTH} levels", param)
    t = value.get("type")
    if t is not None and not isinstance(t, str) and not (
            isinstance(t, list) and all(isinstance(x, str) for x in t)):
        raise RequestError("expected a type name or a list of them", f"{param}.type")
    for key in _SCHEMA_MAPS:
        if key in value:
            sub = value[key]
            if not isinstance(sub, dict):
                raise RequestError("expected an object of schemas", f"{param}.{key}")
            for name, inner in sub.items():
                _schema(inner, f"{param}.{key}.{name}", depth + 1)
    for key in _SCHEMA_LISTS:
        if key in value:
            sub = value[key]
            if not isinstance(sub, list):
                raise RequestError("expected an array of schemas", f"{param}.{key}")
            for k, inner in enumerate(sub):
                _schema(inner, f"{param}.{key}[{k}]", depth + 1)
    for key in _SCHEMA_ONE:
        if key in value:
            _schema(value[key], f"{param}.{key}", depth + 1)
    if "items" in value:
        items = value["items"]
        for k, inner in enumerate(items) if isinstance(items, list) else [(None, items)]:
            _schema(inner, f"{param}.items" + ("" if k is None else f"[{k}]"), depth + 1)
    if "additionalProperties" in value:
        _schema(value["additionalProperties"], f"{param}.additionalProperties", depth + 1)
    if "required" in value and not (isinstance(value["required"], list)
                                    and all(isinstance(x, str) for x in value["required"])):
        raise RequestError("expected an array of property names", f"{param}.required")
    if "enum" in value and not isinstance(value["enum"], list):
        raise RequestError("expected an array", f"{param}.enum")
    return value


def _parameters(tool: dict, key: str, param: str) -> dict | None:
    """A tool's parameters (`input_schema` / `parameters`): an object schema, checked."""
    value = _opt(tool, key, dict, f"{param}.{key}")
    return None if value is None else _schema(value, f"{param}.{key}")


def _arguments(value: Any, param: str) -> dict:
    """Tool-call arguments given as an object or as a JSON string of one."""
    if isinstance(value, dict):
        return value
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            raise RequestError("tool-call arguments are not valid JSON", param) from None
        if isinstance(parsed, dict):
            return parsed
    raise RequestError("tool-call arguments must be a JSON object", param)


def _image_error(param: str) -> RequestError:
    return RequestError("images are not supported: this model reads text only", param)


def _finish(conv: Conversation, param: str) -> Conversation:
    if not conv.messages:
        raise RequestError("the conversation has no messages", param)
    first = conv.messages[0]
    if first.role in ("system", "developer"):  # OpenAI-shaped relays of Claude Code keep it
        first.content = strip_billing_header(first.content)
    names = [spec.name for spec in conv.tools]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise RequestError(f"duplicate tool names: {', '.join(dupes)}", "tools")
    return conv


def _tool_choice(value: Any, param: str) -> ToolChoice:
    """OpenAI-style choice: "auto" | "none" | "required" | {"type": "function", ...}."""
    if value is None:
        return ToolChoice()
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise RequestError("expected auto, none or required", param)
        return ToolChoice(value)
    choice = _object(value, param)
    kind = choice.get("type")
    if kind in ("auto", "none", "required"):
        return ToolChoice(kind)
    if kind in ("function", "custom"):
        inner = choice.get(kind) if isinstance(choice.get(kind), dict) else choice
        name = _string(inner.get("name"), f"{param}.name")
        namespace = inner.get("namespace")
        if isinstance(namespace, str):
            name = namespace + NAMESPACE_SEPARATOR + name
        return ToolChoice("tool", name)
    log.info("tool_choice of type %r is not supported; using auto", kind)
    return ToolChoice()


# ---------------------------------------------------------------------------
# Anthropic Messages


def from_anthropic(body: Any) -> tuple[Conversation, ToolChoice]:
    body = _object(body, "body")
    conv = Conversation(tools=_anthropic_tools(body.get("tools")))
    system = _anthropic_system(body.get("system"))
    if system:
        conv.messages.append(Message("system", system))
    for i, raw in enumerate(_list(body.get("messages"), "messages")):
        conv.messages.extend(_anthropic_message(raw, f"messages[{i}]", conv))
    tool_choice = _anthropic_tool_choice(body.get("tool_choice"))
    return _finish(conv, "messages"), tool_choice


def _anthropic_system(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return strip_billing_header(value)
    texts = []
    for j, block in enumerate(_list(value, "system")):
        block = _object(block, f"system[{j}]")
        if block.get("type") != "text":
            log.info("dropping system block of type %r", block.get("type"))
            continue
        text = strip_billing_header(_string(block.get("text"), f"system[{j}].text"))
        if text.strip():
            texts.append(text)
    return BLOCK_SEPARATOR.join(texts)


def _anthropic_tools(value: Any) -> list[ToolSpec]:
    specs = []
    for j, raw in enumerate(_list(value, "tools") if value is not None else []):
        tool = _object(raw, f"tools[{j}]")
        if tool.get("type") not in (None, "custom"):  # server tools: web_search_2025..., bash_...
            log.info("dropping Anthropic server tool %r (type %s)", tool.get("name"), tool.get("type"))
            continue
        specs.append(ToolSpec(
            name=_string(tool.get("name"), f"tools[{j}].name"),
            description=_opt(tool, "description", str, f"tools[{j}].description"),
            parameters=_parameters(tool, "input_schema", f"tools[{j}]"),
            deferred=bool(tool.get("defer_loading")),
        ))
    return specs


def _anthropic_tool_choice(value: Any) -> ToolChoice:
    if value is None:
        return ToolChoice()
    choice = _object(value, "tool_choice")
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return ToolChoice(kind)
    if kind == "any":
        return ToolChoice("required")
    if kind == "tool":
        return ToolChoice("tool", _string(choice.get("name"), "tool_choice.name"))
    raise RequestError("expected auto, any, tool or none", "tool_choice.type")


def _anthropic_blocks(content: Any, param: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    blocks = _list(content, param)
    return [_object(b, f"{param}[{k}]") for k, b in enumerate(blocks)]


def _anthropic_message(raw: Any, param: str, conv: Conversation) -> list[Message]:
    msg = _object(raw, param)
    role = msg.get("role")
    blocks = _anthropic_blocks(msg.get("content"), f"{param}.content")
    if role == "assistant":
        return [_anthropic_assistant(blocks, f"{param}.content")]
    if role == "user":
        return _anthropic_user(blocks, f"{param}.content", conv)
    if role == "system":  # mid-conversation / trailing system turns (Claude Code): kept in place
        return [Message("system", _anthropic_texts(msg.get("content"), f"{param}.content"))]
    raise RequestError("expected user, assistant or system", f"{param}.role")


def _anthropic_text(block: dict, param: str) -> str | None:
    """The text of a text-like block; None (logged) for blocks with nothing to render."""
    kind = block.get("type")
    if kind == "text":
        return _string(block.get("text"), f"{param}.text")
    if kind == "image":
        raise _image_error(param)
    if kind == "document":
        source = _object(block.get("source"), f"{param}.source")
        if source.get("type") == "text":
            return _string(source.get("data"), f"{param}.source.data")
        if source.get("type") == "content":
            return _anthropic_texts(source.get("content"), f"{param}.source.content")
        raise RequestError("only plain-text documents are supported: this model reads text only",
                           f"{param}.source.type")
    if kind == "search_result":
        return _anthropic_texts(block.get("content"), f"{param}.content")
    log.info("dropping content block of type %r at %s", kind, param)
    return None


def _anthropic_texts(content: Any, param: str) -> str:
    texts = [_anthropic_text(b, f"{param}[{k}]")
             for k, b in enumerate(_anthropic_blocks(content, param))]
    return BLOCK_SEPARATOR.join(t for t in texts if t is not None)


def _anthropic_user(blocks: list[dict], param: str, conv: Conversation) -> list[Message]:
    """Tool results become tool messages; text runs become user messages, in block order."""
    out: list[Message] = []
    texts: list[str] = []
    for k, block in enumerate(blocks):
        if block.get("type") == "tool_result":
            if texts:
                out.append(Message("user", BLOCK_SEPARATOR.join(texts)))
                texts = []
            out.append(_anthropic_tool_result(block, f"{param}[{k}]", conv))
        else:
            text = _anthropic_text(block, f"{param}[{k}]")
            if text is not None:
                texts.append(text)
    if texts or not out:
        out.append(Message("user", BLOCK_SEPARATOR.join(texts)))
    return out


def _anthropic_tool_result(block: dict, param: str, conv: Conversation) -> Message:
    content = block.get("content")
    parts = []
    for k, item in enumerate(_anthropic_blocks(content, f"{param}.content")
                             if content is not None else []):
        if item.get("type") == "tool_reference":  # tool search: show the loaded tool's definition
            parts.append(_tool_reference_text(item, f"{param}.content[{k}]", conv))
        else:
            text = _anthropic_text(item, f"{param}.content[{k}]")
            if text is not None:
                parts.append(text)
    return Message("tool", BLOCK_SEPARATOR.join(parts),
                   tool_call_id=_opt(block, "tool_use_id", str, f"{param}.tool_use_id"))


def _tool_reference_text(item: dict, param: str, conv: Conversation) -> str:
    # The definition goes into the tool result rather than the system prompt's tool
    # list, so loading a deferred tool never rewrites the start of the prompt.
    name = _string(item.get("tool_name"), f"{param}.tool_name")
    spec = conv.tool(name)
    if spec is None:
        return f"Tool {name} is not available."
    return "<tools>\n" + json.dumps(spec.template_dict(), ensure_ascii=False) + "\n</tools>"


def _anthropic_assistant(blocks: list[dict], param: str) -> Message:
    texts, thoughts, calls = [], [], []
    for k, block in enumerate(blocks):
        kind = block.get("type")
        where = f"{param}[{k}]"
        if kind == "text":
            texts.append(_string(block.get("text"), f"{where}.text"))
        elif kind == "thinking":
            thoughts.append(_string(block.get("thinking"), f"{where}.thinking"))
        elif kind == "tool_use":
            calls.append(ToolCall(name=_string(block.get("name"), f"{where}.name"),
                                  arguments=_arguments(block.get("input"), f"{where}.input"),
                                  id=block.get("id")))
        elif kind == "redacted_thinking":
            continue  # opaque to us: nothing to render
        else:
            log.info("dropping assistant block of type %r at %s", kind, where)
    # The reasoning is explicit here, so an empty string: a literal "</think>" in the
    # text must not be split out as reasoning.
    return Message("assistant", BLOCK_SEPARATOR.join(texts), reasoning="\n\n".join(thoughts),
                   tool_calls=calls)


# ---------------------------------------------------------------------------
# OpenAI Chat Completions


def from_openai_chat(body: Any) -> tuple[Conversation, ToolChoice]:
    body = _object(body, "body")
    conv = Conversation(tools=_openai_tools(body.get("tools")))
    for i, raw in enumerate(_list(body.get("messages"), "messages")):
        conv.messages.append(_openai_message(raw, f"messages[{i}]"))
    return _finish(conv, "messages"), _tool_choice(body.get("tool_choice"), "tool_choice")


def _openai_tools(value: Any) -> list[ToolSpec]:
    specs = []
    for j, raw in enumerate(_list(value, "tools") if value is not None else []):
        tool = _object(raw, f"tools[{j}]")
        kind = tool.get("type", "function")
        if kind == "function":
            fn = _object(tool.get("function"), f"tools[{j}].function")
            specs.append(ToolSpec(
                name=_string(fn.get("name"), f"tools[{j}].function.name"),
                description=_opt(fn, "description", str, f"tools[{j}].function.description"),
                parameters=_parameters(fn, "parameters", f"tools[{j}].function"),
            ))
        elif kind == "custom":
            specs.append(_custom_tool(_object(tool.get("custom"), f"tools[{j}].custom"),
                                      f"tools[{j}].custom"))
        else:
            log.info("dropping tool of unsupported type %r", kind)
    return specs


def _openai_content(content: Any, param: str) -> str:
    """Content parts join with nothing, exactly as the chat template joins them."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for k, part in enumerate(_list(content, param)):
        part = _object(part, f"{param}[{k}]")
        kind = part.get("type")
        if kind == "text":
            texts.append(_string(part.get("text"), f"{param}[{k}].text"))
        elif kind == "refusal":
            texts.append(_string(part.get("refusal"), f"{param}[{k}].refusal"))
        elif kind in ("image_url", "input_image", "image"):
            raise _image_error(f"{param}[{k}]")
        else:
            raise RequestError(f"unsupported content part type {kind!r}: this model reads text only",
                               f"{param}[{k}].type")
    return "".join(texts)


def _openai_message(raw: Any, param: str) -> Message:
    msg = _object(raw, param)
    role = msg.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise RequestError("expected system, developer, user, assistant or tool", f"{param}.role")
    content = _openai_content(msg.get("content"), f"{param}.content")
    if role == "tool":
        return Message("tool", content, tool_call_id=_opt(msg, "tool_call_id", str,
                                                          f"{param}.tool_call_id"))
    if role != "assistant":
        return Message(role, content)
    reasoning = msg.get("reasoning_content")
    if reasoning is None:
        reasoning = msg.get("reasoning")  # vLLM >= 0.11 spelling
    calls = []
    for k, raw_call in enumerate(_list(msg.get("tool_calls") or [], f"{param}.tool_calls")):
        where = f"{param}.tool_calls[{k}]"
        call = _object(raw_call, where)
        if call.get("type") == "custom":
            custom = _object(call.get("custom"), f"{where}.custom")
            calls.append(ToolCall(name=_string(custom.get("name"), f"{where}.custom.name"),
                                  arguments={CUSTOM_TOOL_INPUT: _string(custom.get("input", ""),
                                                                        f"{where}.custom.input")},
                                  id=call.get("id")))
            continue
        fn = _object(call.get("function"), f"{where}.function")
        calls.append(ToolCall(name=_string(fn.get("name"), f"{where}.function.name"),
                              arguments=_arguments(fn.get("arguments"), f"{where}.function.arguments"),
                              id=call.get("id")))
    # No reasoning field: None, so an inline <think>...</think> in content is split out
    # the way the template does it.
    return Message("assistant", content, reasoning=reasoning if isinstance(reasoning, str) else None,
                   tool_calls=calls)


# ---------------------------------------------------------------------------
# OpenAI Responses

_HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter",
                 "image_generation", "computer_use_preview", "computer_use", "mcp", "local_shell")


def from_responses(body: Any) -> tuple[Conversation, ToolChoice]:
    body = _object(body, "body")
    if body.get("previous_response_id") is not None:
        raise RequestError("not supported: this server keeps no responses; send the whole "
                           "conversation in `input`", "previous_response_id")

    conv = Conversation(tools=_responses_tools(body.get("tools")))
    instructions = _opt(body, "instructions", str)
    if instructions:
        conv.messages.append(Message("system", instructions))
    value = body.get("input")
    if isinstance(value, str):
        conv.messages.append(Message("user", value))
    else:
        _ResponsesHistory(conv).add_items(_list(value, "input"))
    return _finish(conv, "input"), _tool_choice(body.get("tool_choice"), "tool_choice")


def _custom_tool(tool: dict, param: str, namespace: str | None = None) -> ToolSpec:
    """A freeform tool shown to the model as a function taking one string, `input`."""
    name = _string(tool.get("name"), f"{param}.name")
    description = _opt(tool, "description", str, f"{param}.description") or ""
    fmt = _opt(tool, "format", dict, f"{param}.format") or {}
    note = f"This tool takes raw text, not JSON: pass the whole text as `{CUSTOM_TOOL_INPUT}`."
    if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        note += (f" The text must follow this {fmt.get('syntax', '')} grammar:\n"
                 + fmt["definition"])
    flat = name if namespace is None else namespace + NAMESPACE_SEPARATOR + name
    return ToolSpec(
        name=flat,
        description=(description + "\n\n" + note) if description else note,
        parameters={"type": "object",
                    "properties": {CUSTOM_TOOL_INPUT: {"type": "string",
                                                       "description": "The raw input text."}},
                    "required": [CUSTOM_TOOL_INPUT]},
        kind="custom",
        namespace=namespace,
        client_name=name if namespace else None,
    )


def _responses_function(tool: dict, param: str, namespace: str | None = None) -> ToolSpec:
    name = _string(tool.get("name"), f"{param}.name")
    return ToolSpec(
        name=name if namespace is None else namespace + NAMESPACE_SEPARATOR + name,
        description=_opt(tool, "description", str, f"{param}.description"),
        parameters=_parameters(tool, "parameters", param),
        namespace=namespace,
        client_name=name if namespace else None,
    )


def _responses_tools(value: Any) -> list[ToolSpec]:
    specs = []
    for j, raw in enumerate(_list(value, "tools") if value is not None else []):
        tool = _object(raw, f"tools[{j}]")
        kind = tool.get("type")
        if kind == "function":
            specs.append(_responses_function(tool, f"tools[{j}]"))
        elif kind == "custom":
            specs.append(_custom_tool(tool, f"tools[{j}]"))
        elif kind == "namespace":
            namespace = _string(tool.get("name"), f"tools[{j}].name")
            for k, inner in enumerate(_list(tool.get("tools"), f"tools[{j}].tools")):
                where = f"tools[{j}].tools[{k}]"
                inner = _object(inner, where)
                if inner.get("type", "function") == "custom":
                    specs.append(_custom_tool(inner, where, namespace))
                else:
                    specs.append(_responses_function(inner, where, namespace))
        else:
            reason = "hosted tool" if kind in _HOSTED_TOOLS else "unsupported tool type"
            log.info("dropping %s %r from the tool list", reason, kind)
    return specs


class _ResponsesHistory:
    """Builds messages from input items. Consecutive assistant-side items (reasoning,
    assistant message, calls) are one model turn, so they merge into one assistant
    message, in the order the model writes them: reasoning, text, calls."""

    def __init__(self, conv: Conversation):
        self.conv = conv
        self.turn: Message | None = None  # the assistant message still accepting items

    def add_items(self, items: list) -> None:
        for i, raw in enumerate(items):
            item = _object(raw, f"input[{i}]")
            kind = item.get("type") or ("message" if "role" in item else None)
            handler = getattr(self, f"_item_{kind}", None) if isinstance(kind, str) else None
            if handler is None:
                log.info("dropping input item of type %r", kind)
                continue
            handler(item, f"input[{i}]")

    def _close(self) -> None:
        self.turn = None

    def _assistant(self, *, fresh_if: bool) -> Message:
        if self.turn is None or fresh_if:
            self.turn = Message("assistant", "", reasoning="")
            self.conv.messages.append(self.turn)
        return self.turn

    def _item_message(self, item: dict, param: str) -> None:
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise RequestError("expected user, assistant, system or developer", f"{param}.role")
        text = _responses_text(item.get("content"), f"{param}.content")
        if role == "assistant":
            turn = self._assistant(fresh_if=self.turn is not None
                                   and bool(self.turn.content or self.turn.tool_calls))
            turn.content = text
            return
        self._close()
        self.conv.messages.append(Message(role, text))

    def _item_reasoning(self, item: dict, param: str) -> None:
        parts = item.get("content") or item.get("summary") or []
        texts = []
        for k, part in enumerate(_list(parts, f"{param}.content")):
            part = _object(part, f"{param}.content[{k}]")
            if isinstance(part.get("text"), str):
                texts.append(part["text"])
        turn = self._assistant(fresh_if=self.turn is not None and bool(
            self.turn.reasoning or self.turn.content or self.turn.tool_calls))
        turn.reasoning = "\n\n".join(texts)

    def _call_name(self, item: dict, param: str) -> str:
        name = _string(item.get("name"), f"{param}.name")
        namespace = item.get("namespace")
        return namespace + NAMESPACE_SEPARATOR + name if isinstance(namespace, str) else name

    def _item_function_call(self, item: dict, param: str) -> None:
        call = ToolCall(name=self._call_name(item, param),
                        arguments=_arguments(item.get("arguments"), f"{param}.arguments"),
                        id=item.get("call_id"))
        self._assistant(fresh_if=False).tool_calls.append(call)

    def _item_custom_tool_call(self, item: dict, param: str) -> None:
        call = ToolCall(name=self._call_name(item, param),
                        arguments={CUSTOM_TOOL_INPUT: _string(item.get("input", ""),
                                                              f"{param}.input")},
                        id=item.get("call_id"))
        self._assistant(fresh_if=False).tool_calls.append(call)

    def _item_function_call_output(self, item: dict, param: str) -> None:
        self._close()
        self.conv.messages.append(Message("tool", _responses_text(item.get("output"),
                                                                  f"{param}.output"),
                                          tool_call_id=item.get("call_id")))

    _item_custom_tool_call_output = _item_function_call_output


def _responses_text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for k, part in enumerate(_list(content, param)):
        part = _object(part, f"{param}[{k}]")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            texts.append(_string(part.get("text"), f"{param}[{k}].text"))
        elif kind == "refusal":
            texts.append(_string(part.get("refusal"), f"{param}[{k}].refusal"))
        elif kind in ("input_image", "image", "image_url"):
            raise _image_error(f"{param}[{k}]")
        elif kind == "input_file":
            raise RequestError("files are not supported: this model reads text only",
                               f"{param}[{k}]")
        else:
            log.info("dropping content part of type %r at %s", kind, f"{param}[{k}]")
    return BLOCK_SEPARATOR.join(texts)
