"""The normalized conversation every API request is mapped into before rendering.

Plain data: the three API mappings (q27py/chat/requests.py) build it, the
renderer (q27py/chat/render.py) turns it into prompt text, and the output side
looks tools up in it to type arguments and to restore client-side names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")

# Namespaced tools (Responses API `{"type": "namespace"}`) are shown to the model
# under one flat name; the ToolSpec keeps the namespace and the client's name so
# a call can be handed back as {namespace, name}.
NAMESPACE_SEPARATOR = "__"

# Freeform ("custom") tools take one raw string; the model sees a function with
# this single string parameter and the call's value is handed back as `input`.
CUSTOM_TOOL_INPUT = "input"


@dataclass
class ToolCall:
    name: str  # the name the model sees (flattened for namespaced tools)
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str | None = None  # the client's call id (tool_use id, call_id), not rendered


@dataclass
class Message:
    role: str  # one of ROLES
    content: str = ""
    # None means "not given": the renderer then splits an inline <think>...</think>
    # out of an assistant's content, as the official template does. A string
    # (even "") is taken as the reasoning and the content is left alone.
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None  # tool results: the call they answer
    name: str | None = None  # tool results: the tool's name when the client gave it


@dataclass
class ToolSpec:
    name: str  # the name the model sees and calls
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments object
    kind: str = "function"  # "function" | "custom" (one raw string, see CUSTOM_TOOL_INPUT)
    namespace: str | None = None  # Responses namespace this tool came from
    client_name: str | None = None  # the name inside that namespace, when different from `name`
    # Deferred tools (Anthropic `defer_loading`) are known to the parser but left
    # out of the system prompt; a tool_reference in a tool result shows them.
    deferred: bool = False

    @property
    def api_name(self) -> str:
        """The name to hand back to the client in a call."""
        return self.client_name or self.name

    def template_dict(self) -> dict[str, Any]:
        """The tool as the chat template receives it (one JSON line in <tools>)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass
class Conversation:
    messages: list[Message] = field(default_factory=list)
    tools: list[ToolSpec] = field(default_factory=list)

    def tool(self, name: str) -> ToolSpec | None:
        """The tool the model calls by `name`, or None."""
        for spec in self.tools:
            if spec.name == name:
                return spec
        return None
