"""Every runtime knob, typed, in one place.

Flags (q27py/commands/*) and environment variables map into these dataclasses
here and nowhere else: `apply_env` is the only reader of os.environ for knobs.
The model's own architecture lives in q27py/model/config.py (ModelConfig),
read from the checkpoint's config.json; nothing here describes the model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from q27py import DEFAULT_MODEL_DIR


@dataclass
class SpecConfig:
    """Self-speculative decoding (MTP draft ladder + suffix drafter).

    Defaults are measured on held-out code with the bundled model and priced with
    the CUDA path's measured round costs (docs/PERF.md, "Speculative decoding
    (reference path)"; tools/spec_measure.py). Deeper or wider settings commit
    more tokens per round but cost more per round than they gain there.
    """

    enabled: bool | None = None  # None: on when the checkpoint has an MTP head
    max_depth: int = 3  # MTP ladder depth ceiling (1..7)
    adaptive_depth: bool = True  # let the controller move depth within 1..max_depth (saves lanes at deep levels)
    confidence_margin: float = 0.0  # stop drafting at the first draft whose top1-top2 logit margin is below
    # this; 0 = off: every margin measured lost more tokens/round than the lanes it saved
    suffix: bool = True  # suffix drafter on/off
    suffix_min_match: int = 4  # shortest context-tail match that may propose
    max_verify_width: int = 8  # lanes in one verify (pending token + drafts); bounds suffix proposals. At most
    # 16, the reference path's row-independent size (wider verifies would not be bitwise plain decoding)
    arbitration: str = "agree"  # per-round drafter choice: agree | suffix_first | mtp
    # (engine/drafters.py DraftPlanner; "agree" measured above "suffix_first" in tokens/round and lanes)
    trace: bool = False  # record every round's drafter, drafts and accepted count in the stats


@dataclass
class EngineConfig:
    """What model runs where, and how much of it fits."""

    model_dir: Path = DEFAULT_MODEL_DIR
    device: str = "cpu"  # "cpu" (numpy reference) or "cuda" (fast path)
    dtype: str = "float32"  # reference path compute dtype: float32 | float64 | bfloat16 (bf16-rounded)
    backend: str = "auto"  # cuda only: "fast" (RawModule kernels) or "reference"; auto = fast
    tier: str | None = None  # weight tier when quantizing a bf16 checkpoint on load (q4s | q5f | q8 | None)
    max_context: int = 32768  # tokens per sequence (clamped to the model's max_position_embeddings)
    max_sequences: int = 4  # live sequences (slots) kept for prefix reuse
    prefill_chunk: int = 2048  # tokens per prefill chunk
    checkpoint_every: int = 4096  # prefix reuse: GDN snapshot every N prefill tokens (0 = off)
    prefix_cache_dir: Path | None = None  # persistent prefix cache (opt-in)
    prefix_cache_max_bytes: int = 8 << 30


@dataclass
class ServerConfig:
    """HTTP front end."""

    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: list[str] = field(default_factory=list)
    max_body_bytes: int = 32 << 20
    header_timeout_s: float = 30.0
    body_timeout_s: float = 120.0
    default_thinking: bool = True
    default_max_tokens: int = 32768  # when a client sends none (Codex never does); clamped to the context left
    reasoning_budget: int | None = None  # force-close <think> after this many tokens
    # Keep earlier turns' thinking in the prompt (Qwen3.6 preserve_thinking): the rendered
    # history then stays byte-stable across turns, which prefix reuse needs.
    preserve_thinking: bool = True
    default_temperature: float = 0.0  # when a request sends none; 0 = greedy
    keepalive_interval_s: float = 10.0  # ping / in_progress events while the engine is silent
    shutdown_grace_s: float = 10.0  # in-flight requests get this long on SIGINT/SIGTERM
    # GET /metrics without the API key, for scrapers that send none (Prometheus, the Kubernetes
    # inference gateway's endpoint picker); it carries counts and timings, never request content.
    metrics_without_key: bool = False


@dataclass
class Q27Config:
    engine: EngineConfig = field(default_factory=EngineConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


# Environment variables, all here. Value: (section, field, parser).
ENV_VARS = {
    "Q27_MODEL": ("engine", "model_dir", Path),
    "Q27_DEVICE": ("engine", "device", str),
    "Q27_MAX_CONTEXT": ("engine", "max_context", int),
    "Q27_PREFIX_CACHE": ("engine", "prefix_cache_dir", Path),
    "Q27_HOST": ("server", "host", str),
    "Q27_PORT": ("server", "port", int),
    "Q27_API_KEY": ("server", "api_keys", lambda s: [k for k in s.split(",") if k]),
}


def apply_env(cfg: Q27Config, environ: dict[str, str] | None = None) -> Q27Config:
    """Overlay environment variables onto cfg (flags are applied after, so they win)."""
    environ = os.environ if environ is None else environ
    for var, (section, name, parse) in ENV_VARS.items():
        if var in environ and environ[var] != "":
            setattr(getattr(cfg, section), name, parse(environ[var]))
    return cfg


def apply_overrides(section_obj, values: dict) -> None:
    """Set the given dataclass fields, ignoring None (an absent flag)."""
    names = {f.name for f in fields(section_obj)}
    for key, value in values.items():
        if value is None:
            continue
        if key not in names:
            raise KeyError(f"unknown setting {key!r} for {type(section_obj).__name__}")
        setattr(section_obj, key, value)
