"""``core chat``'s prompt (core.entrypoints.cli._read_line): Ctrl-D or two Ctrl-C in a row
quit, whichever instruction the second Ctrl-C lands on. The interrupts are raised where
SIGINT would raise them (in ``input()``, or while the hint after the first one prints), so
the window a busy machine opens between the hint and the next ``input()`` is tested
without a clock (the pseudo-terminal test, tests/integration/test_cli_terminal.py, hit it
only under load)."""

from __future__ import annotations

import builtins

from core.entrypoints import cli


def _script(monkeypatch, *steps):
    """input() takes its results from steps: a string is a typed line, an exception is raised."""
    it = iter(steps)

    def fake_input(prompt=""):
        step = next(it)
        if isinstance(step, BaseException):
            raise step
        return step

    monkeypatch.setattr(builtins, "input", fake_input)


def test_a_line_is_returned_and_ctrl_d_quits(monkeypatch):
    _script(monkeypatch, "hello", EOFError())
    assert cli._read_line() == "hello"
    assert cli._read_line() is None


def test_one_ctrl_c_shows_the_hint_and_reading_goes_on(monkeypatch, capsys):
    _script(monkeypatch, KeyboardInterrupt(), "still here")
    assert cli._read_line() == "still here"
    assert "Ctrl-C again" in capsys.readouterr().err


def test_two_ctrl_c_at_the_prompt_quit(monkeypatch):
    _script(monkeypatch, KeyboardInterrupt(), KeyboardInterrupt())
    assert cli._read_line() is None


def test_a_second_ctrl_c_while_the_hint_prints_quits(monkeypatch):
    _script(monkeypatch, KeyboardInterrupt(), "never read")
    real_print = builtins.print

    def print_then_interrupted(*args, **kwargs):
        real_print(*args, **kwargs)
        if any("Ctrl-C again" in str(a) for a in args):
            raise KeyboardInterrupt  # SIGINT handled right after the hint was written

    monkeypatch.setattr(builtins, "print", print_then_interrupted)
    assert cli._read_line() is None

