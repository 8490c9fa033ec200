"""The stable boundary: what one request renders up to stable_len, every later request
of the same conversation renders unchanged (append-only), for the agent settings
(Qwen3.6 template, preserve_thinking=True; thinking on or off)."""

from __future__ import annotations

import random

import pytest
from agent_sessions import (
    TOOLS,
    agent_session,
    anthropic_body,
    openai_body,
    request_points,
    responses_body,
)

from q27py.chat.conversation import Conversation
from q27py.chat.render import render
from q27py.commands.render import read_request

SEEDS = range(100)
AGENT = {"template": "qwen3.6", "preserve_thinking": True}


def _violations(msgs, cut_points, **opts) -> list[tuple[int, int]]:
    """Pairs (k, k2) where the render of msgs[:k2] does not extend msgs[:k] up to stable_len."""
    renders = {k: render(Conversation(msgs[:k], TOOLS), **opts) for k in cut_points}
    bad = []
    for i, k in enumerate(cut_points):
        stable = renders[k].text[: renders[k].stable_len]
        bad += [(k, k2) for k2 in cut_points[i + 1:] if not renders[k2].text.startswith(stable)]
    return bad


@pytest.mark.parametrize("enable_thinking", [True, False, None])
def test_agent_session_renders_are_append_only(enable_thinking):
    pairs = 0
    for seed in SEEDS:
        msgs = agent_session(random.Random(seed))
        # Every prefix except between two results of one turn: clients send all results of
        # a turn together, and the template closes a tool group only after its last result.
        cuts = [k for k in range(1, len(msgs) + 1)
                if not (k < len(msgs) and msgs[k - 1].role == msgs[k].role == "tool")]
        assert _violations(msgs, cuts, enable_thinking=enable_thinking, **AGENT) == [], seed
        pairs += len(cuts) * (len(cuts) - 1) // 2
    assert pairs > 5000  # the property was exercised on many (earlier, later) pairs


def test_stable_boundary_is_the_end_of_the_last_turn():
    for seed in SEEDS:
        msgs = agent_session(random.Random(seed))
        for k in request_points(msgs):
            out = render(Conversation(msgs[:k], TOOLS), **AGENT)
            assert out.text[: out.stable_len].endswith("<|im_end|>\n")
            assert out.text[out.stable_len:] == "<|im_start|>assistant\n<think>\n"


def test_without_preserve_thinking_a_new_user_query_rewrites_history():
    """Why the agent path preserves thinking: the template drops the thinking of turns
    before the last user query, so the next query changes text already sent."""
    broken = 0
    for seed in SEEDS:
        msgs = agent_session(random.Random(seed))
        broken += bool(_violations(msgs, request_points(msgs), template="qwen3.6"))
    assert broken > len(SEEDS) // 4


@pytest.mark.parametrize("template", ["qwen3.5", "qwen3.6"])
def test_default_thinking_is_still_append_only_within_a_tool_loop(template):
    """Without preserve_thinking (and always on Qwen3.5) requests that add no new user
    query still extend the previous render."""
    for seed in SEEDS:
        msgs = agent_session(random.Random(seed))
        points = request_points(msgs)
        for i, k in enumerate(points):
            for k2 in points[i + 1:]:
                if any(m.role == "user" for m in msgs[k:k2]):
                    break
                assert not _violations(msgs, [k, k2], template=template), (seed, k, k2)


# --- through the API mappings ---------------------------------------------------------

def _api_renders(api: str, seed: int):
    rng = random.Random(seed)
    msgs = agent_session(rng, developer=(api != "anthropic"))
    for k in request_points(msgs):
        if api == "anthropic":
            body = anthropic_body(msgs[:k], rng)  # fresh billing suffix and cache markers
        elif api == "openai":
            body = openai_body(msgs[:k])
        else:
            body = responses_body(msgs[:k])
        req = read_request(api, body)  # as the server reads it; None = the server default (on)
        yield render(req.conv, enable_thinking=req.enable_thinking is not False,
                     preserve_thinking=req.preserve_thinking is not False)


@pytest.mark.parametrize("api", ["anthropic", "openai", "responses"])
def test_consecutive_api_requests_render_append_only(api):
    for seed in range(40):
        previous = None
        for out in _api_renders(api, seed):
            if previous is not None:
                assert out.text.startswith(previous.text[: previous.stable_len]), (api, seed)
                assert out.system_len == previous.system_len
            previous = out
