"""Request bodies of the three APIs -> Conversation (chat/requests.py) + the options around it
(each API module's `read`, server/request.ChatRequest)."""

from __future__ import annotations

import json
import logging
import random

import pytest
from agent_sessions import TOOLS, agent_session, anthropic_body, openai_body, responses_body

from q27py.chat.conversation import Message, ToolCall
from q27py.chat.render import render
from q27py.chat.requests import (
    RequestError,
    ToolChoice,
    parse_conversation,
    strip_billing_header,
)
from q27py.errors import Q27Error
from q27py.server import anthropic as anthropic_api
from q27py.server import openai_chat, responses
from q27py.server.errors import ApiError

READERS = {"anthropic": anthropic_api.read, "openai": openai_chat.read, "responses": responses.read}


def parse_request(api: str, body):
    """(Conversation, ChatRequest) as the server reads the body (model filled in if absent)."""
    req = READERS[api]({"model": "m", **body} if isinstance(body, dict) and "model" not in body else body)
    return req.conv, req


def render_options(req, *, default_thinking: bool, default_preserve_thinking: bool) -> dict:
    """What the server passes to render(): the request's choice, else the server's."""
    return {"enable_thinking": default_thinking if req.enable_thinking is None else req.enable_thinking,
            "preserve_thinking": default_preserve_thinking if req.preserve_thinking is None
            else req.preserve_thinking}


def option_error(api: str, body) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(api, body)
    return info.value

BILLING = "x-anthropic-billing-header: cc_version=2.1.332.0b8; cc_entrypoint=sdk-cli;"


def parse_error(api: str, body) -> RequestError | ApiError:
    """The error naming the field: from the chat part if it is wrong, else from the options."""
    try:
        parse_conversation(api, body)
    except RequestError as exc:
        return exc
    return option_error(api, body)


# --- round trips over random agent sessions ------------------------------------------

@pytest.mark.parametrize("api, build", [
    ("anthropic", lambda msgs, rng: anthropic_body(msgs, rng)),
    ("openai", lambda msgs, rng: openai_body(msgs)),
    ("responses", lambda msgs, rng: responses_body(msgs)),
])
def test_sessions_map_back_to_the_same_conversation(api, build, caplog):
    for seed in range(30):
        rng = random.Random(seed)
        msgs = agent_session(rng, developer=(api != "anthropic"))
        with caplog.at_level(logging.INFO, logger="q27py.chat.requests"):
            conv, opts = parse_request(api, build(msgs, rng))
        assert conv.messages == msgs, seed
        assert conv.tools == TOOLS
        assert opts.api == api and opts.stream is True and opts.model == "qwen-local"
        # Claude Code sends thinking "adaptive": the server's default decides (None).
        assert opts.enable_thinking is (None if api == "anthropic" else True)
    if api == "responses":
        assert "web_search" in caplog.text  # the hosted tool was dropped, with a log line


def test_request_error_is_a_q27_error_with_a_param():
    err = parse_error("openai", {"messages": "hi"})
    assert isinstance(err, Q27Error) and isinstance(err, RequestError)
    assert err.param == "messages" and "array" in err.message
    assert parse_error("openai", []).param == "body"
    with pytest.raises(RequestError, match="unknown API"):
        parse_conversation("gemini", {})


# --- Anthropic Messages ---------------------------------------------------------------

def anthropic(**fields) -> dict:
    return {"model": "m", "max_tokens": 100,
            "messages": [{"role": "user", "content": "hi"}], **fields}


