"""Three `q27py serve` replicas (the bundled model) behind the smg router on loopback.

The router is an external test tool (.ci/run: `pip install smg==1.13.0` into its own venv);
without it these tests skip. The fleet is the documented one (tools/fleet.py, docs/DEPLOY.md):
cache-aware placement, conversations pinned by their session header, an API key checked by
the router and by every replica. Nothing here depends on what the model says: only on
cached-token counts, which replica served, and greedy answers being equal to each other.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import fleet as fleet_tool  # noqa: E402

pytestmark = pytest.mark.slow

KEY = "fleet-test-key"
SERVE_ARGS = ["--max-context", "2048", "--no-think"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if fleet_tool.find_router() is None:
        pytest.skip("smg router not installed (.ci/run installs smg==%s; or set $Q27_ROUTER)"
                    % fleet_tool.ROUTER_VERSION)
    logs = tmp_path_factory.mktemp("fleet")
    f = fleet_tool.Fleet(3, serve_args=SERVE_ARGS, api_key=KEY, router_args=fleet_tool.STICKY_ARGS, log_dir=logs)
    with f:
        yield f


def post(f, path, body, headers=None, timeout=60):
    return fleet_tool.request(f.url + path, body, dict(f.auth, **(headers or {})), timeout=timeout)


def chat_turn(f, history, text, headers=None, max_tokens=4):
    """One chat turn through the router; appends the user turn and the reply to `history`."""
    history.append({"role": "user", "content": text})
    status, body = post(f, "/v1/chat/completions", {"model": f.model, "max_tokens": max_tokens,
                                                    "temperature": 0, "messages": history}, headers)
    assert status == 200, body
    history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"] or "ok"})
    return body


def served_by(f, before: list[float]) -> list[int]:
    after = f.generations()
    return [i for i, (a, b) in enumerate(zip(after, before)) if a > b]


def test_router_needs_the_key_and_passes_every_api(fleet):
    model = fleet.model
    status, body = fleet_tool.request(fleet.url + "/v1/chat/completions",
                                      {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    assert status == 401, body  # the router checks the key before any replica sees the request
    status, body = post(fleet, "/v1/chat/completions",
                        {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "def f"}]})
    assert status == 200 and body["object"] == "chat.completion" and body["usage"]["completion_tokens"] >= 1
    # Anthropic Messages, with the headers Claude Code sends (the router forwards anthropic-*)
    status, body = post(fleet, "/v1/messages?beta=true",
                        {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "hello"}]},
                        {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"})
    assert status == 200 and body["type"] == "message" and body["usage"]["output_tokens"] >= 1, body
    status, body = post(fleet, "/v1/messages/count_tokens",
                        {"model": model, "messages": [{"role": "user", "content": "hello"}]})
    assert status == 200 and body["input_tokens"] > 3
    # Responses: the plain fields pass (docs/DEPLOY.md: smg 1.13.0 refuses Codex's client_metadata)
    status, body = post(fleet, "/v1/responses", {"model": model, "max_output_tokens": 3, "temperature": 0,
                                                 "input": "hi"})
    assert status == 200 and body["object"] == "response" and body["status"] in ("completed", "incomplete"), body
    status, body = post(fleet, "/v1/completions", {"model": model, "max_tokens": 3, "prompt": "import os\n"})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop")


def test_streaming_passes_through(fleet):
    """An Anthropic stream through the router: its events in order, read until message_stop
    (with an overall deadline, so a stream the router never ends fails instead of hanging)."""
    import http.client

    conn = http.client.HTTPConnection(fleet_tool.HOST, fleet.router_port, timeout=30)
    try:
        conn.request("POST", "/v1/messages",
                     json.dumps({"model": fleet.model, "max_tokens": 3, "stream": True,
                                 "messages": [{"role": "user", "content": "hi"}]}),
                     dict(fleet.auth, **{"content-type": "application/json"}))
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
        events, deadline = [], time.monotonic() + 90
        while "message_stop" not in events:
            assert time.monotonic() < deadline, f"stream not finished after 90 s: {events}"
            line = r.readline()
            assert line, f"stream closed before message_stop: {events}"
            if line.startswith(b"event:"):
                events.append(line.split(b":", 1)[1].strip().decode())
    finally:
        conn.close()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_delta" in events


def test_a_conversation_stays_on_its_replica_and_reuses_its_prefix(fleet):
    history = [{"role": "system", "content": fleet_tool.session_system(100)}]
    before = fleet.generations()
    first = chat_turn(fleet, history, fleet_tool.session_turn(100, 0))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < first["usage"]["prompt_tokens"] // 2
    home = served_by(fleet, before)
    assert len(home) == 1
    for t in range(1, 4):
        before = fleet.generations()
        body = chat_turn(fleet, history, fleet_tool.session_turn(100, t))
        usage = body["usage"]
        assert served_by(fleet, before) == home, f"turn {t} left its replica"
        # everything up to the previous reply was restored, not prefilled
        assert usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] * 0.7, usage


def test_new_conversations_spread_over_the_replicas(fleet):
    used = set()
    for c in range(200, 206):
        before = fleet.generations()
        chat_turn(fleet, [{"role": "system", "content": fleet_tool.session_system(c)}], fleet_tool.session_turn(c, 0))
        used.update(served_by(fleet, before))
    assert len(used) >= 2, f"six unrelated conversations all went to replica(s) {used}"


def test_session_header_pins_a_conversation_whatever_its_text(fleet):
    """Claude Code's X-Claude-Code-Session-Id (and Codex's session-id) pin a session, even when a
    turn shares no text with the previous one (e.g. after a client-side compaction)."""
    for header in ("X-Claude-Code-Session-Id", "session-id"):
        homes = set()
        for c in range(300, 304):
            before = fleet.generations()
            chat_turn(fleet, [{"role": "system", "content": fleet_tool.session_system(c)}],
                      fleet_tool.session_turn(c, 0), {header: f"sess-{header}"})
            homes.update(served_by(fleet, before))
        assert len(homes) == 1, f"{header}: one session went to replicas {homes}"


def test_a_killed_replica_fails_over_cold_and_correct(fleet):
    """Kill the replica that holds a conversation: the next turn is answered by another replica
    from scratch (no cached tokens), gives the same greedy answer as that replica gives directly,
    and the turn after is warm again on its new home."""
    history = [{"role": "system", "content": fleet_tool.session_system(400)}]
    chat_turn(fleet, history, fleet_tool.session_turn(400, 0))
    before = fleet.generations()
    chat_turn(fleet, history, fleet_tool.session_turn(400, 1))
    (home,) = served_by(fleet, before)
    fleet.replicas[home].kill()

    history.append({"role": "user", "content": fleet_tool.session_turn(400, 2)})
    body = {"model": fleet.model, "max_tokens": 6, "temperature": 0, "messages": history}
    status, answer = post(fleet, "/v1/chat/completions", body)
    if status != 200:  # a client may have to retry once while the router notices
        time.sleep(2)
        status, answer = post(fleet, "/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # cold on its new replica
    survivors = [r for r in fleet.replicas if r.alive]
    assert len(survivors) == 2
    direct = []
    for r in survivors:  # greedy: every replica, warm or cold, gives the same text
        status, d = fleet_tool.request(r.url + "/v1/chat/completions", body, fleet.auth, timeout=60)
        assert status == 200
        direct.append(d["choices"][0]["message"]["content"])
    assert direct == [answer["choices"][0]["message"]["content"]] * 2
    history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or "ok"})
    again = chat_turn(fleet, history, fleet_tool.session_turn(400, 3))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # settled on a live replica
    # sessions started before the kill keep being answered
    status, _ = post(fleet, "/v1/chat/completions",
                     {"model": fleet.model, "max_tokens": 2, "messages": [{"role": "user", "content": "still there?"}]})
    assert status == 200
