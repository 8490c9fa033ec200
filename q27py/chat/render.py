"""Conversation -> prompt text, byte-identical to the official Qwen3.5/3.6 chat templates.

The templates are re-implemented by hand (no template engine). Every conversation
the official template accepts renders to the same bytes as transformers'
`apply_chat_template` (tests/chat/test_render_golden.py checks 800 golden renders).
Where the template raises on shapes that real agent clients send, we render
instead; these extensions are listed in docs/CHAT.md and tested in
tests/chat/test_render_extensions.py:

- system/developer messages after the first message render in place as their own
  system turn (the template raises "System message must be at the beginning.");
- a leading developer message is treated like a leading system message;
- a history with no real user query (tool-only) renders, every assistant turn
  counting as part of the current turn (the template raises "No user query found");
- a tool result as the very first message opens its user turn (the template
  writes the <tool_response> with no turn open);
- images and videos raise a clear RenderError (the template writes vision
  placeholders; this text model has no vision input).

The three template variants differ in two places (see
../shared/reference/README.md): whether old assistant turns keep their thinking
when preserve_thinking=True (qwen3.6 only), how non-string tool-call arguments
are written (qwen3.6: JSON; qwen3.5: JSON for objects/lists, Python str() for the
rest), and the generation prompt's thinking default (qwen3.5-0.8b: off unless
enable_thinking=True).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from q27py.chat.conversation import Conversation, Message, ToolCall
from q27py.errors import Q27Error

log = logging.getLogger(__name__)

TEMPLATES = ("qwen3.6", "qwen3.5", "qwen3.5-0.8b", "qwen3.8")
TOOL_DIALECTS = ("xml", "json")  # <function=NAME><parameter=K>.. (Qwen3.5+) | {"name", "arguments"} (Qwen3)
DEFAULT_TEMPLATE = "qwen3.6"

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

TOOLS_HEADER = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_INSTRUCTIONS = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\n"
    "that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\n"
    "Reminder:\n- Function calls MUST follow the specified format: an inner <function=...></function>"
    " block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the "
    "function call, but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current "
    "knowledge and do not tell the user about function calls\n</IMPORTANT>"
)

THINK_OPEN = "<think>\n"
THINK_CLOSED = "<think>\n\n</think>\n\n"

_SYSTEM_ROLES = ("system", "developer")


class RenderError(Q27Error):
    """A conversation the renderer cannot turn into a prompt; the message says why."""


@dataclass(frozen=True)
class Rendered:
    text: str
    # Characters up to the end of the last complete turn: everything before the
    # generation prompt. The next request of the same conversation re-sends this
    # text unchanged (with preserve_thinking on, see docs/CHAT.md), so prefix
    # reuse may snapshot here. It always ends right after "<|im_end|>\n".
    stable_len: int
    # Characters of the leading system turn (tools block + first system message),
    # 0 when there is none: the part that different conversations often share.
    system_len: int = 0


# ---------------------------------------------------------------------------
# Rendering a Conversation


def render(
    conv: Conversation,
    *,
    template: str = DEFAULT_TEMPLATE,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    preserve_thinking: bool | None = None,
) -> Rendered:
    """Render `conv` the way the official `template` renders the same conversation.

    enable_thinking / preserve_thinking: None means "not passed to the template".
    Deferred tools (ToolSpec.deferred) are left out of the tools block.
    """
    tools = [spec.template_dict() for spec in conv.tools if not spec.deferred]
    return _render(conv.messages, tools, template, add_generation_prompt, enable_thinking,
                   preserve_thinking)


def render_messages(
    messages: list[dict],
    tools: list[dict] | None = None,
    *,
    template: str = DEFAULT_TEMPLATE,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    preserve_thinking: bool | None = None,
) -> Rendered:
    """Render messages and tools given in the template's own (OpenAI-like) format.

    Tools are written to the prompt exactly as given (one JSON line each), as
    `apply_chat_template(messages, tools=tools, ...)` would.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise RenderError("messages must be a list")
    # The template only lists tools given as a non-empty list (a mapping is ignored).
    tool_list = list(tools) if tools and not isinstance(tools, (Mapping, str, bytes)) else []
    converted = [_message_from_template_format(m, i) for i, m in enumerate(messages)]
    return _render(converted, tool_list, template, add_generation_prompt, enable_thinking,
                   preserve_thinking)


