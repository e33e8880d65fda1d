"""The collector in core's own processes (core/entrypoints/heap.py): the start-up heap frozen
out of full collections, and a benchmark's timed block that gives its objects back."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest

from core.entrypoints.heap import frozen_heap


def test_frozen_heap_unfreezes_after_the_block_even_on_error():
    before = gc.get_freeze_count()
    keep = [[i] for i in range(1000)]  # tracked containers alive when the block starts
    with frozen_heap():
        assert gc.get_freeze_count() >= before + len(keep)
    assert gc.get_freeze_count() == before
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == before


def test_startup_freeze_takes_the_heap_out_of_full_collections():
    # In a fresh process: freezing is permanent, never for the test runner's own heap.
    code = textwrap.dedent("""
        import gc, json
        import core.engine  # the engine's imports: torch, transformers
        from core.entrypoints.heap import freeze_startup_heap
        tracked = len(gc.get_objects())
        freeze_startup_heap()
        print(json.dumps([tracked, gc.get_freeze_count(), len(gc.get_objects())]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    tracked, frozen, walked = map(int, out.stdout.split("[")[-1].strip(" ]\n").split(","))
    assert tracked > 50_000 and frozen >= 0.9 * tracked, (tracked, frozen)
    assert walked < 0.05 * tracked, (tracked, walked)  # what a full collection still walks
