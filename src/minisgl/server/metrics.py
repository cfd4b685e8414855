"""Prometheus metrics of the HTTP server (prometheus-client), one registry per app."""

from __future__ import annotations

import time
from typing import Any, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# Daemon stats (AsyncClient.stats()) exported as gauges: name -> (help, value from the stats dict).
_DAEMON_GAUGES = {
    "minisgl_num_requests_waiting": ("Requests queued in the daemon's scheduler", lambda s: s["waiting"]),
    "minisgl_num_requests_running": ("Requests being prefilled or decoded by the daemon", lambda s: s["running"]),
    "minisgl_kv_cache_usage_ratio": (
        "Fraction of KV pages held by running requests",
        lambda s: s["req_pages"] / max(1, s["total_pages"]),
    ),
    "minisgl_kv_cache_total_pages": ("KV pages in the pool", lambda s: s["total_pages"]),
    "minisgl_kv_cache_free_pages": ("Free KV pages", lambda s: s["free_pages"]),
    "minisgl_kv_cache_cached_pages": ("KV pages owned by the prefix cache", lambda s: s["cached_pages"]),
    "minisgl_threads": ("CPU threads of the daemon's computing process", lambda s: s["threads"]),
}
# Daemon totals (speculative decoding's, reported since its start) exported as counters: name -> (help, stats key).
_DAEMON_COUNTERS = {
    "minisgl_spec_decode_num_draft_tokens": ("Draft tokens verified (--speculative)", "spec_drafted_tokens"),
    "minisgl_spec_decode_num_accepted_tokens": ("Draft tokens accepted (--speculative)", "spec_accepted_tokens"),
}


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.requests = Counter("minisgl_requests", "Finished HTTP requests", m + ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("minisgl_requests_in_flight", "HTTP requests being served", m, registry=r)
        self.prompt_tokens = Counter("minisgl_prompt_tokens", "Prompt tokens processed", m, registry=r)
        self.generation_tokens = Counter("minisgl_generation_tokens", "Tokens generated", m, registry=r)
        self.cached_tokens = Counter(
            "minisgl_cached_prompt_tokens", "Prompt tokens served from the prefix cache", m, registry=r
        )
        self.ttft = Histogram(
            "minisgl_time_to_first_token_seconds", "Time to first token", m, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "minisgl_time_per_output_token_seconds",
            "Time per output token after the first",
            m,
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "minisgl_e2e_request_latency_seconds", "Request latency", m, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.daemon = {name: Gauge(name, help_text, m, registry=r) for name, (help_text, _) in _DAEMON_GAUGES.items()}
        self.quantization = Gauge(
            "minisgl_quantization_info",
            "1 for the daemon's weight quantization (none, fp16, int8, fp8)",
            m + ["quantization"],
            registry=r,
        )
        self.cache_hit_rate = Gauge(
            "minisgl_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens (since start)",
            m,
            registry=r,
        )
        self.daemon_totals = {name: Counter(name, text, m, registry=r) for name, (text, _) in _DAEMON_COUNTERS.items()}
        self._seen_totals: dict[str, int] = {}
        self.model_name = model_name
        self._prompt_total = self._cached_total = 0

    def request(self, endpoint: str) -> "RequestTimer":
        return RequestTimer(self, endpoint)

    def set_daemon_stats(self, stats: Mapping[str, Any]) -> None:
        for name, (_, value) in _DAEMON_GAUGES.items():
            try:
                self.daemon[name].labels(self.model_name).set(value(stats))
            except (KeyError, TypeError):
                pass  # a daemon of another version: export what it reports
        if isinstance(stats.get("quantization"), str):
            self.quantization.labels(self.model_name, stats["quantization"]).set(1)
        for name, (_, key) in _DAEMON_COUNTERS.items():
            total = stats.get(key)
            if isinstance(total, int):
                seen = self._seen_totals.get(key, 0)
                # A smaller total is a restarted daemon counting from zero again.
                self.daemon_totals[name].labels(self.model_name).inc(total - seen if total >= seen else total)
                self._seen_totals[key] = total

    def count_tokens(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        name = self.model_name
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(completion_tokens)
        self.cached_tokens.labels(name).inc(cached_tokens)
        self._prompt_total += prompt_tokens
        self._cached_total += cached_tokens
        if self._prompt_total:
            self.cache_hit_rate.labels(name).set(self._cached_total / self._prompt_total)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Times one request: call first_token() when its first token arrives, done() at the end."""

    def __init__(self, metrics: ServerMetrics, endpoint: str) -> None:
        self.metrics, self.endpoint = metrics, endpoint
        self.start = time.perf_counter()
        self.first: float | None = None
        self.finished = False
        metrics.in_flight.labels(metrics.model_name).inc()

    def first_token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()
            self.metrics.ttft.labels(self.metrics.model_name).observe(self.first - self.start)

    def done(self, status: int, prompt_tokens: int = 0, completion_tokens: int = 0, cached_tokens: int = 0) -> None:
        if self.finished:
            return
        self.finished = True
        m, name, end = self.metrics, self.metrics.model_name, time.perf_counter()
        m.in_flight.labels(name).dec()
        m.requests.labels(name, self.endpoint, str(status)).inc()
        if status != 200:
            return
        m.count_tokens(prompt_tokens, completion_tokens, cached_tokens)
        m.e2e.labels(name).observe(end - self.start)
        if self.first is not None and completion_tokens > 1:
            m.tpot.labels(name).observe((end - self.first) / (completion_tokens - 1))