def test_billing_line_is_dropped_whatever_its_fields():
    convs = []
    for suffix in ("0b8", "3f1"):
        body = anthropic(system=[
            {"type": "text", "text": BILLING.replace("0b8", suffix)},
            {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Main prompt."}])
        convs.append(parse_request("anthropic", body)[0])
    assert convs[0] == convs[1]
    assert convs[0].messages[0] == Message("system", "You are a Claude agent.\n\nMain prompt.")
    string_form = parse_request("anthropic", anthropic(system=BILLING + "\nBe brief."))[0]
    assert string_form.messages[0] == Message("system", "Be brief.")
    only_billing = parse_request("anthropic", anthropic(system=[{"type": "text", "text": BILLING}]))[0]
    assert [m.role for m in only_billing.messages] == ["user"]


def test_strip_billing_header_only_touches_leading_billing_lines():
    assert strip_billing_header(BILLING + "\n" + BILLING + "\nrest") == "rest"
    assert strip_billing_header("rest\n" + BILLING) == "rest\n" + BILLING
    assert strip_billing_header(BILLING) == ""


def test_system_messages_stay_in_place():
    body = anthropic(system="S", messages=[
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>r</system-reminder>"},
                                     {"type": "text", "text": "say hi"}]},
        {"role": "system", "content": "env: linux", "output_config": {"effort": "low"}},
    ])
    conv, _ = parse_request("anthropic", body)
    assert conv.messages == [Message("system", "S"),
                             Message("user", "<system-reminder>r</system-reminder>\n\nsay hi"),
                             Message("system", "env: linux")]
    text = render(conv).text
    assert text.endswith("<|im_start|>system\nenv: linux<|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_tool_results_and_text_in_one_user_message():
    body = anthropic(messages=[
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "first", "signature": "s"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "thinking", "thinking": "second", "signature": "s"},
            {"type": "text", "text": "Running."},
            {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}},
            {"type": "server_tool_use", "id": "s1", "name": "web_search", "input": {}},
            {"type": "tool_use", "id": "t2", "name": "Bash", "input": {"command": "pwd"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "a.py", "is_error": False},
            {"type": "tool_result", "tool_use_id": "t2",
             "content": [{"type": "text", "text": "/w"}, {"type": "text", "text": "ok"}]},
            {"type": "text", "text": "now fix it", "cache_control": {"type": "ephemeral"}}]},
    ])
    conv, _ = parse_request("anthropic", body)
    assert conv.messages[1:] == [
        Message("assistant", "Running.", reasoning="first\n\nsecond",
                tool_calls=[ToolCall("Bash", {"command": "ls"}, "t1"),
                            ToolCall("Bash", {"command": "pwd"}, "t2")]),
        Message("tool", "a.py", tool_call_id="t1"),
        Message("tool", "/w\n\nok", tool_call_id="t2"),
        Message("user", "now fix it"),
    ]


@pytest.mark.parametrize("thinking, enabled, budget", [
    (None, None, None),
    # adaptive: "the model decides"; here the server's default decides (None), read once.
    ({"type": "adaptive", "display": "omitted"}, None, None),
    ({"type": "enabled", "budget_tokens": 2048}, True, 2048),
    ({"type": "disabled"}, False, None),
])
def test_anthropic_thinking(thinking, enabled, budget):
    body = anthropic() if thinking is None else anthropic(thinking=thinking)
    _, opts = parse_request("anthropic", body)
    assert (opts.enable_thinking, opts.thinking_budget) == (enabled, budget)
    resolved = render_options(opts, default_thinking=False, default_preserve_thinking=True)
    assert resolved == {"enable_thinking": bool(enabled), "preserve_thinking": True}


def test_anthropic_options_and_tolerated_fields():
    _, opts = parse_request("anthropic", anthropic(
        temperature=0.7, top_p=0.9, top_k=20, stop_sequences=["END"], stream=True,
        tool_choice={"type": "any"}, metadata={"user_id": "x"}, output_config={"effort": "high"},
        context_management={"edits": []}, service_tier="auto"))
    assert (opts.temperature, opts.top_p, opts.top_k, opts.stop, opts.max_tokens) == \
        (0.7, 0.9, 20, ("END",), 100)
    assert opts.tool_choice == ToolChoice("required")
    _, opts = parse_request("anthropic", anthropic(tool_choice={"type": "tool", "name": "Bash"}))
    assert opts.tool_choice == ToolChoice("tool", "Bash")


def test_anthropic_tools_server_tools_and_deferred(caplog):
    tools = [{"name": "Bash", "description": "Run.", "input_schema": {"type": "object"},
              "cache_control": {"type": "ephemeral"}, "eager_input_streaming": True},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
             {"name": "WebFetch", "description": "Fetch.", "defer_loading": True,
              "input_schema": {"type": "object", "properties": {"url": {"type": "string"}}}}]
    body = anthropic(tools=tools, messages=[
        {"role": "user", "content": "find"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "ToolSearch",
                                           "input": {"query": "select:WebFetch"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "tool_reference", "tool_name": "WebFetch"},
            {"type": "tool_reference", "tool_name": "Nope"}]}]},
    ])
    with caplog.at_level(logging.INFO, logger="q27py.chat.requests"):
        conv, _ = parse_request("anthropic", body)
    assert "web_search_20250305" in caplog.text
    assert [(t.name, t.deferred) for t in conv.tools] == [("Bash", False), ("WebFetch", True)]
    result = conv.messages[-1].content
    assert result.startswith('<tools>\n{"type": "function", "function": {"name": "WebFetch"')
    assert result.endswith("</tools>\n\nTool Nope is not available.")
    system_turn = render(conv).text.split("<|im_end|>")[0]
    assert '"name": "Bash"' in system_turn and "WebFetch" not in system_turn


