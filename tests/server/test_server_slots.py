"""Slots through the real HTTP app (issue 15): concurrent streams interleave, /metrics says
running = active slots and waiting = queue, a disconnect frees its slot for the queue."""

import json
import re
import socket
import threading
import time

import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.commands.serve import build_app
from q27py.config import Q27Config
from q27py.engine.engine import LocalEngine
from server_harness import HOST, LiveServer, fast_limits, http_request


def chat(content, stream=False, max_tokens=None):
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "stream": stream,
            "chat_template_kwargs": {"enable_thinking": False}}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def gauge(port, name):
    text = http_request(port, "GET", "/metrics")[2].decode()
    return float(re.search(rf'^{re.escape(name)}\{{[^}}]*\}} (\S+)$', text, re.M).group(1))


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def timed_post(live, body, done, name):
    status, _, raw = http_request(live.port, "POST", "/v1/chat/completions", body, timeout=60)
    done[name] = (time.monotonic(), status, raw)


def test_a_short_request_finishes_while_a_long_stream_runs(make_server):
    script = lambda p: "long " * 150 if "long" in p else "short answer"  # noqa: E731
    live = make_server(script, token_delay_s=0.005, tokens_per_chunk=1, max_slots=2)
    done = {}
    a = threading.Thread(target=timed_post, args=(live, chat("long please", stream=True), done, "long"))
    a.start()
    wait_for(lambda: live.engine.requests)
    b = threading.Thread(target=timed_post, args=(live, chat("short please"), done, "short"))
    b.start()
    wait_for(lambda: len(live.engine.requests) == 2)
    assert gauge(live.port, "vllm:num_requests_running") == 2
    assert gauge(live.port, "vllm:num_requests_waiting") == 0
    assert gauge(live.port, "q27py_max_running_requests") == 2
    b.join(30)
    a.join(30)
    assert done["short"][1] == 200 and done["long"][1] == 200
    assert done["short"][0] < done["long"][0], "the short request waited for the long stream"
    assert "short answer" in json.loads(done["short"][2])["choices"][0]["message"]["content"]
    wait_for(lambda: gauge(live.port, "vllm:num_requests_running") == 0)


def test_the_third_request_queues_and_a_disconnect_frees_its_slot(make_server):
    live = make_server(lambda p: "tok " * 250, token_delay_s=0.005, tokens_per_chunk=1, max_slots=2)
    done = {}
    first = threading.Thread(target=timed_post, args=(live, chat("one"), done, "one"))
    first.start()
    payload = json.dumps(chat("two", stream=True)).encode()
    sock = socket.create_connection((HOST, live.port))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\n\r\n"
                 .encode() + payload)
    wait_for(lambda: len(live.engine.requests) == 2)
    third = threading.Thread(target=timed_post, args=(live, chat("three"), done, "three"))
    third.start()
    wait_for(lambda: gauge(live.port, "vllm:num_requests_waiting") == 1)
    assert gauge(live.port, "vllm:num_requests_running") == 2
    sock.close()  # the second client leaves: its slot goes to the queued third request
    wait_for(lambda: len(live.engine.requests) == 3)
    assert "one" not in done, "the queued request started only because the first one ended"
    assert gauge(live.port, "vllm:num_requests_waiting") == 0
    first.join(60)
    third.join(60)
    assert done["one"][1] == 200 and done["three"][1] == 200


@pytest.fixture(scope="module")
def real():
    cfg = Q27Config()  # the CPU path's default slots
    cfg.engine.model_dir = DEFAULT_MODEL_DIR
    engine = LocalEngine.load(cfg)
    app = build_app(cfg, engine)
    bridge = app.service.bridge
    with LiveServer(app.http_server(fast_limits(body_timeout_s=60)), on_start=bridge.start,
                    on_stop=bridge.stop) as live:
        live.app, live.engine = app, engine
        yield live


def test_real_engine_serves_two_requests_at_once(real):
    assert real.app.service.bridge.max_slots == 4
    done = {}
    long = chat("Write a numbered list of 100 programming languages.", max_tokens=300)  # runs to its limit
    a = threading.Thread(target=timed_post, args=(real, long, done, "long"))
    a.start()
    wait_for(lambda: gauge(real.port, "vllm:num_requests_running") == 1, timeout=30)
    timed_post(real, chat("Hi", max_tokens=4), done, "short")
    a.join(120)
    assert done["short"][1] == 200 and done["long"][1] == 200
    long_usage = json.loads(done["long"][2])["usage"]["completion_tokens"]
    assert long_usage > 100, "the long request ended too early to show anything"
    assert done["short"][0] < done["long"][0], "the short request waited for the long one"
