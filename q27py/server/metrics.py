"""Counters, gauges and histograms, rendered by hand in the Prometheus text format (version 0.0.4).

The `vllm:` names are the ones existing routers, autoscalers and the Kubernetes
inference gateway already read (num_requests_running / waiting,
kv_cache_usage_perc, the latency histograms, token counters), so a q27py
server can sit behind them unchanged. `q27py_` names add what is ours
(speculation per drafter, prefix-cache slots and snapshots).

Timing comes from the engine thread: the bridge opens a `GenerationTap` per
engine request and feeds it every chunk as it leaves the engine, so the
latencies do not include the event loop's scheduling. One tap is one engine
generation; a turn whose reasoning budget forced a continuation counts as two.

The same observations feed a `Timeline` of short buckets over the last
minutes, which the dashboard (server/dashboard.py) draws.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket bounds (upper, inclusive). The latency ones are vLLM's, so dashboards built for vLLM
# read ours unchanged; the token-count ones are 1-2-5 steps up to the largest context.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))  # 1 .. 5e6
DRAFTERS = ("mtp", "suffix")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: dict[str, str]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in pairs.items()) + "}"


def _number(value: float) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class Histogram:
    """Cumulative buckets + sum + count, as Prometheus expects. Not locked: Metrics holds the lock."""

    def __init__(self, bounds):
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        index = len(self.bounds)
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                index = i
                break
        self.counts[index] += n
        self.sum += value * n
        self.count += n

    def samples(self, name: str, labels: dict) -> list[str]:
        out = []
        running = 0
        for bound, n in zip(self.bounds + (math.inf,), self.counts):
            running += n
            out.append(f"{name}_bucket{_labels(dict(labels, le=_number(bound)))} {running}")
        out.append(f"{name}_sum{_labels(labels)} {_number(round(self.sum, 9))}")
        out.append(f"{name}_count{_labels(labels)} {self.count}")
        return out


@dataclass
class EngineLoad:
    """A snapshot of the engine side, supplied by the bridge when metrics are scraped."""

    running: int
    waiting: int
    kv_cache_usage: float  # 0..1
    prefix: dict | None = None  # the engine's prefix-cache counters (hits, misses, reused_tokens, live_sequences..)
    slots_total: int | None = None  # live sequences the engine can keep (EngineConfig.live_sequences())
    max_running: int | None = None  # requests the engine generates at once (the scheduler's slots, --max-slots)


@dataclass
class GenerationRecord:
    """One engine generation as the engine thread saw it (monotonic seconds)."""

    submitted: float
    started: float
    finished: float
    first_token: float | None
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int
    finish_reason: str
    token_gaps: list[tuple[float, int]] = field(default_factory=list)  # (seconds since previous chunk, tokens)
    stats: dict = field(default_factory=dict)  # the engine's final statistics (speculation counters)


class GenerationTap:
    """Opened by the bridge when the engine starts a request; fed each chunk; closed once."""

    def __init__(self, sink: "Metrics", submitted: float, prompt_tokens: int):
        self._sink = sink
        self._submitted = submitted
        self._started = time.monotonic()
        self._last = self._started
        self._first: float | None = None
        self._prompt = prompt_tokens
        self._generated = 0
        self._gaps: list[tuple[float, int]] = []
        self._stats: dict = {}
        self._reason = "error"
        self._closed = False

    def chunk(self, chunk) -> None:
        now = time.monotonic()
        n = len(chunk.token_ids)
        if n:
            if self._first is None:
                self._first = now
            else:
                self._gaps.append((now - self._last, n))
            self._last = now
            self._generated += n
        if chunk.stats:
            self._stats = dict(chunk.stats)
        if chunk.finish_reason is not None:
            self._reason = chunk.finish_reason

    def close(self, reason: str | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        stats = self._stats
        self._sink.observe_generation(GenerationRecord(
            submitted=self._submitted, started=self._started, finished=time.monotonic(),
            first_token=self._first, prompt_tokens=int(stats.get("prompt_tokens", self._prompt)),
            generated_tokens=int(stats.get("generated_tokens", self._generated)),
            cached_tokens=int(stats.get("cached_tokens") or 0),
            finish_reason=reason or self._reason, token_gaps=self._gaps, stats=stats))


class Timeline:
    """Sums (and maxima, for gauges) per `bucket_s` slice of wall time, for the last `span_s`.

    Buckets are keyed by wall-clock slice so the dashboard's x axis is real time; a bucket no event
    touched reads as zeros, and gauges carry their last value forward.
    """

    def __init__(self, bucket_s: float = 2.0, span_s: float = 300.0):
        self.bucket_s = bucket_s
        self.span_s = span_s
        self._buckets: dict[int, dict[str, float]] = {}
        self._gauges: dict[int, dict[str, float]] = {}

    def _key(self, now: float) -> int:
        return int(now // self.bucket_s)

    def _trim(self, now: float) -> None:
        oldest = self._key(now - self.span_s)
        for store in (self._buckets, self._gauges):
            for k in [k for k in store if k < oldest]:
                del store[k]

    def add(self, now: float, **values: float) -> None:
        bucket = self._buckets.setdefault(self._key(now), defaultdict(float))
        for name, v in values.items():
            bucket[name] += v
        self._trim(now)

    def gauge(self, now: float, **values: float) -> None:
        bucket = self._gauges.setdefault(self._key(now), {})
        for name, v in values.items():
            bucket[name] = max(bucket.get(name, v), v)
        self._trim(now)

    def series(self, now: float, sums: tuple[str, ...], gauges: tuple[str, ...]) -> dict:
        last = self._key(now)
        first = self._key(now - self.span_s) + 1
        keys = range(first, last + 1)
        out: dict[str, list] = {"t": [k * self.bucket_s for k in keys]}
        for name in sums:
            out[name] = [self._buckets.get(k, {}).get(name, 0.0) for k in keys]
        carried: dict[str, float] = {}
        for k in sorted(self._gauges):  # the value in force before the window opens
            if k < first:
                carried.update(self._gauges[k])
        for name in gauges:
            values = []
            current = carried.get(name, 0.0)
            for k in keys:
                if name in self._gauges.get(k, {}):
                    current = self._gauges[k][name]
                values.append(current)
            out[name] = values
        return out


TIMELINE_SUMS = ("requests", "generated_tokens", "prompt_tokens", "cached_tokens", "ttft_sum", "ttft_count",
                 "mtp_drafted", "mtp_accepted", "suffix_drafted", "suffix_accepted", "prefix_hits",
                 "prefix_misses")
TIMELINE_GAUGES = ("running", "waiting", "slots")


class Metrics:
    def __init__(self, model_name: str, *, clock=time.time):
        self.model_name = model_name
        self._clock = clock  # wall clock for the timeline (tests pass a fake one)
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, int], int] = defaultdict(int)  # (api, status) -> count
        self._finished: dict[str, int] = defaultdict(int)  # finish reason -> count
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generation_tokens = 0
        self.reasoning_tokens = 0
        self.disconnects = 0
        # engine-thread observations (GenerationTap)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prompt_len = Histogram(TOKEN_BUCKETS)
        self.generation_len = Histogram(TOKEN_BUCKETS)
        self.generations = 0
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of those, restored
        self.spec_rounds: dict[str, int] = defaultdict(int)  # source (none | mtp | suffix) -> rounds
        self.spec_drafted: dict[str, int] = defaultdict(int)  # drafter -> draft tokens proposed
        self.spec_accepted: dict[str, int] = defaultdict(int)  # drafter -> draft tokens accepted
        self.spec_accepted_by_pos: list[int] = []  # position k (0-based) -> accepted drafts
        self.timeline = Timeline()

    # ---- HTTP side ---------------------------------------------------------

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

    # ---- engine side -------------------------------------------------------

    def tap(self, submitted: float, prompt_tokens: int) -> GenerationTap:
        return GenerationTap(self, submitted, prompt_tokens)

    def observe_generation(self, r: GenerationRecord) -> None:
        stats = r.stats or {}
        drafted = stats.get("drafted_by_source") or {}
        accepted = stats.get("accepted_by_source") or {}
        with self._lock:
            self.generations += 1
            self.queue_time.observe(max(0.0, r.started - r.submitted))
            self.e2e.observe(max(0.0, r.finished - r.submitted))
            self.prompt_len.observe(r.prompt_tokens)
            self.generation_len.observe(r.generated_tokens)
            ttft = None
            if r.first_token is not None:
                ttft = max(0.0, r.first_token - r.submitted)
                self.ttft.observe(ttft)
                self.prefill_time.observe(max(0.0, r.first_token - r.started))
                self.decode_time.observe(max(0.0, r.finished - r.first_token))
            for gap, n in r.token_gaps:
                # A speculative round commits several tokens at once: each gets an equal share of
                # the gap, so the mean is decode time per token, as a client experiences it.
                self.itl.observe(gap / n, n)
            self.prefix_query_tokens += r.prompt_tokens
            self.prefix_hit_tokens += r.cached_tokens
            for source, n in (stats.get("rounds_by_source") or {}).items():
                self.spec_rounds[source] += int(n)
            for d in DRAFTERS:
                self.spec_drafted[d] += int(drafted.get(d, 0))
                self.spec_accepted[d] += int(accepted.get(d, 0))
            for k, n in enumerate(stats.get("accepted_by_depth") or []):
                while len(self.spec_accepted_by_pos) <= k:
                    self.spec_accepted_by_pos.append(0)
                self.spec_accepted_by_pos[k] += int(n)
            self.timeline.add(
                self._clock(), requests=1, generated_tokens=r.generated_tokens, prompt_tokens=r.prompt_tokens,
                cached_tokens=r.cached_tokens, ttft_sum=ttft or 0.0, ttft_count=1 if ttft is not None else 0,
                mtp_drafted=drafted.get("mtp", 0), mtp_accepted=accepted.get("mtp", 0),
                suffix_drafted=drafted.get("suffix", 0), suffix_accepted=accepted.get("suffix", 0),
                prefix_hits=1 if r.cached_tokens else 0, prefix_misses=0 if r.cached_tokens else 1)

    def sample_load(self, load: EngineLoad) -> None:
        """Record the gauges into the timeline (the bridge calls this as requests come and go)."""
        slots = (load.prefix or {}).get("live_sequences", 0)
        with self._lock:
            self.timeline.gauge(self._clock(), running=load.running, waiting=load.waiting, slots=slots)

    # ---- reading -----------------------------------------------------------

    def snapshot(self, load: EngineLoad) -> dict:
        """Totals and the timeline as plain data (the dashboard's JSON)."""
        self.sample_load(load)
        with self._lock:
            prefix = dict(load.prefix or {})
            return {
                "model": self.model_name,
                "time": self._clock(),
                "bucket_s": self.timeline.bucket_s,
                "totals": {
                    "generations": self.generations,
                    "prompt_tokens": self.prompt_tokens,
                    "generation_tokens": self.generation_tokens,
                    "cached_prompt_tokens": self.cached_prompt_tokens,
                    "ttft_sum": self.ttft.sum, "ttft_count": self.ttft.count,
                    "itl_sum": self.itl.sum, "itl_count": self.itl.count,
                    "e2e_sum": self.e2e.sum, "e2e_count": self.e2e.count,
                    "prefix_query_tokens": self.prefix_query_tokens,
                    "prefix_hit_tokens": self.prefix_hit_tokens,
                    "prefix_hits": prefix.get("hits", 0), "prefix_misses": prefix.get("misses", 0),
                    "spec_drafted": {d: self.spec_drafted[d] for d in DRAFTERS},
                    "spec_accepted": {d: self.spec_accepted[d] for d in DRAFTERS},
                },
                "gauges": {"running": load.running, "waiting": load.waiting,
                           "slots_in_use": prefix.get("live_sequences", 0), "slots_total": load.slots_total,
                           "kv_cache_usage": round(load.kv_cache_usage, 6), "max_running": load.max_running},
                "series": self.timeline.series(self._clock(), TIMELINE_SUMS, TIMELINE_GAUGES),
            }

    def render(self, load: EngineLoad) -> str:
        model = {"model_name": self.model_name}
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{_labels(labels)} {_number(value)}")

        def histogram(name: str, help_text: str, h: Histogram) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} histogram")
            lines.extend(h.samples(name, model))

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
            histogram("vllm:time_to_first_token_seconds",
                      "Seconds from submission to the engine until its first token.", self.ttft)
            histogram("vllm:inter_token_latency_seconds",
                      "Seconds between output tokens (a multi-token round's gap shared by its tokens).", self.itl)
            histogram("vllm:e2e_request_latency_seconds",
                      "Seconds from submission to the engine until the generation finished.", self.e2e)
            histogram("vllm:request_queue_time_seconds", "Seconds a generation waited for the engine.",
                      self.queue_time)
            histogram("vllm:request_prefill_time_seconds", "Seconds from engine start to the first token.",
                      self.prefill_time)
            histogram("vllm:request_decode_time_seconds", "Seconds from the first token to the end.",
                      self.decode_time)
            histogram("vllm:request_prompt_tokens", "Prompt length of each generation in tokens.", self.prompt_len)
            histogram("vllm:request_generation_tokens", "Tokens generated by each generation.",
                      self.generation_len)
            metric("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
                   [(model, self.prefix_query_tokens)])
            metric("vllm:prefix_cache_hits_total", "counter", "Prompt tokens restored from the prefix cache.",
                   [(model, self.prefix_hit_tokens)])
            drafted = sum(self.spec_drafted.values())
            metric("vllm:spec_decode_num_drafts_total", "counter", "Speculative rounds that verified drafts.",
                   [(model, sum(n for s, n in self.spec_rounds.items() if s != "none"))])
            metric("vllm:spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.",
                   [(model, drafted)])
            metric("vllm:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
                   [(model, sum(self.spec_accepted.values()))])
            metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
                   "Draft tokens accepted, by position in the draft (0 = first).",
                   [(dict(model, position=str(k)), n) for k, n in enumerate(self.spec_accepted_by_pos)])
            metric("q27py_spec_rounds_total", "counter", "Decode rounds by draft source (none = plain step).",
                   [(dict(model, source=s), n) for s, n in sorted(self.spec_rounds.items())])
            metric("q27py_spec_draft_tokens_total", "counter", "Draft tokens proposed, per drafter.",
                   [(dict(model, drafter=d), self.spec_drafted[d]) for d in DRAFTERS])
            metric("q27py_spec_accepted_tokens_total", "counter", "Draft tokens accepted, per drafter.",
                   [(dict(model, drafter=d), self.spec_accepted[d]) for d in DRAFTERS])
            metric("q27py_cached_prompt_tokens_total", "counter", "Prompt tokens served from the prefix cache.",
                   [(model, self.cached_prompt_tokens)])
            if load.prefix is not None:
                hits, misses = load.prefix.get("hits", 0), load.prefix.get("misses", 0)
                metric("q27py_prefix_cache_hits_total", "counter", "Requests that restored a cached prefix.",
                       [(model, hits)])
                metric("q27py_prefix_cache_misses_total", "counter", "Requests that prefilled from scratch.",
                       [(model, misses)])
                metric("q27py_prefix_cache_reused_tokens_total", "counter", "Prompt tokens restored instead of prefilled.",
                       [(model, load.prefix.get("reused_tokens", 0))])
                metric("q27py_prefix_cache_hit_ratio", "gauge", "Share of requests that restored a prefix, since start.",
                       [(model, round(hits / (hits + misses), 6) if hits + misses else 0)])
                metric("q27py_slots_in_use", "gauge", "Live sequences (slots) held for prefix reuse.",
                       [(model, load.prefix.get("live_sequences", 0))])
                metric("q27py_prefix_cache_snapshots", "gauge", "GDN state snapshots held in the live slots.",
                       [(model, load.prefix.get("snapshots", 0))])
            if load.slots_total is not None:
                metric("q27py_slots_total", "gauge", "Live sequences (slots) the engine can hold.",
                       [(model, load.slots_total)])
            if load.max_running is not None:
                metric("q27py_max_running_requests", "gauge",
                       "Requests the engine generates at once (--max-slots); more wait in the queue.",
                       [(model, load.max_running)])
            metric("q27py_reasoning_tokens_total", "counter", "Generated tokens inside think blocks.",
                   [(model, self.reasoning_tokens)])
            metric("q27py_http_requests_total", "counter", "HTTP requests by API and status.",
                   [({"api": api, "status": str(status)}, n) for (api, status), n in sorted(self._requests.items())])
            metric("q27py_client_disconnects_total", "counter", "Generations cancelled by a client disconnect.",
                   [({}, self.disconnects)])
        return "\n".join(lines) + "\n"
