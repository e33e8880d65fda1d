"""Prometheus metrics for ``GET /metrics`` (names in the ``core:`` namespace).

Gauges and totals are read at scrape time from the engine's latest
:class:`~core.async_engine.EngineSnapshot` (copied by the front end's output thread from each step's statistics and
command batch), so a scrape never touches the engine. Request histograms are fed once per
finished request, the inter-token latency once per new token as each step's outputs arrive,
both on the front end's output thread. Every metric carries a ``model_name`` label.
docs/metrics.md lists them all with their vLLM names; docs/grafana/core.json charts them.
"""

from __future__ import annotations

import threading
import time
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
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000,
                  200000, 500000, 1000000)
_N_BUCKETS = (1, 2, 5, 10, 20, 50, 100)


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
            ("core:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / tokens looked up, since "
             "start (0-1); rate(prefix_cache_hits) / rate(prefix_cache_queries) gives it over a window.",
             s.prefix_cache_hit_rate if s else 0.0),
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
    """The server's metric registry (one per app; nothing global).

    ``on_outputs`` and ``on_finished`` run on the front end's output thread; ``on_refused``
    on the event loop; prometheus_client's metrics are thread-safe, ``_last`` has its lock.
    """

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot]):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(snapshot, model_name))
        labels = ["model_name"]
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.ttft = hist("core:time_to_first_token_seconds", "Arrival to first generated token.", _LATENCY_BUCKETS)
        self.itl = hist("core:inter_token_latency_seconds",
                        "Time between consecutive output tokens of a sample (one observation per token).",
                        _TPOT_BUCKETS)
        self.tpot = hist("core:time_per_output_token_seconds",
                         "Mean time between output tokens of a request, after the first.", _TPOT_BUCKETS)
        self.e2e = hist("core:e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = hist("core:request_queue_time_seconds",
                          "Arrival to the engine core's scheduling of the step that first ran the request.",
                          _LATENCY_BUCKETS)
        self.front_end = hist("core:request_front_end_time_seconds",
                              "Arrival to the engine core's receipt: tokenization, validation and the IPC.",
                              _LATENCY_BUCKETS)
        self.prefill = hist("core:request_prefill_time_seconds",
                            "First scheduled to first token: computing the prompt.", _LATENCY_BUCKETS)
        self.decode = hist("core:request_decode_time_seconds", "First token to finish: generating the rest.",
                           _LATENCY_BUCKETS)
        self.inference = hist("core:request_inference_time_seconds", "First scheduled to finish (prefill + decode).",
                              _LATENCY_BUCKETS)
        self.prompt_len = hist("core:request_prompt_tokens", "Prompt length of each finished request, in tokens.",
                               _TOKEN_BUCKETS)
        self.gen_len = hist("core:request_generation_tokens",
                            "Tokens generated by each finished request (all n samples together).", _TOKEN_BUCKETS)
        self.n = hist("core:request_params_n", "The n (samples) of each finished request.", _N_BUCKETS)
        self.finished = Counter("core:request_success", "Finished requests by finish reason (stop, length, abort).",
                                ["model_name", "finished_reason"], registry=r)
        self.http_errors = Counter("core:http_request_errors", "Requests refused, by HTTP status.",
                                   ["model_name", "status"], registry=r)
        # Series exist from the first scrape (zeros), not from the first request: dashboards
        # and alerts see "no traffic yet" rather than "no such metric".
        for metric in (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.front_end, self.prefill, self.decode,
                       self.inference, self.prompt_len, self.gen_len, self.n):
            metric.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(model_name, reason)
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, list[int]]] = {}
        """request id -> (when its last token arrived, tokens seen per sample): for the ITL."""

    def on_outputs(self, outputs: list[RequestOutput], now: float | None = None) -> None:
        """One step's outputs: observe the inter-token latency of every new token (when
        several arrive at once, e.g. after a coalesced step, each gets an equal share)."""
        now = time.monotonic() if now is None else now
        itl = self.itl.labels(self.model_name)
        with self._lock:
            for out in outputs:
                counts = [len(c.token_ids) for c in out.outputs]
                last = self._last.get(out.request_id)
                if last is not None:
                    for seen, count in zip(last[1], counts):
                        for _ in range(count - seen):
                            itl.observe((now - last[0]) / (count - seen))
                if out.finished:
                    self._last.pop(out.request_id, None)
                elif any(counts):
                    self._last[out.request_id] = (now, counts)

    def on_finished(self, out: RequestOutput) -> None:
        """Record a finished request's latencies and lengths (called on the front end's output thread)."""
        m = out.metrics
        reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "abort")
        name = self.model_name
        self.finished.labels(name, reason).inc()
        with self._lock:
            self._last.pop(out.request_id, None)  # an abort ends a request without a last output
        n_tokens = [len(c.token_ids) for c in out.outputs]
        self.prompt_len.labels(name).observe(len(out.prompt_token_ids))
        self.gen_len.labels(name).observe(sum(n_tokens))
        self.n.labels(name).observe(len(out.outputs))
        if m is None:
            return
        scheduled, first, done = m.first_scheduled_time, m.first_token_time, m.finished_time
        for hist, start, end in ((self.queue, m.arrival_time, scheduled),
                                 (self.front_end, m.arrival_time, m.engine_received_time),
                                 (self.ttft, m.arrival_time, first),
                                 (self.e2e, m.arrival_time, done), (self.prefill, scheduled, first),
                                 (self.decode, first, done), (self.inference, scheduled, done)):
            if start is not None and end is not None:
                hist.labels(name).observe(max(0.0, end - start))
        longest = max(n_tokens, default=0)
        if first is not None and done is not None and longest > 1:
            self.tpot.labels(name).observe((done - first) / (longest - 1))

    def on_refused(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