def _render(messages: list[Message], tools: list[Any], template: str, add_generation_prompt: bool,
            enable_thinking: bool | None, preserve_thinking: bool | None) -> Rendered:
    if template not in TEMPLATES:
        raise RenderError(f"unknown chat template {template!r}; known: {', '.join(TEMPLATES)}")
    if not messages:
        raise RenderError("No messages provided.")
    for i, m in enumerate(messages):
        if m.role not in ("user", "assistant", "tool") + _SYSTEM_ROLES:
            raise RenderError(f"Unexpected message role {m.role!r} (message {i}).")
        if not isinstance(m.content, str) or not isinstance(m.reasoning, (str, type(None))):
            raise RenderError(f"message {i}: content and reasoning must be text")
        for call in m.tool_calls:
            if not isinstance(call.name, str) or not isinstance(call.arguments, Mapping):
                raise RenderError(f"message {i}: a tool call needs a name and an arguments object")

    out: list[str] = []
    leading_system = messages[0].role in _SYSTEM_ROLES
    if tools:
        out.append(IM_START + "system\n" + TOOLS_HEADER)
        for tool in tools:
            out.append("\n" + _tojson(tool))
        out.append("\n</tools>" + TOOLS_INSTRUCTIONS)
        if leading_system:
            content = messages[0].content.strip()
            if content:
                out.append("\n\n" + content)
        out.append(IM_END + "\n")
    elif leading_system:
        out.append(IM_START + "system\n" + messages[0].content.strip() + IM_END + "\n")
    system_len = sum(len(part) for part in out)

    last_query = _last_query_index(messages)
    # Qwen3.8 re-wraps every assistant turn's reasoning (q27-design.md 7.6: "every assistant
    # history turn re-wrapped as <think>..</think>"); Qwen3.6 only under preserve_thinking.
    keep_old_thinking = template == "qwen3.8" or (preserve_thinking is True and template == "qwen3.6")
    for i, message in enumerate(messages):
        role = message.role
        content = message.content.strip()
        if role in _SYSTEM_ROLES:
            if i > 0:  # extension: in place, never hoisted into the first system turn
                out.append(IM_START + "system\n" + content + IM_END + "\n")
        elif role == "user":
            out.append(IM_START + "user\n" + content + IM_END + "\n")
        elif role == "assistant":
            out.append(_render_assistant(message, content, keep_old_thinking or i > last_query,
                                         template))
        else:  # tool results: consecutive ones share one user turn
            if i == 0 or messages[i - 1].role != "tool":
                out.append(IM_START + "user")
            out.append("\n<tool_response>\n" + content + "\n</tool_response>")
            if i == len(messages) - 1 or messages[i + 1].role != "tool":
                out.append(IM_END + "\n")

    text = "".join(out)
    stable_len = len(text)
    if add_generation_prompt:
        text += IM_START + "assistant\n" + _generation_think(template, enable_thinking)
    return Rendered(text=text, stable_len=stable_len, system_len=system_len)


def encode_rendered(tokenizer, rendered: Rendered) -> tuple[list[int], int, int]:
    """(ids, system_tokens, stable_tokens): the prompt split-encoded at the system and stable
    boundaries, so each shared prefix tokenizes the same way whatever follows it (prefix reuse
    restores exactly these tokens) and the engine can be told the boundaries as token offsets.
    Each boundary sits right after "<|im_end|>\n" before a special token, so this equals
    encoding the whole text."""
    text = rendered.text
    system_len = min(rendered.system_len, rendered.stable_len)
    system = tokenizer.encode(text[:system_len]) if system_len else []
    head = system + tokenizer.encode(text[system_len: rendered.stable_len])
    return head + tokenizer.encode(text[rendered.stable_len:]), len(system), len(head)


def _last_query_index(messages: list[Message]) -> int:
    """Index of the last user message that is not only a wrapped tool response.

    Assistant turns after it are the current turn and keep their thinking.
    Extension: with no such message (a tool-only history) every assistant turn is
    current, so -1; the template raises "No user query found in messages." there.
    """
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role == "user":
            content = messages[i].content.strip()
            if not (content.startswith("<tool_response>") and content.endswith("</tool_response>")):
                return i
    return -1


