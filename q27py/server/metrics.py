"""Counters and gauges, rendered by hand in the Prometheus text format (version 0.0.4).

The `vllm:` names are the ones existing routers and autoscalers already read
(num_requests_running / waiting, kv_cache_usage_perc, token counters), so a
q27py server can sit behind them unchanged. `q27py_` names add what is ours.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: dict[str, str]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in pairs.items()) + "}"


def _number(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


@dataclass
class EngineLoad:
    """A snapshot of the engine side, supplied by the bridge when metrics are scraped."""

    running: int
    waiting: int
    kv_cache_usage: float  # 0..1
    prefix: dict | None = None  # the engine's prefix-cache counters (hits, misses, reused_tokens), if it has one


class Metrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, int], int] = defaultdict(int)  # (api, status) -> count
        self._finished: dict[str, int] = defaultdict(int)  # finish reason -> count
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generation_tokens = 0
        self.reasoning_tokens = 0
        self.disconnects = 0

    def count_request(self, api: str, status: int) -> None:
        with self._lock:
            self._requests[(api, status)] += 1

    def count_generation(self, *, prompt: int, cached: int, generated: int, reasoning: int,
                         finish_reason: str) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.cached_prompt_tokens += cached
            self.generation_tokens += generated
            self.reasoning_tokens += reasoning
            self._finished[finish_reason] += 1

    def count_disconnect(self) -> None:
        with self._lock:
            self.disconnects += 1

    def render(self, load: EngineLoad) -> str:
        model = {"model_name": self.model_name}
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{_labels(labels)} {_number(value)}")

        with self._lock:
            metric("vllm:num_requests_running", "gauge", "Requests currently generating.",
                   [(model, load.running)])
            metric("vllm:num_requests_waiting", "gauge", "Requests queued for the engine.",
                   [(model, load.waiting)])
            metric("vllm:kv_cache_usage_perc", "gauge", "KV cache usage (1 = full).",
                   [(model, round(load.kv_cache_usage, 6))])
            metric("vllm:prompt_tokens_total", "counter", "Prompt tokens processed.",
                   [(model, self.prompt_tokens)])
            metric("vllm:generation_tokens_total", "counter", "Tokens generated.",
                   [(model, self.generation_tokens)])
            metric("vllm:request_success_total", "counter", "Finished generations by finish reason.",
                   [(dict(model, finished_reason=r), n) for r, n in sorted(self._finished.items())])
            metric("q27py_cached_prompt_tokens_total", "counter", "Prompt tokens served from the prefix cache.",
                   [(model, self.cached_prompt_tokens)])
            if load.prefix is not None:
                metric("q27py_prefix_cache_hits_total", "counter", "Requests that restored a cached prefix.",
                       [(model, load.prefix.get("hits", 0))])
                metric("q27py_prefix_cache_misses_total", "counter", "Requests that prefilled from scratch.",
                       [(model, load.prefix.get("misses", 0))])
                metric("q27py_prefix_cache_reused_tokens_total", "counter", "Prompt tokens restored instead of prefilled.",
                       [(model, load.prefix.get("reused_tokens", 0))])
            metric("q27py_reasoning_tokens_total", "counter", "Generated tokens inside think blocks.",
                   [(model, self.reasoning_tokens)])
            metric("q27py_http_requests_total", "counter", "HTTP requests by API and status.",
                   [({"api": api, "status": str(status)}, n) for (api, status), n in sorted(self._requests.items())])
            metric("q27py_client_disconnects_total", "counter", "Generations cancelled by a client disconnect.",
                   [({}, self.disconnects)])
        return "\n".join(lines) + "\n"
