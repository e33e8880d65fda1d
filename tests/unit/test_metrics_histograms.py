"""Metrics: each histogram is fed from the timestamps and counts of the outputs it sees
(hand-made RequestOutputs with known times; expected values computed here by hand)."""

from __future__ import annotations

import pytest

from core.async_engine import EngineSnapshot
from core.entrypoints.openai.metrics import Metrics
from core.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _out(rid: str, tokens: list[int], finished: bool, metrics: RequestMetrics | None = None, prompt=(1, 2, 3)):
    comp = CompletionOutput(0, "", tuple(tokens), 0.0, None, "length" if finished else None)
    return RequestOutput(rid, None, tuple(prompt), (comp,), finished, metrics=metrics)


def _get(m: Metrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


@pytest.fixture
def metrics():
    return Metrics("m", lambda: EngineSnapshot(scheduler=None))


def test_inter_token_latency_one_observation_per_token_after_the_first(metrics):
    metrics.on_outputs([_out("a", [5], False)], now=10.0)          # first token: no gap yet
    metrics.on_outputs([_out("a", [5, 6], False)], now=10.5)       # gap 0.5
    metrics.on_outputs([_out("a", [5, 6, 7, 8], False)], now=11.5)  # two tokens in 1.0: 0.5 each
    metrics.on_outputs([_out("a", [5, 6, 7, 8, 9], True)], now=11.75)
    assert _get(metrics, "core:inter_token_latency_seconds_count") == 4
    assert _get(metrics, "core:inter_token_latency_seconds_sum") == pytest.approx(0.5 + 1.0 + 0.25)
    assert not metrics._last  # the finished request is forgotten


def test_an_aborted_request_is_forgotten(metrics):
    metrics.on_outputs([_out("b", [5], False)], now=1.0)
    metrics.on_finished(_out("b", [5], True))
    assert not metrics._last


def test_finished_request_latencies_split_end_to_end(metrics):
    times = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.25, first_token_time=101.0,
                           finished_time=103.0, engine_received_time=100.125)
    metrics.on_finished(_out("c", [1, 2, 3, 4, 5], True, times, prompt=tuple(range(7))))
    expected = {"request_queue_time_seconds": 0.25, "request_front_end_time_seconds": 0.125,
                "request_prefill_time_seconds": 0.75,
                "request_decode_time_seconds": 2.0, "request_inference_time_seconds": 2.75,
                "time_to_first_token_seconds": 1.0, "e2e_request_latency_seconds": 3.0,
                "time_per_output_token_seconds": 0.5}
    for name, value in expected.items():
        assert _get(metrics, f"core:{name}_sum") == pytest.approx(value), name
        assert _get(metrics, f"core:{name}_count") == 1, name
    assert _get(metrics, "core:request_prompt_tokens_sum") == 7
    assert _get(metrics, "core:request_generation_tokens_sum") == 5
    assert _get(metrics, "core:request_params_n_sum") == 1
    assert _get(metrics, "core:request_success_total", finished_reason="length") == 1


def test_series_exist_before_the_first_request(metrics):
    assert metrics.registry.get_sample_value("core:request_prefill_time_seconds_count", {"model_name": "m"}) == 0
    assert metrics.registry.get_sample_value("core:request_success_total",
                                             {"model_name": "m", "finished_reason": "abort"}) == 0
