"""The ``core`` command: generate, chat, serve, platforms, bench."""

from __future__ import annotations

import argparse
import errno
import logging
import shutil
import socket
import sys
import textwrap

from core import envs
from core.engine_args import DEVICE_MEMORY_FLAGS, EngineArgs
from core.entrypoints.engine_flags import add_engine_flags


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128,
                   help="most tokens to generate per reply (the model's context length also caps it)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; 1 = the model's distribution")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens whose "
                   "probabilities sum to this (1 = off)")
    g.add_argument("--top-k", type=int, default=-1, help="keep only the K most likely tokens (-1 = off)")
    g.add_argument("--sample-seed", type=int, default=None,
                   help="seed of each reply's own sampling generator: the same seed gives the same reply "
                        "whatever else runs (unlike --seed, which seeds the engine once at start)")


_SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
                   "top_k": "--top-k", "seed": "--sample-seed"}


def _params(ns):
    from core.sampling_params import SamplingParams

    try:
        return SamplingParams(
            max_tokens=ns.max_tokens,
            temperature=ns.temperature,
            top_p=ns.top_p,
            top_k=ns.top_k,
            seed=ns.sample_seed,
        )
    except ValueError as e:  # name the flag the user typed, not the field behind it
        message = str(e)
        for field, flag in _SAMPLING_FLAGS.items():
            message = message.replace(f"SamplingParams.{field}=", f"{flag} ")
        raise ValueError(message) from None


def _load_llm(ns):
    from core.entrypoints.llm import LLM
    from core.progress import starting

    with starting():
        return LLM(**vars(EngineArgs.from_cli_args(ns)))


def cmd_generate(ns) -> int:
    from core.entrypoints.terminal import stream_reply

    params = _params(ns)  # a bad flag value fails before the model loads
    llm = _load_llm(ns)
    try:
        has_template = getattr(llm.get_tokenizer(), "chat_template", None)
        if ns.chat_template_off or not has_template:
            prompt = ns.prompt
        else:
            prompt = llm.apply_chat_template([{"role": "user", "content": ns.prompt}])
        reply = stream_reply(llm.engine, prompt, params)
        print(flush=True)
    finally:
        llm.engine.shutdown()
    return 130 if reply.finish_reason == "abort" else 0


def cmd_chat(ns) -> int:
    _params(ns)  # a bad flag value fails before the model loads
    llm = _load_llm(ns)
    try:
        if not getattr(llm.get_tokenizer(), "chat_template", None):
            raise ValueError(
                f"the model {llm.engine.config.model.model!r} has no chat template, which `core chat` "
                f"needs; use `core generate --no-chat-template PROMPT` for plain text completion"
            )
        return _chat_loop(llm, ns)
    finally:
        llm.engine.shutdown()


