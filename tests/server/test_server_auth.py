"""API keys: sources, header forms, constant-time comparison, 401 shapes, the open /health."""

from __future__ import annotations

import argparse
import hmac
import json

import pytest

from q27py.commands import serve
from q27py.errors import ConfigError
from q27py.server import auth
from q27py.server.auth import KeyRing, load_key_file
from server_harness import http_request


def test_keyring_accepts_bearer_and_x_api_key():
    ring = KeyRing(["alpha", "beta"])
    assert ring.allows({"authorization": "Bearer alpha"})
    assert ring.allows({"authorization": "bearer beta"})
    assert ring.allows({"x-api-key": "beta"})
    assert not ring.allows({"authorization": "Bearer gamma"})
    assert not ring.allows({"authorization": "Basic alpha"})
    assert not ring.allows({"x-api-key": "alph"})
    assert not ring.allows({})
    assert KeyRing([]).allows({})


def test_every_key_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    ring = KeyRing(["first", "a-much-longer-second-key", "x"])
    assert ring.allows({"x-api-key": "first"})
    # no early exit on a match, and fixed-length digests whatever the key lengths
    assert calls == [(32, 32)] * 3


def test_key_file_format(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# operators\nkey-one\n\n   key-two  \n# old: key-zero\n")
    assert load_key_file(f) == ["key-one", "key-two"]
    empty = tmp_path / "empty"
    empty.write_text("# nothing here\n\n")
    with pytest.raises(ConfigError, match="no keys"):
        load_key_file(empty)
    with pytest.raises(ConfigError, match="cannot read"):
        load_key_file(tmp_path / "missing")
    with pytest.raises(ConfigError):
        KeyRing(["has space"])


def _args(**kw):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    argv = []
    for key, value in kw.items():
        flag = "--" + key.replace("_", "-")
        for v in value if isinstance(value, list) else [value]:
            argv += [flag] if v is True else [flag, str(v)]
    return parser.parse_args(argv)


def test_keys_from_env_flags_and_file_all_count(tmp_path):
    f = tmp_path / "keys"
    f.write_text("from-file\n")
    cfg = serve.build_config(_args(api_key=["flag-a", "flag-b"], api_key_file=f),
                             environ={"Q27_API_KEY": "env-a,env-b"})
    assert sorted(cfg.server.api_keys) == ["env-a", "env-b", "flag-a", "flag-b", "from-file"]


def test_serve_flags_map_into_config():
    cfg = serve.build_config(_args(port=9000, no_think=True, max_context=4096, reasoning_budget=256,
                                   default_max_tokens=512), environ={"Q27_PORT": "7000", "Q27_HOST": "127.0.0.2"})
    assert (cfg.server.port, cfg.server.host) == (9000, "127.0.0.2")
    assert cfg.server.default_thinking is False and cfg.engine.max_context == 4096
    assert cfg.server.reasoning_budget == 256 and cfg.server.default_max_tokens == 512
    assert serve.build_config(_args(think=True), environ={}).server.default_thinking is True
    with pytest.raises(ConfigError):
        serve.build_config(_args(reasoning_budget=0), environ={})


def test_non_loopback_bind_without_key_warns(caplog):
    assert serve.is_loopback("127.0.0.1") and serve.is_loopback("::1") and serve.is_loopback("localhost")
    assert not serve.is_loopback("0.0.0.0") and not serve.is_loopback("192.168.1.10")
    cfg = serve.build_config(_args(host="0.0.0.0"), environ={})
    with caplog.at_level("WARNING"):
        serve.warn_if_exposed(cfg)
    assert "without an API key" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        serve.warn_if_exposed(serve.build_config(_args(host="0.0.0.0", api_key="k"), environ={}))
    assert caplog.text == ""


def test_live_auth(make_server):
    live = make_server(lambda p: "hi", keys=("k-one", "k-two"), default_thinking=False)
    ant = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}

    status, _, raw = http_request(live.port, "POST", "/v1/messages", ant)
    err = json.loads(raw)
    assert status == 401 and err["type"] == "error" and err["error"]["type"] == "authentication_error"
    status, _, raw = http_request(live.port, "POST", "/v1/chat/completions", chat,
                                  {"Authorization": "Bearer wrong"})
    err = json.loads(raw)
    assert status == 401 and err["error"]["code"] == "invalid_api_key" and "invalid" in err["error"]["message"]
    for path in ("/v1/models", "/metrics", "/v1/responses"):
        method = "POST" if path == "/v1/responses" else "GET"
        assert http_request(live.port, method, path, {"model": "m", "input": "x"})[0] == 401

    assert http_request(live.port, "POST", "/v1/messages", ant, {"x-api-key": "k-one"})[0] == 200
    assert http_request(live.port, "POST", "/v1/chat/completions", chat, {"Authorization": "Bearer k-two"})[0] == 200
    assert http_request(live.port, "GET", "/v1/models", None, {"x-api-key": "k-two"})[0] == 200
    assert http_request(live.port, "GET", "/health")[0] == 200, "/health stays open for probes"
    assert len(live.engine.requests) == 2, "refused requests never reach the engine"


@pytest.mark.parametrize("value", [",", " , ", "a,,b", "key,"])
def test_an_api_key_variable_naming_an_empty_key_refuses_to_start(value):
    """Q27_API_KEY="," used to start with no key at all; like an empty key file it must refuse."""
    with pytest.raises(ConfigError, match="Q27_API_KEY"):
        serve.build_config(_args(), environ={"Q27_API_KEY": value})
    assert serve.build_config(_args(), environ={"Q27_API_KEY": "a, b"}).server.api_keys == ["a", "b"]


def test_bearer_and_x_api_key_together_pass_when_either_is_valid():
    """The documented rule (docs/SERVER.md): any presented key that is valid lets the request in."""
    ring = KeyRing(["right"])
    assert ring.allows({"authorization": "Bearer wrong", "x-api-key": "right"})
    assert ring.allows({"authorization": "Bearer right", "x-api-key": "wrong"})
    assert not ring.allows({"authorization": "Bearer wrong", "x-api-key": "also-wrong"})