def test_anthropic_documents_and_search_results_are_text():
    body = anthropic(messages=[{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}},
        {"type": "search_result", "source": "s", "title": "t",
         "content": [{"type": "text", "text": "found"}]}]}])
    assert parse_request("anthropic", body)[0].messages == [Message("user", "doc\n\nfound")]


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": [{"type": "text", "text": "look"},
                                   {"type": "image", "source": {"type": "base64", "data": ""}}]}],
     "messages[0].content[1]"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "url", "url": "x"}}]}]}],
     "messages[0].content[0].content[0]"),
    ([{"role": "user", "content": [{"type": "document", "source": {"type": "base64"}}]}],
     "messages[0].content[0].source.type"),
])
def test_anthropic_images_are_a_clear_error(messages, param):
    err = parse_error("anthropic", anthropic(messages=messages))
    assert err.param == param and "text only" in err.message


@pytest.mark.parametrize("fields, param", [
    ({"messages": None}, "messages"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f",
                                                      "input": [1]}]}]},
     "messages[0].content[0].input"),
    ({"messages": []}, "messages"),
    ({"max_tokens": "100"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": True}, "temperature"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"tools": [{"description": "no name"}]}, "tools[0].name"),
    ({"tools": [{"name": "a"}, {"name": "a"}]}, "tools"),
    ({"system": [{"type": "text", "text": 5}]}, "system[0].text"),
])
def test_anthropic_invalid_structure(fields, param):
    assert parse_error("anthropic", anthropic(**fields)).param == param


# --- OpenAI Chat Completions ----------------------------------------------------------

def chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_chat_messages_roles_and_parts():
    conv, _ = parse_request("openai", chat(messages=[
        {"role": "developer", "content": BILLING + "\nbase"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
         "name": "me"},
        {"role": "assistant", "content": "<think>\nr\n</think>\n\nanswer"},
        {"role": "assistant", "content": None, "reasoning": "vllm spelling",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": '{"x": [1, 2]}'}},
                        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "out"}]},
        {"role": "system", "content": "late"},
    ]))
    assert conv.messages == [
        Message("developer", "base"),  # billing line dropped from the first system prompt too
        Message("user", "ab"),  # parts join with nothing, as the template joins them
        Message("assistant", "<think>\nr\n</think>\n\nanswer", reasoning=None),
        Message("assistant", "", reasoning="vllm spelling",
                tool_calls=[ToolCall("f", {"x": [1, 2]}, "c1"), ToolCall("g", {}, "c2")]),
        Message("tool", "out", tool_call_id="c1"),
        Message("system", "late"),
    ]
    # No reasoning field: the inline think block is split out when rendering.
    assert "<|im_start|>assistant\n<think>\nr\n</think>\n\nanswer<|im_end|>" in \
        render(conv, preserve_thinking=True).text


@pytest.mark.parametrize("fields, enabled", [
    ({}, None),
    ({"enable_thinking": False}, False),
    ({"chat_template_kwargs": {"enable_thinking": False}, "enable_thinking": True}, False),
    ({"reasoning_effort": "none"}, False),
    ({"reasoning_effort": "low"}, True),
    ({"enable_thinking": True, "reasoning_effort": "none"}, True),
])
def test_chat_thinking_switches(fields, enabled):
    assert parse_request("openai", chat(**fields))[1].enable_thinking is enabled


