"""Signal handling that must be in place from an entry point's first line.

Python's default SIGTERM action ends the process on the spot: no ``finally`` runs, so work
that holds shared state (the kernel build's lock and its compiler processes, a half-written
cache file) is cut mid-way. :func:`exit_on_sigterm` turns SIGTERM into ``SystemExit(143)``
in the main thread instead, so every ``finally`` and context manager on the way out runs,
and the exit status stays the conventional 128 + 15. Servers replace the handler with their
own graceful shutdown once they start (uvicorn restores this one when it returns).
"""

from __future__ import annotations

import signal


def _exit(signum: int, frame) -> None:
    # A second SIGTERM while the first one unwinds kills at once, as a user expects.
    signal.signal(signum, signal.SIG_DFL)
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Install the SIGTERM -> SystemExit handler (main thread only; elsewhere a no-op)."""
    try:
        signal.signal(signal.SIGTERM, _exit)
    except ValueError:  # not the main thread (an embedding application): leave its handlers
        pass
