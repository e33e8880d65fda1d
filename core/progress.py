"""Progress display for long steps (model load, kernel build, benchmarks), one style for all.

Bars go to stderr, so piped stdout (a reply, a JSON report) stays clean, and tqdm turns
them off when stderr is not a terminal (CI logs get no carriage-return noise). A bar
appears only once its step has taken ``delay`` seconds: a tiny model loading in 50 ms
shows nothing.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

T = TypeVar("T")

DELAY_S = 0.5
"""Seconds a step runs before its bar is drawn."""


def bar(total: int | None, desc: str, unit: str = "it", enabled: bool = True, **kw) -> tqdm:
    """A tqdm bar in the product's style; ``enabled=False`` (e.g. on a non-zero rank) draws
    nothing but still accepts ``update``."""
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        delay=DELAY_S,
        dynamic_ncols=True,
        leave=False,
        # None: tqdm decides by whether stderr is a terminal
        disable=None if enabled else True,
        **kw,
    )


def track(items: Iterable[T], total: int | None, desc: str, unit: str = "it", enabled: bool = True) -> Iterator[T]:
    """Iterate ``items`` with a bar of ``total`` steps."""
    with bar(total, desc, unit, enabled) as b:
        for item in items:
            yield item
            b.update(1)


@contextmanager
def spinner(desc: str, enabled: bool = True) -> Iterator[None]:
    """Show ``desc`` with the elapsed time while the block runs, for a step that reports no
    progress of its own (a compiler run, a graph capture). The clock is redrawn by a
    daemon thread, so a block that never yields to Python still shows it is alive."""
    with bar(None, desc, unit="s", enabled=enabled, bar_format="{desc}: {elapsed}") as b:
        done = threading.Event()

        def tick() -> None:
            while not done.wait(0.5):
                # update(0), not refresh(): it honours `delay` and records the draw, so
                # close() knows there is a line to clear
                b.update(0)

        thread = threading.Thread(target=tick, name="core-spinner", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()


@contextmanager
def starting(desc: str = "starting the engine") -> Iterator[None]:
    """A spinner over a long start-up (model load, kernel build, KV allocation, warm-up)
    whose inner steps may draw bars of their own; log lines printed meanwhile go above the
    bars instead of through them."""
    with logging_redirect_tqdm(), spinner(desc):
        yield
