"""What every ``core bench`` command can leave behind: ``--output-json FILE`` (the numbers it
printed, plus its settings) and ``--plot FILE.png`` (matplotlib figures of the per-request
distributions behind those numbers).

The figures:

* latency CDF: for each series (TTFT, TPOT, end-to-end), the fraction of requests at or
  below each latency, so every percentile can be read off one curve;
* percentile bars: p50 / p90 / p99 of each series side by side;
* progress over time: output tokens generated since the start (the slope is throughput);
* throughput and latency against request rate, when ``core bench serve`` sweeps rates.

matplotlib comes with the ``bench`` extra; it is imported only when a plot is asked for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

Series = Mapping[str, Sequence[float]]
"""name (e.g. "ttft_ms") -> one value per request."""


def add_report_args(p) -> None:
    p.add_argument("--output-json", default=None, metavar="FILE", help="also write the results as JSON to FILE")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw the latency distributions (and throughput) to a PNG (needs matplotlib: "
                        "pip install 'core[bench]')")


def check_plot_available(path: str | None) -> None:
    """Fail before the benchmark runs, not after, when a plot is asked for and cannot be drawn."""
    if path is None:
        return
    if not path.lower().endswith(".png"):
        raise ValueError(f"--plot {path!r}: give a file name ending in .png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"--plot {path} needs matplotlib, which is not installed; "
                         f"pip install 'core[bench]' (or matplotlib)") from None
    if not Path(path).resolve().parent.is_dir():
        raise ValueError(f"--plot {path}: the directory {Path(path).resolve().parent} does not exist")


def write_json(path: str | None, report: dict) -> None:
    if path is None:
        return
    with open(path, "w") as f:
        # JSON has no Infinity: an unbounded request rate is written as the string "inf"
        json.dump(report, f, indent=2, default=str)
        f.write("\n")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (the smallest value with at least q% of values at or below)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def _figure(panels: int):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed (CI, ssh)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
    return plt, fig, list(axes[0])


def _cdf(ax, series: Series, unit: str) -> None:
    for name, values in series.items():
        if not values:
            continue
        xs = sorted(values)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"{name} (n={len(xs)})")
    values = [v for vs in series.values() for v in vs if v > 0]
    if values and max(values) > 100 * min(values):  # TPOT (ms) beside end-to-end (s)
        ax.set_xscale("log")
    ax.set_xlabel(f"latency ({unit})")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title("latency CDF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _percentile_bars(ax, series: Series, unit: str) -> None:
    qs = (50, 90, 99)
    names = [n for n, v in series.items() if v]
    width = 0.8 / max(1, len(qs))
    for k, q in enumerate(qs):
        xs = [i + (k - 1) * width for i in range(len(names))]
        ax.bar(xs, [percentile(series[n], q) for n in names], width, label=f"p{q}")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(unit)
    ax.set_title("percentiles")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)


def _save(plt, fig, path: str, title: str) -> None:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_latencies(path: str, series: Series, title: str, unit: str = "ms") -> None:
    """A latency CDF and percentile bars of ``series`` (one value per request)."""
    plt, fig, (cdf, bars) = _figure(2)
    _cdf(cdf, series, unit)
    _percentile_bars(bars, series, unit)
    _save(plt, fig, path, title)


def plot_progress(path: str, token_times: Sequence[tuple[float, int]], series: Series, title: str) -> None:
    """Output tokens over time (``(seconds since start, tokens so far)`` samples) beside the
    latency CDF of ``series``."""
    plt, fig, (prog, cdf) = _figure(2)
    prog.plot([t for t, _ in token_times], [n for _, n in token_times])
    prog.set_xlabel("time since start (s)")
    prog.set_ylabel("output tokens generated")
    prog.set_title("progress (slope = output tokens/s)")
    prog.grid(alpha=0.3)
    _cdf(cdf, series, "s")
    _save(plt, fig, path, title)


def plot_rate_sweep(path: str, rows: Sequence[Mapping], title: str) -> None:
    """For a sweep of request rates: achieved throughput, and TTFT / TPOT percentiles,
    against the offered rate. ``rows`` are summaries with ``request_rate`` (a number or
    "inf", drawn at the right edge), ``requests_per_s``, ``ttft_ms`` and ``tpot_ms``."""
    finite = [r["request_rate"] for r in rows if r["request_rate"] != "inf"]
    edge = (max(finite) * 1.25) if finite else 1.0
    xs = [edge if r["request_rate"] == "inf" else r["request_rate"] for r in rows]
    plt, fig, (thr, lat) = _figure(2)
    thr.plot(xs, [r["requests_per_s"] for r in rows], "o-", label="achieved")
    thr.plot(xs, xs, ":", color="grey", label="offered")
    thr.set_xlabel("offered request rate (req/s; inf drawn at the right)")
    thr.set_ylabel("completed requests/s")
    thr.set_title("throughput vs request rate")
    thr.grid(alpha=0.3)
    thr.legend(fontsize=8)
    for name in ("ttft_ms", "tpot_ms"):
        for q in ("p50", "p99"):
            ys = [r.get(name, {}).get(q, float("nan")) for r in rows]
            lat.plot(xs, ys, "o-", label=f"{name} {q}")
    lat.set_xlabel("offered request rate (req/s)")
    lat.set_ylabel("ms")
    lat.set_yscale("log")
    lat.set_title("latency vs request rate")
    lat.grid(alpha=0.3)
    lat.legend(fontsize=8)
    _save(plt, fig, path, title)