def _chat_loop(llm, ns) -> int:
    """Read a line, stream the reply, repeat. Ctrl-C during a reply stops it (see
    core.entrypoints.terminal); at the prompt, Ctrl-D or a second Ctrl-C quits."""
    from core.entrypoints.terminal import stream_reply

    try:
        import readline  # noqa: F401  (arrow keys and history for input())
    except ImportError:  # not on every platform; input() still works
        pass
    history: list[dict[str, str]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    print("Type a message and press Enter. Ctrl-C stops a reply; Ctrl-D quits.", file=sys.stderr)
    while True:
        line = _read_line()
        if line is None:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            reply = stream_reply(llm.engine, llm.apply_chat_template(history), _params(ns))
        except ValueError as e:  # e.g. the conversation no longer fits max_model_len
            history.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        print(flush=True)
        if reply.finish_reason == "abort":
            print("[reply stopped]", file=sys.stderr)
        # a stopped reply stays in the history: the user saw it and may refer to it
        history.append({"role": "assistant", "content": reply.text})


def _read_line() -> str | None:
    """The next line typed at the prompt, or None to quit: Ctrl-D, or Ctrl-C twice in a row.

    After the first Ctrl-C, a second one quits wherever it lands: in ``input()`` or in the
    few instructions between the hint and the next ``input()`` (a second Ctrl-C sent as soon
    as the hint shows lands there on a busy machine, and used to escape as an unhandled
    interrupt: exit status 130 instead of 0)."""
    from core.entrypoints.signals import forget_ctrl_c

    pressed = False
    try:
        while True:
            try:
                return input("> ")
            except KeyboardInterrupt:
                forget_ctrl_c()  # handled here: a later error is reported as itself
                if pressed:
                    return None
                pressed = True
                print("\n(Ctrl-C again or Ctrl-D to quit)", file=sys.stderr)
    except EOFError:
        return None
    except KeyboardInterrupt:
        if not pressed:
            raise  # the first Ctrl-C before input() started: not at the prompt yet
        forget_ctrl_c()
        return None


def cmd_platforms(ns) -> int:
    from core.plugins import PluginError, load_plugins
    from core.quantization.registry import platform_methods

    env = envs.read()
    plugins = load_plugins(env.no_plugin_autoload, env.plugins)
    rows = []
    for i in plugins.discover():
        caps = ", ".join(sorted(i.capabilities)) or "-"
        quant = platform_methods(i.cls)
        kv = ", ".join(("auto", *i.cls.kv_cache_dtypes()))  # --kv-cache-dtype values it takes
        rows.append([i.name, i.plugin, str(i.probe.score), i.cls.verification,
                     f"{i.probe.reason} [caps: {caps}] [quantization: {quant}] [kv cache: {kv}]"])
    for name, err in plugins.load_errors.items():
        rows.append([name, "(failed)", "-", "-", f"failed to load: {err}"])
    headers = ["platform", "plugin", "score", "verification", "probe"]
    width = shutil.get_terminal_size((100, 24)).columns
    for line in format_table(headers, rows, width, wrap={3, 4}):
        print(line)
    from core.models import model_support_summary

    print("\n" + textwrap.fill(model_support_summary(), width))
    try:
        chosen = plugins.select(env.platform or ns.platform)
        print(f"\nselected: {chosen.name}")
    except PluginError as e:
        print(f"\nselected: none ({e})")
    return 0


def format_table(headers: list[str], rows: list[list[str]], width: int, wrap: set[int]) -> list[str]:
    """Left-aligned columns, two spaces apart, each as wide as its widest cell; when that
    exceeds ``width``, the columns in ``wrap`` share what is left and their cells wrap."""
    natural = [max(len(r[c]) for r in [headers, *rows]) for c in range(len(headers))]
    widths = list(natural)
    gap = 2 * (len(headers) - 1)
    if sum(natural) + gap > width:
        room = width - gap - sum(w for c, w in enumerate(natural) if c not in wrap)
        share = max(12, room // len(wrap))  # too narrow a terminal: overflow rather than 1-char columns
        for c in wrap:
            widths[c] = min(natural[c], share)
        spare = room - sum(widths[c] for c in wrap)
        for c in sorted(wrap):  # what a short column does not use goes to the others
            extra = min(max(0, spare), natural[c] - widths[c])
            widths[c] += extra
            spare -= extra
    lines = []
    for r, row in enumerate([headers, *rows]):
        cells = [textwrap.wrap(cell, widths[c], break_on_hyphens=False) or [""] if c in wrap else [cell] for c, cell in enumerate(row)]
        for k in range(max(len(x) for x in cells)):
            parts = [(x[k] if k < len(x) else "").ljust(widths[c]) for c, x in enumerate(cells)]
            lines.append("  ".join(parts).rstrip())
        if r == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def cmd_serve(ns) -> int:
    from core.entrypoints.openai.server import run_server

    # Before the model loads (that can take a minute): a busy port should fail at once.
    check_port_free(ns.host, ns.port)
    return run_server(ns)


def check_port_free(host: str, port: int) -> None:
    """Bind ``(host, port)`` the way uvicorn will, and release it; raise UsageError saying
    what to change when that fails."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port} is not a TCP port; use a number from 1 to 65535, e.g. 8000")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # as uvicorn does: a connection of an earlier server still in TIME_WAIT is no conflict
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except socket.gaierror as e:
            raise UsageError(f"--host {host!r} is not an address here ({e.strerror}); use e.g. "
                             f"127.0.0.1 (this machine only) or 0.0.0.0 (all interfaces)") from None
        except OSError as e:
            raise UsageError(_bind_error(host, port, e)) from None


def _bind_error(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is already in use (another `core serve`?); stop that "
                f"process or pick a free port with --port, e.g. --port {port + 1 if port < 65535 else 8000}")
    if e.errno == errno.EACCES:
        return f"no permission to listen on port {port} (ports below 1024 need root); use --port 8000"
    if e.errno == errno.EADDRNOTAVAIL:
        return (f"--host {host} is not an address of this machine; use 127.0.0.1 (this machine "
                f"only) or 0.0.0.0 (all interfaces)")
    return f"cannot listen on {host}:{port}: {e.strerror}; pick another --host or --port"


def cmd_bench_serve(ns) -> int:
    from core.benchmarks.serve import run_serve_bench

    return run_serve_bench(ns)


def cmd_bench_latency(ns) -> int:
    from core.benchmarks.latency import run_latency

    return run_latency(ns)


def cmd_bench(ns) -> int:
    from core.benchmarks.throughput import run_throughput

    return run_throughput(ns)


class UsageError(Exception):
    """A mistake in how ``core`` was invoked; its message says what to change."""


class _Parser(argparse.ArgumentParser):
    """A bad flag gets one line and a pointer to --help, not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message}\n(see `{self.prog} --help`)\n")


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default after its help, unless the help already speaks of it or
    there is nothing to show (None, or False for an on/off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        nothing = action.default is None or action.default is argparse.SUPPRESS or isinstance(action.default, bool)
        if "default" in text or nothing or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        # "--max-num-seqs N" reads better than "--max-num-seqs MAX_NUM_SEQS"
        return {int: "N", float: "X"}.get(action.type) or super()._get_default_metavar_for_optional(action)


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def build_parser(device_memory: bool = True) -> argparse.ArgumentParser:
    """The ``core`` parser. ``device_memory=False`` hides the flags that only platforms
    with their own device memory read (they are still accepted)."""
    parser = _Parser(prog="core", description="LLM inference and serving engine")
    _debug_arg(parser, argparse_default=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="generate a reply to one prompt, streamed as it is produced")
    p.add_argument("prompt", help="the user message (or raw text with --no-chat-template)")
    p.add_argument("--no-chat-template", dest="chat_template_off", action="store_true",
                   help="send the prompt as raw text instead of a chat turn")
    add_engine_flags(p)
    _sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat; Ctrl-C stops a reply, Ctrl-D quits")
    p.add_argument("--system", default=None, help="system prompt")
    add_engine_flags(p)
    _sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("platforms", help="list discovered platforms and which would be chosen")
    p.add_argument("--platform", default=None, help="show whether this platform can be selected")
    p.set_defaults(func=cmd_platforms)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="same as --model (HF model dir or .gguf file)")
    p.set_defaults(func=cmd_serve)
    _add_serve_args(p)

    p = sub.add_parser("bench", help="benchmarks: throughput, latency, serve")
    _add_bench_parsers(p.add_subparsers(dest="bench", required=True, metavar="BENCH"))
    for p in _all_parsers(parser):
        p.formatter_class = _HelpFormatter
        if p is not parser:
            _debug_arg(p, argparse_default=argparse.SUPPRESS)
        if not device_memory:
            for action in p._actions:
                if set(action.option_strings) & set(DEVICE_MEMORY_FLAGS):
                    action.help = argparse.SUPPRESS
    return parser


def _debug_arg(p: argparse.ArgumentParser, argparse_default) -> None:
    # SUPPRESS on subcommands: their default must not overwrite `core --debug CMD`
    p.add_argument("--debug", action="store_true", default=argparse_default,
                   help="log at DEBUG and show the full traceback of an error (also: CORE_LOG_LEVEL=DEBUG)")


def _add_bench_parsers(bsub) -> None:
    from core.benchmarks.latency import add_latency_args
    from core.benchmarks.serve import add_serve_bench_args
    from core.benchmarks.throughput import add_throughput_args

    b = bsub.add_parser("throughput", help="offline throughput of N random-token requests")
    add_throughput_args(b)
    b.set_defaults(func=cmd_bench)
    b = bsub.add_parser("latency", help="time per output token of small batches; engine start")
    add_latency_args(b)
    b.set_defaults(func=cmd_bench_latency)
    b = bsub.add_parser("serve", help="load an OpenAI server (TTFT/TPOT percentiles); --offline: same load in-process")
    add_serve_bench_args(b)
    b.set_defaults(func=cmd_bench_serve)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    try:
        from core.entrypoints.openai.args import add_server_args
    except ImportError:  # server not installed in this build
        add_engine_flags(p)
        return
    add_server_args(p)


def _help_device_memory(argv: list[str], env: envs.Env) -> bool:
    """For ``--help`` only: whether the platform that would run has device memory. Any
    failure to tell shows the flags (better too many than a hidden one)."""
    if not {"-h", "--help"} & set(argv):
        return True
    from core.platform import Capability
    from core.plugins import load_plugins

    name = env.platform
    if "--platform" in argv[:-1]:
        name = argv[argv.index("--platform") + 1]
    try:
        caps = load_plugins(env.no_plugin_autoload, env.plugins).select(name).capabilities  # in force here
    except Exception:  # --help must work where no platform can be selected: show the flag;
        return True     # running the command reports the selection error itself
    return Capability.DEVICE_MEMORY in caps


_USER_ERRORS = (ValueError, UsageError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def _report(e: BaseException) -> int:
    """One ``error:`` line for an exception a user can act on; exit code 2 for a mistake in
    the invocation, 1 for anything else."""
    from core.plugins import PluginError

    if isinstance(e, (*_USER_ERRORS, PluginError)):
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
    print("this looks like a bug in core: rerun with --debug for the traceback and report it", file=sys.stderr)
    return 1


def _interrupted() -> int:
    """A Ctrl-C the command did not handle itself: one line and exit status 130."""
    from core.entrypoints.signals import keep_exit_status_after_ctrl_c

    print("\ninterrupted", file=sys.stderr)
    keep_exit_status_after_ctrl_c()
    return 130


def main(argv: list[str] | None = None) -> int:
    from core.entrypoints.signals import ctrl_c_seen, exit_on_sigterm, watch_ctrl_c

    exit_on_sigterm()  # first: a SIGTERM during start-up (kernel build, model load) unwinds
    watch_ctrl_c()
    env = envs.read()
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = env.log_level.upper() == "DEBUG"
    try:  # from the first line: building the parser imports torch (a second or so)
        ns = build_parser(_help_device_memory(argv, env)).parse_args(argv)
        debug = debug or ns.debug
        try:
            logging.basicConfig(level="DEBUG" if debug else env.log_level.upper(),
                                format="%(levelname)s %(name)s: %(message)s")
        except ValueError:
            print(f"error: CORE_LOG_LEVEL={env.log_level!r} is not a log level; use DEBUG, INFO, "
                  f"WARNING or ERROR", file=sys.stderr)
            return 2
        if getattr(ns, "model_pos", None) and not getattr(ns, "model", None):
            ns.model = ns.model_pos
        return ns.func(ns)
    except KeyboardInterrupt:
        if debug:
            raise
        return _interrupted()
    except Exception as e:
        if debug:
            raise
        # a library that turned the Ctrl-C into an error of its own (an import cut part-way)
        return _interrupted() if ctrl_c_seen() else _report(e)


if __name__ == "__main__":
    sys.exit(main())
