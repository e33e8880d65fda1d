"""The garbage collector in the processes core owns (the engine core, the API server).

CPython's full collection walks every tracked object: after start-up that is the whole of
torch, transformers and the model, ~240k objects, 60-130 ms of one core (a 2-core EPYC here).
Requests keep young objects alive for a second or two, so full collections come round while
serving, and each one freezes the engine loop or every SSE stream for that long: a TTFT and
TPOT outlier. :func:`freeze_startup_heap` moves what start-up built into the permanent
generation, so a collection walks only what serving created since.

Only for a process core owns: frozen objects are never collected, so an application that
embeds the offline ``LLM`` keeps its own collector untouched. A measurement inside someone
else's process (``core bench serve`` called as a function) uses :func:`frozen_heap`, which
gives the objects back to the collector when it ends.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> None:
    """Collect once, then freeze every object alive now (call once start-up is done)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.debug("froze %d start-up objects out of the collector's walks (%.0f ms)",
                 gc.get_freeze_count(), (time.perf_counter() - t0) * 1e3)


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the heap for the block's length (a load generator's run: a 100 ms full
    collection in the client would show up as the server's latency), then unfreeze."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
