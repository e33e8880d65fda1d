"""Prometheus metrics for ``GET /metrics`` (names in the ``core:`` namespace).

Gauges and totals are read at scrape time from the engine's latest
:class:`~core.async_engine.EngineSnapshot` (copied by the front end's output thread from each step's statistics and
command batch), so a scrape never touches the engine. Latency histograms are fed once per
finished request from the front end's output thread. Every metric carries a ``model_name`` label.
docs/serving.md lists them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from core.async_engine import EngineSnapshot
from core.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class _SnapshotCollector(Collector):
    """Engine state gauges and counters, read from the snapshot when scraped."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str):
        self._snapshot = snapshot
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        s = snap.scheduler
        gauges = [
            ("core:num_requests_running", "Sequences in the running batch (holding KV blocks).",
             s.num_running if s else 0),
            ("core:num_requests_waiting", "Sequences waiting to be admitted.", s.num_waiting if s else 0),
            ("core:num_requests_swapped", "Sequences whose KV cache is swapped out to host memory.",
             s.num_swapped if s else 0),
            ("core:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1); cached free blocks count as free.",
             s.kv_cache_usage if s else 0.0),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], value)
            yield g
        counters = [
            ("core:prompt_tokens", "Prompt tokens accepted.", snap.prompt_tokens),
            ("core:generation_tokens", "Tokens generated.", snap.generation_tokens),
            ("core:num_preemptions", "Sequences preempted (recompute or swap).", s.num_preemptions if s else 0),
            ("core:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.prefix_cache_queries if s else 0),
            ("core:prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits if s else 0),
        ]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self._model], value)
            yield c


class Metrics:
    """The server's metric registry (one per app; nothing global)."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot]):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(snapshot, model_name))
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("core:time_to_first_token_seconds", "Arrival to first generated token.",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("core:time_per_output_token_seconds",
                              "Mean time between output tokens of a request, after the first.",
                              labels, buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("core:e2e_request_latency_seconds", "Arrival to finish.",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("core:request_queue_time_seconds", "Arrival to first scheduled.",
                               labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("core:request_success", "Finished requests by finish reason (stop, length, abort).",
                                ["model_name", "finished_reason"], registry=r)
        self.http_errors = Counter("core:http_request_errors", "Requests refused, by HTTP status.",
                                   ["model_name", "status"], registry=r)

    def on_finished(self, out: RequestOutput) -> None:
        """Record a finished request's latencies (called on the front end's output thread)."""
        m = out.metrics
        reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "abort")
        self.finished.labels(self.model_name, reason).inc()
        if m is None:
            return
        if m.first_scheduled_time is not None:
            self.queue.labels(self.model_name).observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.labels(self.model_name).observe(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.labels(self.model_name).observe(m.finished_time - m.arrival_time)
            n_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
            if m.first_token_time is not None and n_tokens > 1:
                self.tpot.labels(self.model_name).observe((m.finished_time - m.first_token_time) / (n_tokens - 1))

    def on_refused(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
