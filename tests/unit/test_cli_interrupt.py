"""``core``'s main(): a Ctrl-C anywhere before the command handles it (building the parser,
which imports torch; loading the model; a library that wraps the interrupt in its own
error) ends with one "interrupted" line and exit status 130, never a traceback or a "bug in
core" report; other errors keep their report."""

from __future__ import annotations

import os
import signal
import time

import pytest

from core.entrypoints import cli


def _raises(exc: BaseException):
    def command(ns):
        raise exc
    return command


def _library_wraps_the_interrupt(ns):
    """A real SIGINT, caught half-way by a library that raises its own error instead (as
    transformers' lazy modules do when an import is cut)."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler raises here
    except KeyboardInterrupt:
        pass
    raise ModuleNotFoundError("Could not import module 'LlamaConfig'")


def test_ctrl_c_in_the_command_is_one_line_and_130(monkeypatch, capsys):
    monkeypatch.setattr(cli, "cmd_generate", _raises(KeyboardInterrupt()))
    assert cli.main(["generate", "hi"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "interrupted", err


def test_a_ctrl_c_a_library_turned_into_its_own_error_is_still_an_interrupt(monkeypatch, capsys):
    monkeypatch.setattr(cli, "cmd_generate", _library_wraps_the_interrupt)
    previous = signal.getsignal(signal.SIGINT)
    try:
        assert cli.main(["generate", "hi"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert capsys.readouterr().err.strip() == "interrupted"


def test_an_error_after_a_handled_ctrl_c_is_reported_as_itself(monkeypatch, capsys):
    """A Ctrl-C the command handled and went on from (``core chat`` at its prompt) does not
    turn a later error into "interrupted"."""
    from core.entrypoints.signals import forget_ctrl_c

    def command(ns):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            forget_ctrl_c()
        raise ModuleNotFoundError("Could not import module 'LlamaConfig'")

    monkeypatch.setattr(cli, "cmd_generate", command)
    previous = signal.getsignal(signal.SIGINT)
    try:
        assert cli.main(["generate", "hi"]) == 1
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "bug in core" in capsys.readouterr().err


def test_ctrl_c_while_the_parser_is_built(monkeypatch, capsys):
    def build_parser(*args):
        raise KeyboardInterrupt  # torch being imported by the server flags' module
    monkeypatch.setattr(cli, "build_parser", build_parser)
    assert cli.main(["generate", "hi"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_an_import_error_of_its_own_is_still_reported(monkeypatch, capsys):
    """No Ctrl-C: the same kind of error is a bug report (the watch starts clean each run)."""
    monkeypatch.setattr(cli, "cmd_generate", _raises(ModuleNotFoundError("Could not import module 'LlamaConfig'")))
    assert cli.main(["generate", "hi"]) == 1
    err = capsys.readouterr().err
    assert "ModuleNotFoundError" in err and "bug in core" in err, err


def test_debug_keeps_the_interrupt(monkeypatch):
    monkeypatch.setattr(cli, "cmd_generate", _raises(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        cli.main(["generate", "hi", "--debug"])