def _render_assistant(message: Message, content: str, with_thinking: bool, template: str) -> str:
    reasoning = message.reasoning
    if reasoning is None:
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
    reasoning = reasoning.strip()

    parts = [IM_START + "assistant\n"]
    if with_thinking:
        parts.append("<think>\n" + reasoning + "\n</think>\n\n")
    parts.append(content)
    for j, call in enumerate(message.tool_calls):
        if j == 0:
            parts.append("\n\n<tool_call>\n" if content.strip() else "<tool_call>\n")
        else:
            parts.append("\n<tool_call>\n")
        parts.append("<function=" + call.name + ">\n")
        for key, value in call.arguments.items():
            parts.append("<parameter=" + key + ">\n" + _argument_text(value, template)
                         + "\n</parameter>\n")
        parts.append("</function>\n</tool_call>")
    parts.append(IM_END + "\n")
    return "".join(parts)


def _argument_text(value: Any, template: str) -> str:
    if template in ("qwen3.6", "qwen3.8"):
        return value if isinstance(value, str) else _tojson(value)
    # Qwen3.5: JSON only for objects and lists; str() for the rest (True, None, 1.5).
    if isinstance(value, Mapping) or (_is_sequence(value) and not isinstance(value, str)):
        return _tojson(value)
    return str(value)


def _is_sequence(value: Any) -> bool:
    # Jinja's `sequence` test: anything with a length and item access.
    return hasattr(value, "__len__") and hasattr(value, "__getitem__")


def _generation_think(template: str, enable_thinking: bool | None) -> str:
    if template == "qwen3.5-0.8b":  # thinking off unless explicitly enabled
        return THINK_OPEN if enable_thinking is True else THINK_CLOSED
    return THINK_CLOSED if enable_thinking is False else THINK_OPEN


def _tojson(value: Any) -> str:
    # transformers' tojson: json.dumps with default separators, keys in order, no ASCII escaping.
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise RenderError(f"value is not JSON-serializable: {exc}") from None


# ---------------------------------------------------------------------------
# The template's own message format -> Message


def _message_from_template_format(raw: Any, index: int) -> Message:
    if not isinstance(raw, Mapping):
        raise RenderError(f"message {index} is not an object")
    role = raw.get("role")
    if not isinstance(role, str):
        raise RenderError(f"Unexpected message role (message {index}).")
    content = _template_content_text(raw.get("content"), index)
    reasoning = raw.get("reasoning_content")
    calls: list[ToolCall] = []
    raw_calls = raw.get("tool_calls")
    if role == "assistant" and raw_calls and not isinstance(raw_calls, (Mapping, str, bytes)):
        calls = [_tool_call_from_template_format(c, index) for c in raw_calls]
    return Message(role=role, content=content,
                   reasoning=reasoning if isinstance(reasoning, str) else None, tool_calls=calls,
                   tool_call_id=raw.get("tool_call_id"), name=raw.get("name"))


def _template_content_text(content: Any, index: int) -> str:
    """The template's render_content macro: a string, or a list of text items."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Mapping) or not isinstance(content, Sequence):
        raise RenderError(f"Unexpected content type (message {index}).")
    texts = []
    for item in content:
        if not isinstance(item, (Mapping, str)):
            raise RenderError(f"Unexpected item type in content (message {index}).")
        # The template tests `'image' in item`: a key for objects, a substring for strings.
        item_type = item.get("type") if isinstance(item, Mapping) else None
        if "image" in item or "image_url" in item or item_type == "image" \
                or "video" in item or item_type == "video":
            raise RenderError(f"message {index} contains an image or video; this model reads text "
                              "only")
        if "text" not in item:
            raise RenderError(f"Unexpected item type in content (message {index}).")
        if isinstance(item, Mapping):
            texts.append(str(item["text"]))  # Jinja writes None as "None", numbers as str()
        # else: a string item has no .text attribute, which Jinja writes as ""
    return "".join(texts)


def _tool_call_from_template_format(raw: Any, index: int) -> ToolCall:
    if not isinstance(raw, Mapping):
        raise RenderError(f"a tool call in message {index} is not an object")
    call = raw.get("function", raw)
    if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
        raise RenderError(f"a tool call in message {index} has no name")
    arguments = call.get("arguments", {})
    if not isinstance(arguments, Mapping):
        raise RenderError(f"tool call {call['name']!r} in message {index}: arguments must be an "
                          "object, not " + type(arguments).__name__)
    return ToolCall(name=call["name"], arguments=dict(arguments), id=raw.get("id"))


# ---------------------------------------------------------------------------
# Picking the template variant for a model directory

_MARKERS = {
    # The tool-argument line differs between 3.5 and 3.6 (see module docstring).
    "qwen3.6": "args_value | string if args_value is string else args_value | tojson | safe",
    "qwen3.5": "args_value | tojson | safe if args_value is mapping",
}
_THINKING_OPT_IN = "enable_thinking is defined and enable_thinking is true"


def template_variant(template_text: str) -> str | None:
    """Which variant a chat template text is, or None if it is none of them.

    Qwen3.8 writes arguments as 3.6 does but keeps every assistant turn's thinking (no
    last-query rule) and carries a reasoning-effort switch; either sign marks it."""
    if _MARKERS["qwen3.6"] in template_text and (
            "reasoning_effort" in template_text or "last_query_index" not in template_text):
        return "qwen3.8"
    if _MARKERS["qwen3.6"] in template_text and "preserve_thinking" in template_text:
        return "qwen3.6"
    if _MARKERS["qwen3.5"] in template_text:
        return "qwen3.5-0.8b" if _THINKING_OPT_IN in template_text else "qwen3.5"
    return None


def tool_dialect_of(template_text: str) -> str | None:
    """The call syntax a chat template instructs: "xml" (`<function=NAME>`), "json"
    (`<tool_call>{"name": .., "arguments": ..}`), or None when it shows neither."""
    if "<function=" in template_text:
        return "xml"
    if "<tool_call>" in template_text and '"arguments"' in template_text:
        return "json"
    return None


@dataclass(frozen=True)
class ChatDialect:
    template: str  # one of TEMPLATES
    tool_dialect: str  # one of TOOL_DIALECTS
    source: str  # where the choice came from (logged)


def _normalized_name(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch.isalnum())


def _checkpoint_names(model_dir: Path) -> list[str]:
    """Names a checkpoint gives itself: config.json's name fields, then the directory name."""
    names = []
    config = model_dir / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except ValueError:
            data = {}
        if isinstance(data, Mapping):
            for key in ("_name_or_path", "name_or_path", "model_name", "name"):
                if isinstance(data.get(key), str):
                    names.append(data[key])
    names.append(model_dir.name)
    return names