def test_chat_options():
    _, opts = parse_request("openai", chat(
        max_tokens=10, max_completion_tokens=20, stop="\n\n", temperature=1, top_p=0.5, seed=7,
        min_p=0.05, top_k=40, stream=True, stream_options={"include_usage": True},
        parallel_tool_calls=False, tool_choice={"type": "function", "function": {"name": "f"}},
        chat_template_kwargs={"preserve_thinking": False}, logprobs=False, response_format={}))
    assert (opts.max_tokens, opts.stop, opts.temperature, opts.top_p, opts.seed) == \
        (20, ("\n\n",), 1.0, 0.5, 7)
    assert (opts.min_p, opts.top_k, opts.include_usage, opts.stop_after_tool_call) == \
        (0.05, 40, True, True)
    assert opts.tool_choice == ToolChoice("tool", "f")
    assert opts.preserve_thinking is False
    assert render_options(opts, default_thinking=True, default_preserve_thinking=True) == \
        {"enable_thinking": True, "preserve_thinking": False}


def test_chat_tools(caplog):
    with caplog.at_level(logging.INFO, logger="q27py.chat.requests"):
        conv, _ = parse_request("openai", chat(tools=[
            {"type": "function", "function": {"name": "f", "description": "d",
                                              "parameters": {"type": "object"}, "strict": True}},
            {"type": "function", "function": {"name": "bare"}},
            {"type": "custom", "custom": {"name": "patch", "description": "Apply a patch."}},
            {"type": "retrieval"}]))
    assert "retrieval" in caplog.text
    assert [t.template_dict() for t in conv.tools[:2]] == [
        {"type": "function", "function": {"name": "f", "description": "d",
                                          "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "bare"}}]
    assert conv.tools[2].kind == "custom" and conv.tools[2].parameters["required"] == ["input"]


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "input_audio"}]}], "messages[0].content[0].type"),
    ([{"role": "function", "content": "x"}], "messages[0].role"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"type": "function"}]}],
     "messages[0].tool_calls[0].function"),
])
def test_chat_invalid_structure(messages, param):
    assert parse_error("openai", chat(messages=messages)).param == param


def test_chat_n_and_stop_validation():
    assert option_error("openai", chat(n=2)).param == "n"
    assert option_error("openai", chat(stop=["a", 1])).param == "stop[1]"
    assert parse_request("openai", chat(n=1, stop=None))[1].stop == ()


# --- OpenAI Responses -----------------------------------------------------------------

CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Run.", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "Agents.", "tools": [
        {"type": "function", "name": "spawn_agent", "description": "Spawn.",
         "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}},
        {"type": "function", "name": "wait_agent", "parameters": {"type": "object"}}]},
    {"type": "web_search", "external_web_access": False},
    {"type": "custom", "name": "apply_patch", "description": "Edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+"}},
]


def test_responses_string_input_and_instructions():
    conv, opts = parse_request("responses", {"model": "m", "instructions": "Be terse.",
                                             "input": "hi", "max_output_tokens": 50})
    assert conv.messages == [Message("system", "Be terse."), Message("user", "hi")]
    assert opts.max_tokens == 50


def test_responses_tools_flattened_and_mapped_back(caplog):
    with caplog.at_level(logging.INFO, logger="q27py.chat.requests"):
        conv, opts = parse_request("responses", {"input": "go", "tools": CODEX_TOOLS,
                                                 "tool_choice": {"type": "function",
                                                                 "namespace": "multi_agent_v1",
                                                                 "name": "wait_agent"}})
    assert "web_search" in caplog.text and "hosted" in caplog.text
    names = [t.name for t in conv.tools]
    assert names == ["exec_command", "multi_agent_v1__spawn_agent", "multi_agent_v1__wait_agent",
                     "apply_patch"]
    spawn = conv.tool("multi_agent_v1__spawn_agent")
    assert (spawn.namespace, spawn.api_name, spawn.description) == \
        ("multi_agent_v1", "spawn_agent", "Spawn.")
    assert conv.tool("exec_command").api_name == "exec_command"
    patch = conv.tool("apply_patch")
    assert patch.kind == "custom" and patch.namespace is None
    assert patch.parameters == {"type": "object", "properties": {
        "input": {"type": "string", "description": "The raw input text."}}, "required": ["input"]}
    assert patch.description.startswith("Edit files.\n\n")
    assert patch.description.endswith("lark grammar:\nstart: begin_patch hunk+")
    assert opts.tool_choice == ToolChoice("tool", "multi_agent_v1__wait_agent")


