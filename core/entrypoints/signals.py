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


_ctrl_c_seen = False


def _interrupt(signum: int, frame) -> None:
    global _ctrl_c_seen
    _ctrl_c_seen = True
    signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt, as Python's own handler


def watch_ctrl_c() -> None:
    """Remember from now on whether a Ctrl-C (SIGINT) arrived, keeping Python's behaviour
    (KeyboardInterrupt). A library that catches the interrupt half-way through an import and
    raises its own error instead (transformers' lazy modules do) would otherwise look like
    a bug in core. Only replaces Python's default handler, in the main thread."""
    global _ctrl_c_seen
    _ctrl_c_seen = False
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _interrupt)
    except ValueError:  # not the main thread
        pass


def ctrl_c_seen() -> bool:
    """Whether a SIGINT arrived since :func:`watch_ctrl_c` that nobody handled (see
    :func:`forget_ctrl_c`)."""
    return _ctrl_c_seen


def forget_ctrl_c() -> None:
    """For code that handled a KeyboardInterrupt and goes on (``core chat`` at its prompt):
    a later error is then reported as what it is, not as the interrupt."""
    global _ctrl_c_seen
    _ctrl_c_seen = False


def keep_exit_status_after_ctrl_c() -> None:
    """Let the exit status the program chose stand after it handled a Ctrl-C.

    CPython remembers a KeyboardInterrupt that escaped code run through ``PyRun_String``
    (pybind11's ``py::exec``/``py::eval`` in an extension module, for one) even when Python
    code further up catches it, and ``python -m ...`` then ends the process by SIGINT after
    finalization whatever ``sys.exit`` said: a Ctrl-C during ``core generate``'s start-up
    exited 130 or died by SIGINT depending on which instruction it landed on. The flag is
    cleared by the next successful run through the same API, so an empty one clears it.
    Call it only where the interrupt has been handled; a no-op off CPython.
    """
    try:
        import ctypes

        ctypes.pythonapi.PyRun_SimpleString(b"")
    except (ImportError, AttributeError, OSError):  # not CPython, or no ctypes
        pass
