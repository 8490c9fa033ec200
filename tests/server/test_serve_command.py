"""`q27py serve` as a process with the real tiny model: boots, answers every API, exits cleanly on SIGINT."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from grammars import check_anthropic, check_responses
from server_harness import http_request, sse_events

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served():
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("Q27_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "q27py", "serve", "--host", "127.0.0.1", "--port", "0",
                             "--api-key", "secret", "--max-context", "2048", "--no-think"],
                            cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    port = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"serving .* on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        proc.kill()
        pytest.fail("server did not start:\n" + "".join(lines))
    drain = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    drain.start()
    yield proc, port, lines
    if proc.poll() is None:
        proc.kill()
        proc.wait()


KEY = {"Authorization": "Bearer secret"}


def test_real_model_answers_all_apis(served):
    proc, port, _ = served
    status, _, raw = http_request(port, "POST", "/v1/chat/completions",
                                  {"model": "any", "max_tokens": 6, "messages": [{"role": "user", "content": "def f"}]},
                                  KEY, timeout=60)
    resp = json.loads(raw)
    assert status == 200, resp
    assert 1 <= resp["usage"]["completion_tokens"] <= 6
    status, _, raw = http_request(port, "POST", "/v1/messages",
                                  {"model": "any", "max_tokens": 6, "stream": True,
                                   "messages": [{"role": "user", "content": "hello"}]},
                                  {"x-api-key": "secret"}, timeout=60)
    assert status == 200
    out = check_anthropic(sse_events(raw))
    assert out["usage"]["output_tokens"] >= 1
    status, _, raw = http_request(port, "POST", "/v1/responses",
                                  {"model": "any", "max_output_tokens": 6, "stream": True, "input": "hi"},
                                  KEY, timeout=60)
    assert status == 200
    assert check_responses(sse_events(raw))["status"] in ("completed", "incomplete")
    status, _, raw = http_request(port, "POST", "/v1/completions",
                                  {"model": "any", "max_tokens": 4, "prompt": "import os\n"}, KEY, timeout=60)
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] in ("length", "stop")
    status, _, raw = http_request(port, "POST", "/v1/messages/count_tokens",
                                  {"model": "any", "messages": [{"role": "user", "content": "hello"}]},
                                  {"x-api-key": "secret"})
    assert status == 200 and json.loads(raw)["input_tokens"] > 3
    assert http_request(port, "GET", "/v1/models")[0] == 401
    metrics = http_request(port, "GET", "/metrics", None, KEY)[2].decode()
    assert 'vllm:num_requests_running{model_name="q36-tiny-agent"} 0' in metrics


def test_prefix_reuse_reported_in_usage_and_metrics(served):
    """The second turn of a conversation restores the first turn's prefix on the real engine."""
    proc, port, _ = served
    first = [{"role": "system", "content": "You write Python. " * 40}, {"role": "user", "content": "def add"}]
    body = {"model": "any", "max_tokens": 3, "messages": first}
    status, _, raw = http_request(port, "POST", "/v1/chat/completions", body, KEY, timeout=60)
    assert status == 200
    reply = json.loads(raw)["choices"][0]["message"]["content"] or "ok"
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and sub"}]
    status, _, raw = http_request(port, "POST", "/v1/chat/completions", dict(body, messages=second), KEY, timeout=60)
    usage = json.loads(raw)["usage"]
    assert status == 200 and usage["prompt_tokens_details"]["cached_tokens"] > 100
    status, _, raw = http_request(port, "POST", "/v1/messages",
                                  {"model": "any", "max_tokens": 3, "system": "You write Python. " * 40,
                                   "messages": [{"role": "user", "content": "def mul"}]},
                                  {"x-api-key": "secret"}, timeout=60)
    assert status == 200 and json.loads(raw)["usage"]["cache_read_input_tokens"] > 100  # the shared system block
    metrics = http_request(port, "GET", "/metrics", None, KEY)[2].decode()
    hits = re.search(r'q27py_prefix_cache_hits_total\{model_name="q36-tiny-agent"\} (\d+)', metrics)
    assert hits and int(hits.group(1)) >= 2
    assert re.search(r'q27py_prefix_cache_reused_tokens_total\{model_name="q36-tiny-agent"\} [1-9]', metrics)


def test_sigint_exits_cleanly(served):
    proc, port, lines = served
    proc.send_signal(signal.SIGINT)
    assert proc.wait(20) == 0, "".join(lines)