def test_responses_history_items(caplog):
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "base"}]},
        {"role": "user", "content": "task"},  # EasyInputMessage: no type
        {"type": "reasoning", "id": "r1", "summary": [{"type": "summary_text", "text": "plan"}],
         "encrypted_content": None},
        {"type": "message", "role": "assistant", "phase": "commentary",
         "content": [{"type": "output_text", "text": "On it."}]},
        {"type": "function_call", "call_id": "c1", "name": "spawn_agent",
         "namespace": "multi_agent_v1", "arguments": '{"task": "t"}'},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch",
         "input": "*** Begin Patch\n*** End Patch"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "spawned"}, {"type": "input_text", "text": "id 1"}]},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "Done!"},
        {"type": "local_shell_call", "call_id": "c3", "action": {}},
        {"type": "compaction", "encrypted_content": "x"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
    ]
    with caplog.at_level(logging.INFO, logger="q27py.chat.requests"):
        conv, _ = parse_request("responses", {"input": items, "tools": CODEX_TOOLS})
    assert "local_shell_call" in caplog.text and "compaction" in caplog.text
    assert conv.messages == [
        Message("developer", "base"),
        Message("user", "task"),
        Message("assistant", "On it.", reasoning="plan", tool_calls=[
            ToolCall("multi_agent_v1__spawn_agent", {"task": "t"}, "c1"),
            ToolCall("apply_patch", {"input": "*** Begin Patch\n*** End Patch"}, "c2")]),
        Message("tool", "spawned\n\nid 1", tool_call_id="c1"),
        Message("tool", "Done!", tool_call_id="c2"),
        Message("assistant", "ok", reasoning=""),
    ]


def test_responses_items_split_into_turns_where_a_model_turn_must_have_ended():
    """One model turn reads reasoning, text, calls; anything out of that order starts a new one."""
    def call(call_id):
        return {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}

    def said(text):
        return {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": text}]}

    def thought(text):
        return {"type": "reasoning", "content": [{"type": "reasoning_text", "text": text}]}

    conv, _ = parse_request("responses", {"input": [
        {"role": "user", "content": "go"},
        said("A"), thought("R2"), said("B"), call("c1"),  # reasoning after text: a new turn
        call("c2"), said("after the calls"),  # text after calls: a new turn
        thought("R4"), thought("R5"),  # a second reasoning: a new turn
    ]})
    assert conv.messages[1:] == [
        Message("assistant", "A", reasoning=""),
        Message("assistant", "B", reasoning="R2", tool_calls=[ToolCall("f", {}, "c1"),
                                                              ToolCall("f", {}, "c2")]),
        Message("assistant", "after the calls", reasoning=""),
        Message("assistant", "", reasoning="R4"),
        Message("assistant", "", reasoning="R5"),
    ]


def test_responses_reasoning_switches():
    body = {"input": "hi", "reasoning": {"effort": "none"}}
    assert parse_request("responses", body)[1].enable_thinking is False
    body["chat_template_kwargs"] = {"enable_thinking": True}
    assert parse_request("responses", body)[1].enable_thinking is True
    assert parse_request("responses", {"input": "hi"})[1].enable_thinking is None


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "message", "role": "user",
                 "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c",
                 "output": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].output[0]"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{"}]}, "input[0].arguments"),
    ({"input": [{"type": "message", "role": "critic", "content": "x"}]}, "input[0].role"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": "hi", "tools": [{"type": "namespace", "name": "n", "tools": [{"name": "a"}]},
                               {"type": "function", "name": "n__a"}]}, "tools"),
])
def test_responses_invalid_structure(body, param):
    assert parse_error("responses", body).param == param


def test_codex_like_request_renders_developer_turns_in_place():
    conv, opts = parse_request("responses", {"input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "base"}]},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "skills"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "do it"}]},
    ], "tools": CODEX_TOOLS})
    out = render(conv, **render_options(opts, default_thinking=True, default_preserve_thinking=True))
    system_turn = out.text[: out.system_len]
    assert system_turn.endswith("</IMPORTANT>\n\nbase<|im_end|>\n")
    assert '"name": "multi_agent_v1__spawn_agent"' in system_turn
    assert json.dumps(conv.tool("apply_patch").template_dict(), ensure_ascii=False) in system_turn
    assert out.text[out.system_len:] == ("<|im_start|>system\nskills<|im_end|>\n"
                                         "<|im_start|>user\ndo it<|im_end|>\n"
                                         "<|im_start|>assistant\n<think>\n")
