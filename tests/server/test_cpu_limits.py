"""Output limits on the CPU path (q27py/config.py ServerConfig.cpu_*): a client that sends no
max_tokens gets one that fits the bundled model, a client that asks for far more (Claude Code's
32,000) is held to the ceiling, and the reasoning budget leaves room for the answer."""

from __future__ import annotations

import argparse
import json

from server_harness import http_request

from q27py.commands import serve
from q27py.config import Q27Config, apply_device_defaults


def _args(*argv):
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(list(argv))


def test_cpu_defaults_replace_the_gpu_ones():
    cpu = serve.build_config(_args(), environ={})
    assert cpu.engine.device == "cpu"
    s = cpu.server
    assert (s.default_max_tokens, s.reasoning_budget, s.max_tokens_ceiling) == (1024, 256, 4096)
    assert s.reasoning_budget < s.default_max_tokens  # a forced close still leaves room to answer
    gpu = serve.build_config(_args("--device", "cuda"), environ={}).server
    assert (gpu.default_max_tokens, gpu.reasoning_budget, gpu.max_tokens_ceiling) == (32768, None, None)


def test_flags_win_over_the_cpu_defaults():
    s = serve.build_config(_args("--default-max-tokens", "300", "--reasoning-budget", "50",
                                 "--max-tokens-ceiling", "700"), environ={}).server
    assert (s.default_max_tokens, s.reasoning_budget, s.max_tokens_ceiling) == (300, 50, 700)


def test_apply_device_defaults_reads_the_knobs():
    cfg = Q27Config()
    cfg.server.cpu_default_max_tokens, cfg.server.cpu_max_tokens_ceiling = 77, 99
    apply_device_defaults(cfg)
    assert (cfg.server.default_max_tokens, cfg.server.max_tokens_ceiling) == (77, 99)


def _chat(live, **extra):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    status, _, raw = http_request(live.port, "POST", "/v1/chat/completions", body)
    assert status == 200, raw
    return json.loads(raw)


def test_service_applies_default_and_ceiling(make_server):
    live = make_server(lambda prompt: "ok", default_max_tokens=1024, max_tokens_ceiling=4096, reasoning_budget=256)
    _chat(live)  # no max_tokens: the default
    _chat(live, max_tokens=32000)  # asks for more than the ceiling
    _chat(live, max_tokens=12)  # a smaller request is kept
    assert [r.max_tokens for r in live.engine.requests] == [1024, 4096, 12]
