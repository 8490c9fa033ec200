#!/usr/bin/env python3
"""N `q27py serve` replicas behind the smg router on one box, and a replayed session to measure reuse.

    python3 tools/fleet.py up --replicas 3            # serve until Ctrl-C; prints the router URL
    python3 tools/fleet.py replay --turns 6           # the same session with and without affinity

The router is an external tool (pip install smg==1.13.0, in its own venv); its binary is found
from $Q27_ROUTER, then PATH, then the venv .ci/run makes. A vllm-router binary (0.1.17) works
too, for comparison (docs/DEPLOY.md says why smg is the documented one). Everything binds
127.0.0.1. tests/fleet/test_router.py drives this class.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
ROUTER_VERSION = "1.13.0"


def find_router() -> str | None:
    candidates = [os.environ.get("Q27_ROUTER"), shutil.which("smg")]
    clients = os.environ.get("Q27_E2E_CLIENTS", str(Path.home() / ".cache" / "q27py-e2e-clients"))
    candidates.append(str(Path(clients) / "router-venv" / "bin" / "smg"))
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    return None


# The documented smg deployment (docs/DEPLOY.md): cache-aware placement of new conversations, then
# each conversation pinned by the session header its client sends (Claude Code, Codex, anyone else).
SESSION_HEADERS = ("x-claude-code-session-id", "session-id", "x-smg-routing-key")
STICKY_ARGS = ("--sticky-sessions", "--routing-key-headers", *SESSION_HEADERS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def request(url: str, body=None, headers=None, timeout: float = 120.0, method: str | None = None):
    """(status, parsed JSON or text) for one HTTP call; never raises on HTTP errors."""
    data = json.dumps(body).encode() if body is not None else None
    hdrs = {"content-type": "application/json"} if data else {}
    hdrs.update(headers or {})
    req = urllib.request.Request(url, data=data, headers=hdrs, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


class Replica:
    def __init__(self, index: int, serve_args: list[str], env: dict):
        self.index = index
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "q27py", "serve", "--host", HOST, "--port", "0",
                                      *serve_args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.port: int | None = None

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.lines.append(line)
            m = re.search(r"serving .* on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()
                return
        self.proc.kill()
        raise RuntimeError(f"replica {self.index} did not start:\n" + "".join(self.lines))

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the replica dies as a crashed process would, mid-whatever."""
        if self.alive:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


