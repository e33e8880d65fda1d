"""docs/grafana/core.json: every query is valid PromQL (parsed with promql-parser, Grafana's
variables substituted) and names only metrics that core's registry exports. The live check
against a running ``core serve`` is tests/integration/test_endpoints_api.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from core.async_engine import EngineSnapshot
from core.entrypoints.openai.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "core.json"
_GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*[A-Za-z_][A-Za-z0-9_]*\)$")


def _queries(dashboard: dict) -> list[str]:
    """Every PromQL expression: panel targets and query variables (label_values' selector)."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = _LABEL_VALUES.match(q)
            assert m, f"template variable {var['name']}: unsupported query {q!r}"
            exprs.append(m.group("selector"))
    return exprs


def _names(node) -> set[str]:
    """Metric names of every selector under a parsed PromQL node."""
    if isinstance(node, promql_parser.VectorSelector):
        assert node.name, f"selector without a metric name: {node}"
        return {node.name}
    if isinstance(node, promql_parser.MatrixSelector):
        return _names(node.vector_selector)
    found: set[str] = set()
    for attr in ("lhs", "rhs", "expr", "param"):
        child = getattr(node, attr, None)
        if isinstance(child, promql_parser.Expr):
            found |= _names(child)
    for arg in getattr(node, "args", None) or ():
        found |= _names(arg)
    return found


def dashboard_metric_names(dashboard: dict) -> set[str]:
    """The metric (sample) names the dashboard's queries read."""
    names: set[str] = set()
    for expr in _queries(dashboard):
        for var, value in _GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        names |= _names(promql_parser.parse(expr))
    return names


def _exported_sample_names() -> set[str]:
    metrics = Metrics("m", lambda: EngineSnapshot(scheduler=None))
    metrics.on_refused(400)  # a labelled counter has series only once used
    text = metrics.render().decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_names_are_found_inside_nested_expressions():
    q = 'sum(rate(a:x_total{j="$job"}[1m])) / histogram_quantile(0.9, sum by (le) (rate(b_bucket[5m]))) + -c'
    assert _names(promql_parser.parse(q)) == {"a:x_total", "b_bucket", "c"}


def test_every_query_parses_and_reads_an_exported_metric():
    dashboard = json.loads(DASHBOARD.read_text())
    names = dashboard_metric_names(dashboard)
    missing = sorted(names - _exported_sample_names())
    assert not missing, f"the dashboard reads metrics core does not export: {missing}"
    # every histogram and gauge the issue names is charted
    for wanted in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                   "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                   "request_prompt_tokens", "request_generation_tokens", "kv_cache_usage_perc",
                   "prefix_cache_hits_total", "num_requests_running", "num_requests_waiting"):
        assert any(n.startswith(f"core:{wanted}") for n in names), wanted


def test_a_typo_in_a_query_is_caught():
    bad = {"panels": [{"targets": [{"expr": "rate(core:generation_token_total[1m])"}]}]}
    assert dashboard_metric_names(bad) - _exported_sample_names() == {"core:generation_token_total"}
    with pytest.raises(Exception):  # noqa: B017 - the parser's own error type
        dashboard_metric_names({"panels": [{"targets": [{"expr": "sum(rate(x[1m])"}]}]})
