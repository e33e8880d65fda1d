"""``core bench serve``'s server-side split: the mean of each core histogram between two
/metrics scrapes, read from the Prometheus text the server's own Metrics renders."""

from __future__ import annotations

import pytest

from core.async_engine import EngineSnapshot
from core.benchmarks.serve import SERVER_SPLIT, histogram_totals, server_split
from core.entrypoints.openai.metrics import Metrics
from core.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _finished(rid: str, arrival: float) -> RequestOutput:
    times = RequestMetrics(arrival_time=arrival, engine_received_time=arrival + 0.001,
                           first_scheduled_time=arrival + 0.004, first_token_time=arrival + 0.010,
                           finished_time=arrival + 0.110)
    comp = CompletionOutput(0, "x", (1, 2, 3), 0.0, None, "length")
    return RequestOutput(rid, None, (5, 6), (comp,), True, None, times)


def _metrics() -> Metrics:
    return Metrics("m", lambda: EngineSnapshot(scheduler=None))


def test_the_split_is_the_mean_of_the_requests_between_the_scrapes():
    metrics = _metrics()
    metrics.on_finished(_finished("before", 0.0))  # finished before the run: not counted
    before = metrics.render().decode()
    for i in range(4):
        metrics.on_finished(_finished(f"r{i}", 10.0 * i))
    after = metrics.render().decode()
    split = server_split(before, after)
    assert split == {"requests": 4, "front_end": pytest.approx(1.0), "queue": pytest.approx(4.0),
                     "prefill": pytest.approx(6.0), "ttft": pytest.approx(10.0),
                     "decode": pytest.approx(100.0), "e2e": pytest.approx(110.0)}
    assert set(split) == {"requests", *SERVER_SPLIT}


def test_no_split_without_core_histograms_or_without_finished_requests():
    metrics = _metrics()
    text = metrics.render().decode()
    assert server_split(text, text) is None  # nothing finished in between
    other = "# a server that is not core serve\nvllm:time_to_first_token_seconds_sum 3.0\n"
    assert server_split(other, other) is None
    assert histogram_totals(other) == {}


def test_totals_add_over_label_sets():
    text = ('core:time_to_first_token_seconds_sum{model_name="a"} 1.5\n'
            'core:time_to_first_token_seconds_sum{model_name="b"} 0.5\n'
            'core:time_to_first_token_seconds_count{model_name="a"} 3.0\n'
            'core:time_to_first_token_seconds_count{model_name="b"} 1.0\n'
            'core:time_to_first_token_seconds_bucket{le="0.1",model_name="a"} 2.0\n')
    assert histogram_totals(text) == {"core:time_to_first_token_seconds": [2.0, 4.0]}
