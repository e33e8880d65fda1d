"""The ``core`` parser's help (every flag explained, defaults shown, device-memory flags only
where they apply), the ``core platforms`` table layout and the port check. No model."""

from __future__ import annotations

import argparse
import socket

import pytest

from core import envs
from core.entrypoints import cli


def _parsers(parser: argparse.ArgumentParser, path=("core",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_flag_has_help():
    missing = [
        f"{' '.join(path)} {action.option_strings or action.dest}"
        for path, p in _parsers(cli.build_parser())
        for action in p._actions
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) and not action.help
    ]
    assert not missing, f"flags without help text: {missing}"


def _help(*path: str, device_memory: bool = True) -> str:
    parsers = dict(_parsers(cli.build_parser(device_memory)))
    return parsers[("core", *path)].format_help()


def _entry(text: str, flag: str) -> str:
    """The help entry of ``flag`` (its lines below the usage), unwrapped."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith(flag + " ") and ln.startswith("  -"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("  -") or not lines[i].strip()),
               len(lines))
    return " ".join(" ".join(lines[start:end]).split())


@pytest.mark.parametrize("path, flag, default", [
    (("serve",), "--port", "8000"),
    (("serve",), "--host", "127.0.0.1"),
    (("generate",), "--max-tokens", "128"),
    (("chat",), "--seed", "0"),
    (("generate",), "--temperature", "0.0"),
    (("bench", "throughput"), "--num-prompts", "32"),
    (("bench", "serve"), "--request-rate", "inf"),
])
def test_defaults_are_shown(path, flag, default):
    entry = _entry(_help(*path), flag)
    assert f"default: {default}" in entry, entry


def test_seed_and_sample_seed_explain_each_other():
    text = _help("generate")
    assert "--sample-seed" in _entry(text, "--seed")
    assert "--seed," in _entry(text, "--sample-seed")


def test_device_memory_flags_hidden_only_without_device_memory():
    assert "--gpu-memory-utilization" in _help("serve", device_memory=True)
    assert "--gpu-memory-utilization" not in _help("serve", device_memory=False)
    assert "--gpu-memory-utilization" not in _help("bench", "latency", device_memory=False)
    # still accepted: a script written for a GPU box does not break on the CPU
    ns = cli.build_parser(False).parse_args(["generate", "hi", "--gpu-memory-utilization", "0.5"])
    assert ns.gpu_memory_utilization == 0.5


def test_help_asks_the_selected_platform():
    env = envs.read({"CORE_PLATFORM": "cpu"})
    assert cli._help_device_memory(["serve", "--help"], env) is False  # the CPU has no device memory
    assert cli._help_device_memory(["serve"], env) is True  # not a help run: nothing probed


def test_platforms_table_aligns_and_fits():
    headers = ["platform", "plugin", "score", "verification", "probe"]
    rows = [["cpu", "cpu", "1", "real hardware (x86-64 CPU, CI)", "2 CPU cores"],
            ["cuda", "cuda", "0", "real hardware: NVIDIA H200, torch 2.11.0+cu130, driver 580 " * 3,
             "torch is a CPU-only build; install a CUDA build of torch to use the cuda platform"]]
    lines = cli.format_table(headers, rows, width=80, wrap={3, 4})
    assert all(len(line) <= 80 for line in lines), lines
    col = lines[0].index("verification")
    assert lines[0].index("probe") > col
    for line in lines[2:]:  # the verification column starts at one offset on every line
        assert len(line) <= col or line[col - 2: col] == "  ", line
    assert sum(line.startswith("cuda") for line in lines) == 1 and len(lines) > 4  # the long row wrapped
    words = " ".join(line[col:].split("  ")[0] for line in lines[2:]).split()
    assert words.count("H200,") == 3  # nothing of the wrapped text is lost


def test_table_without_wrapping_keeps_natural_widths():
    lines = cli.format_table(["a", "bb"], [["xxx", "y"]], width=200, wrap={1})
    assert lines == ["a    bb", "---  --", "xxx  y"]


def test_busy_port_error_names_port_and_fix():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(cli.UsageError, match=rf"port {port} on 127.0.0.1 is already in use.*--port"):
            cli.check_port_free("127.0.0.1", port)


def test_free_port_passes_and_bad_values_are_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cli.check_port_free("127.0.0.1", port)  # released above: free again
    with pytest.raises(cli.UsageError, match="--port 70000"):
        cli.check_port_free("127.0.0.1", 70000)
    with pytest.raises(cli.UsageError, match="--host"):
        cli.check_port_free("no-such-host.invalid", 8000)


def test_bad_flag_is_one_line_with_a_pointer_to_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "hi", "--dtype", "float8"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: core generate: argument --dtype: invalid choice: 'float8' (choose from 'auto', "
                   "'float32', 'bfloat16', 'float16')", "(see `core generate --help`)"]


def test_sampling_errors_name_the_flag():
    ns = cli.build_parser().parse_args(["generate", "hi", "--max-tokens", "0"])
    with pytest.raises(ValueError, match=r"^--max-tokens 0 is invalid"):
        cli._params(ns)
    ns = cli.build_parser().parse_args(["generate", "hi", "--top-p", "2"])
    with pytest.raises(ValueError, match=r"^--top-p 2.0 is invalid"):
        cli._params(ns)
