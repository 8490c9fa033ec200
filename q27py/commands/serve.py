"""`q27py serve`: the Anthropic Messages, OpenAI Chat/Completions and Responses APIs on one port.

Flags and environment variables map into q27py.config (Q27_API_KEY, Q27_HOST,
Q27_PORT, Q27_MODEL, ...); API keys from the env, every --api-key and the
--api-key-file are all accepted together.
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import signal
import sys
from pathlib import Path

from q27py.commands.engine_flags import add_engine_arguments, apply_engine_arguments
from q27py.config import Q27Config, apply_device_defaults, apply_env, apply_overrides
from q27py.errors import ConfigError

log = logging.getLogger("q27py.server")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, serving=True)
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8080)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require this API key (repeatable; also $Q27_API_KEY, comma-separated)")
    p.add_argument("--api-key-file", type=Path, metavar="FILE",
                   help="file with one API key per line (# comments)")
    think = p.add_mutually_exclusive_group()
    think.add_argument("--think", dest="default_thinking", action="store_true", default=None,
                       help="think before answering unless a request says otherwise (default)")
    think.add_argument("--no-think", dest="default_thinking", action="store_false",
                       help="answer without a think block unless a request asks for one")
    p.add_argument("--reasoning-budget", type=int, metavar="N",
                   help="force-close a think block after N tokens (default: 256 on the CPU, else half of max_tokens)")
    p.add_argument("--default-max-tokens", type=int, metavar="N",
                   help="max_tokens when a request gives none (default: 1024 on the CPU, else 32768)")
    p.add_argument("--max-tokens-ceiling", type=int, metavar="N",
                   help="ceiling on every request's max_tokens (default: 4096 on the CPU, else none)")
    from q27py.chat.render import TEMPLATES, TOOL_DIALECTS

    p.add_argument("--chat-template", choices=TEMPLATES, default=None,
                   help="template variant (default: chosen from the checkpoint's template text or name; logged)")
    p.add_argument("--tool-dialect", choices=TOOL_DIALECTS, default=None,
                   help="tool-call syntax forced calls use (default: from the checkpoint's template text; xml)")
    p.add_argument("--metrics-without-key", action="store_true", default=None,
                   help="serve GET /metrics without the API key (for Prometheus / inference-gateway scrapers)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(cfg: Q27Config) -> None:
    if not cfg.server.api_keys and not is_loopback(cfg.server.host):
        log.warning("binding %s without an API key: anyone who can reach this address can use the model "
                    "(pass --api-key or --api-key-file)", cfg.server.host)


def build_config(args: argparse.Namespace, environ=None) -> Q27Config:
    from q27py.server.auth import load_key_file, validate_keys

    cfg = apply_env(Q27Config(), environ)
    apply_engine_arguments(cfg, args)
    apply_device_defaults(cfg)  # CPU output limits; the server flags below still win
    keys = list(cfg.server.api_keys) + list(args.api_key or [])
    if args.api_key_file is not None:
        keys += load_key_file(args.api_key_file)
    apply_overrides(cfg.server, {"host": args.host, "port": args.port, "api_keys": validate_keys(keys),
                                 "default_thinking": args.default_thinking,
                                 "reasoning_budget": args.reasoning_budget,
                                 "default_max_tokens": args.default_max_tokens,
                                 "max_tokens_ceiling": getattr(args, "max_tokens_ceiling", None),
                                 "chat_template": getattr(args, "chat_template", None),
                                 "tool_dialect": getattr(args, "tool_dialect", None),
                                 "metrics_without_key": getattr(args, "metrics_without_key", None)})
    if cfg.server.reasoning_budget is not None and cfg.server.reasoning_budget < 1:
        raise ConfigError("--reasoning-budget must be at least 1")
    if not 0 <= cfg.server.port <= 65535:
        raise ConfigError(f"--port {cfg.server.port} is not a TCP port")
    return cfg


def build_app(cfg: Q27Config, engine):
    """The App around a loaded engine (anything with the Engine protocol, engine/api.py)."""
    from q27py.chat.render import choose_dialect
    from q27py.server.app import App
    from q27py.server.auth import KeyRing
    from q27py.server.bridge import EngineBridge
    from q27py.server.service import ChatService
    from q27py.tokenizer import load_stop_ids

    stop_ids = engine.tokenizer.eos_ids or load_stop_ids(cfg.engine.model_dir)
    dialect = choose_dialect(engine.model_dir, cfg.server.chat_template, cfg.server.tool_dialect)  # logs the choice
    service = ChatService(EngineBridge(engine), engine.tokenizer, model_name=engine.model_name,
                          template=dialect.template, stop_ids=stop_ids, config=cfg.server,
                          ping_interval_s=cfg.server.keepalive_interval_s, tool_dialect=dialect.tool_dialect)
    return App(service, KeyRing(cfg.server.api_keys))


def limits_for(cfg: Q27Config):
    from q27py.server.http import Limits

    s = cfg.server
    return Limits(max_body_bytes=s.max_body_bytes, header_timeout_s=s.header_timeout_s,
                  body_timeout_s=s.body_timeout_s, shutdown_grace_s=s.shutdown_grace_s)


async def serve_app(app, cfg: Q27Config) -> None:
    """Serve until SIGINT/SIGTERM (a second signal stops at once)."""
    import trio

    server = app.http_server(limits_for(cfg))
    bridge = app.service.bridge
    bridge.start()
    try:
        async with trio.open_nursery() as nursery:
            async def run_server(task_status=trio.TASK_STATUS_IGNORED):
                await server.serve(cfg.server.host, cfg.server.port, task_status=task_status)
                nursery.cancel_scope.cancel()

            async def watch_signals():
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        if server.draining:
                            log.warning("second signal: stopping now")
                            nursery.cancel_scope.cancel()
                            return
                        log.info("%s: finishing in-flight requests, then exiting", signal.Signals(signum).name)
                        server.shutdown()

            nursery.start_soon(watch_signals)
            port = await nursery.start(run_server)
            auth = f"{len(app.keys)} API key(s)" if app.keys.enabled else "no API key"
            log.info("serving %s on http://%s:%d (%s, context %d tokens, thinking %s)",
                     app.service.model_name, cfg.server.host, port, auth, app.service.max_context,
                     "on" if cfg.server.default_thinking else "off")
    finally:
        bridge.stop()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = build_config(args)
    warn_if_exposed(cfg)

    import trio

    from q27py.engine.engine import LocalEngine

    engine = LocalEngine.load(cfg)
    # The vocabulary index for output constraints, off the first request; then the process's
    # long-lived objects (tokenizer, index: ~2M of them) leave the cyclic collector's reach, or
    # every full collection rescans them -- an ~80 ms pause inside whichever decode step it hits.
    engine.constraints.prepare(on_ready=gc.freeze)
    app = build_app(cfg, engine)
    trio.run(serve_app, app, cfg)
    return 0