def choose_dialect(model_dir: str | Path | None, template: str | None = None,
                   tool_dialect: str | None = None) -> ChatDialect:
    """Template variant and tool-call dialect for a checkpoint, logged with the reason.

    Order: the override (flag / config), then the checkpoint's own template text
    (chat_template.jinja, else tokenizer_config.json), then its name ("qwen3.8" / "qwen38"
    anywhere in config.json's name or the directory name picks Qwen3.8), else qwen3.6 + XML."""
    if template is not None and template not in TEMPLATES:
        raise RenderError(f"unknown chat template {template!r}; known: {', '.join(TEMPLATES)}")
    if tool_dialect is not None and tool_dialect not in TOOL_DIALECTS:
        raise RenderError(f"unknown tool dialect {tool_dialect!r}; known: {', '.join(TOOL_DIALECTS)}")
    sources = []
    text = _template_text(Path(model_dir)) if model_dir is not None else None
    found_template = template_variant(text) if text else None
    found_dialect = tool_dialect_of(text) if text else None
    if template is None and found_template is not None:
        template, _ = found_template, sources.append("template text")
    if template is None and model_dir is not None:
        for name in _checkpoint_names(Path(model_dir)):
            if "qwen38" in _normalized_name(name):
                template, _ = "qwen3.8", sources.append(f"name {name!r}")
                break
    if template is None:
        if text is not None:
            log.warning("%s: chat template is not a known Qwen3.5/3.6/3.8 variant; rendering as %s",
                        model_dir, DEFAULT_TEMPLATE)
        template, _ = DEFAULT_TEMPLATE, sources.append("default")
    if tool_dialect is None:
        tool_dialect = found_dialect or "xml"
        sources.append("template text" if found_dialect else "default dialect")
    else:
        sources.append("override")
    chosen = ChatDialect(template, tool_dialect, ", ".join(dict.fromkeys(sources)))
    log.info("chat dialect: template %s, tool calls %s (%s)", chosen.template, chosen.tool_dialect, chosen.source)
    return chosen


def _template_text(model_dir: Path) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    config = model_dir / "tokenizer_config.json"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    if config.is_file():
        try:
            return _template_from_tokenizer_config(json.loads(config.read_text(encoding="utf-8")))
        except ValueError:
            log.warning("%s: unreadable JSON; using the %s chat template", config, DEFAULT_TEMPLATE)
    return None


def detect_template(model_dir: str | Path | None) -> str:
    """The template variant for a model directory (choose_dialect without overrides)."""
    return choose_dialect(model_dir).template


def _template_from_tokenizer_config(config: Any) -> str | None:
    template = config.get("chat_template") if isinstance(config, Mapping) else None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None