class Fleet:
    """Replicas + router on loopback. `policy` is the router's (cache_aware | round_robin | ...)."""

    def __init__(self, replicas: int = 3, *, policy: str = "cache_aware", serve_args=(), api_key: str | None = None,
                 router: str | None = None, router_args=(), health_interval_s: int = 1, log_dir: Path | None = None):
        self.router_bin = router or find_router()
        if self.router_bin is None:
            raise FileNotFoundError("smg not found (pip install smg==%s; or set $Q27_ROUTER)" % ROUTER_VERSION)
        self.n = replicas
        self.policy = policy
        self.api_key = api_key
        self.serve_args = list(serve_args) + (["--api-key", api_key] if api_key else [])
        self.health_interval_s = health_interval_s
        self.router_args = list(router_args)
        self._model: str | None = None
        self.log_dir = log_dir
        self.replicas: list[Replica] = []
        self.router_proc: subprocess.Popen | None = None
        self.router_port: int | None = None
        self._router_log = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.router_port}"

    @property
    def model(self) -> str:
        """The served model's id: smg routes by it (vllm-router and q27py accept any name)."""
        if self._model is None:  # asked once, of a live replica (a test may kill any of them later)
            live = next(r for r in self.replicas if r.alive)
            status, body = request(live.url + "/v1/models", headers=self.auth, timeout=10)
            self._model = body["data"][0]["id"]
        return self._model

    @property
    def auth(self) -> dict:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def __enter__(self) -> "Fleet":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = 120.0) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        env.pop("Q27_API_KEY", None)
        env.pop("Q27_PORT", None)
        deadline = time.monotonic() + timeout_s
        self.replicas = [Replica(i, self.serve_args, env) for i in range(self.n)]
        for r in self.replicas:
            r.wait_ready(deadline)
        self.router_port = free_port()
        smg = Path(self.router_bin).name == "smg"
        cmd = [self.router_bin] + (["launch"] if smg else []) + [
               "--host", HOST, "--port", str(self.router_port),
               "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
               "--worker-urls", *[r.url for r in self.replicas],
               "--policy", self.policy,
               # A dead replica leaves the pool after one failed probe; a request already sent to it
               # is retried on another replica by the router itself.
               "--health-check-interval-secs", str(self.health_interval_s), "--health-failure-threshold", "1",
               "--worker-startup-timeout-secs", str(int(timeout_s)), "--worker-startup-check-interval", "1",
               "--log-level", "warn" if smg else "warning"]
        if smg:
            # no tokenizer at the router: it routes on request text; q27py tokenizes
            cmd += ["--disable-tokenizer-autoload"]
        cmd += self.router_args
        if self.api_key:  # smg: clients must present it (Bearer), and it is forwarded to the replicas
            cmd += ["--api-key", self.api_key]
        log = open(self.log_dir / "router.log", "w") if self.log_dir else subprocess.DEVNULL
        self._router_log = log if self.log_dir else None
        self.router_proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while time.monotonic() < deadline:
            if self.router_proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.router_proc.returncode}")
            try:
                status, _ = request(self.url + "/v1/models", headers=self.auth, timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("router did not come up")

    def stop(self) -> None:
        if self.router_proc is not None and self.router_proc.poll() is None:
            self.router_proc.terminate()
            try:
                self.router_proc.wait(10)
            except subprocess.TimeoutExpired:
                self.router_proc.kill()
        if self._router_log:
            self._router_log.close()
        for r in self.replicas:
            r.stop()

    # ---- reading the replicas ---------------------------------------------

    def metrics(self, replica: Replica) -> dict[str, float]:
        """Unlabelled-by-API sample values of one replica's /metrics: {'name{labels}': value}."""
        status, text = request(replica.url + "/metrics", headers=self.auth, timeout=10)
        assert status == 200, text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, val = line.rpartition(" ")
                out[key] = float(val)
        return out

    def generations(self) -> list[float]:
        """Generations each live replica has finished (dead ones read as -1)."""
        counts = []
        for r in self.replicas:
            if not r.alive:
                counts.append(-1.0)
                continue
            m = self.metrics(r)
            counts.append(sum(v for k, v in m.items() if k.startswith("vllm:e2e_request_latency_seconds_count")))
        return counts


# ---- a replayed session ------------------------------------------------------

def session_system(conversation: int) -> str:
    """A system prompt of its own per conversation (about 150 tokens), different from the first
    characters on, so only a conversation's own earlier turns can be reused, never a neighbour's."""
    return f"Session {conversation}: you maintain module_{conversation}.py and answer in short Python. " * 8


def session_turn(conversation: int, turn: int) -> str:
    return f"step {turn}: add a helper named f{conversation}_{turn}"


def replay(fleet: Fleet, conversations: int, turns: int, max_tokens: int = 4, session_header: bool = False) -> dict:
    """Interleave `conversations` chat sessions turn by turn; sum prompt and cached tokens.
    session_header: send each conversation's id as X-Claude-Code-Session-Id, as Claude Code does."""
    histories = {c: [{"role": "system", "content": session_system(c)}] for c in range(conversations)}
    prompt = cached = 0
    per_request = []
    model = fleet.model
    for t in range(turns):
        for c in range(conversations):
            histories[c].append({"role": "user", "content": session_turn(c, t)})
            status, body = request(fleet.url + "/v1/chat/completions",
                                   {"model": model, "max_tokens": max_tokens, "temperature": 0,
                                    "messages": histories[c]},
                                   dict(fleet.auth, **({"x-claude-code-session-id": f"s{c}"} if session_header else {})))
            if status != 200:
                raise RuntimeError(f"turn {t} of conversation {c}: HTTP {status}: {body}")
            usage = body["usage"]
            prompt += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            per_request.append(usage["prompt_tokens_details"]["cached_tokens"])
            histories[c].append({"role": "assistant", "content": body["choices"][0]["message"]["content"] or "ok"})
    return {"prompt_tokens": prompt, "cached_tokens": cached, "reuse": round(cached / prompt, 4) if prompt else 0.0,
            "cached_per_request": per_request}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start replicas + router and wait")
    up.add_argument("--replicas", type=int, default=3)
    up.add_argument("--policy", default="cache_aware")
    up.add_argument("--api-key")
    up.add_argument("serve_args", nargs="*", help="extra `q27py serve` flags (after --)")
    rp = sub.add_parser("replay", help="measure prefix reuse with and without affinity routing")
    rp.add_argument("--replicas", type=int, default=3)
    rp.add_argument("--conversations", type=int, default=4)
    rp.add_argument("--turns", type=int, default=6)
    rp.add_argument("--policies", default="cache_aware,round_robin,round_robin+sticky,cache_aware+sticky")
    args = p.parse_args(argv)
    base = ["--max-context", "4096", "--no-think"]
    if args.cmd == "up":
        sticky = STICKY_ARGS if Path(find_router() or "").name == "smg" else ()  # smg's flags only
        with Fleet(args.replicas, policy=args.policy, api_key=args.api_key, serve_args=base + args.serve_args,
                   router_args=sticky) as f:
            print(f"router {f.url} -> " + " ".join(r.url for r in f.replicas), flush=True)
            try:
                while all(r.alive for r in f.replicas) or f.router_proc.poll() is None:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
        return 0
    results = {}
    for name in args.policies.split(","):
        # "POLICY+sticky": also pin each conversation by its session header (smg --sticky-sessions)
        policy, _, sticky = name.partition("+")
        with Fleet(args.replicas, policy=policy, serve_args=base, router_args=STICKY_ARGS if sticky else ()) as f:
            t0 = time.monotonic()
            r = replay(f, args.conversations, args.turns, session_header=bool(sticky))
            r["seconds"] = round(time.monotonic() - t0, 2)
            r["generations_per_replica"] = f.generations()
        results[name] = r
        print(json.dumps({name: {k: v for k, v in r.items() if k != "cached_per_request"}}), flush=True)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
