"""The ``core`` command: generate, chat, serve, platforms, bench."""

from __future__ import annotations

import argparse
import logging
import sys

from core import envs
from core.engine_args import EngineArgs


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")


def _params(ns):
    from core.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.sample_seed,
    )


def cmd_generate(ns) -> int:
    from core.entrypoints.llm import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(ns)))
    if ns.chat_template_off:
        outs = llm.generate([ns.prompt], _params(ns), use_tqdm=False)
    else:
        outs = llm.chat([{"role": "user", "content": ns.prompt}], _params(ns), use_tqdm=False) \
            if getattr(llm.get_tokenizer(), "chat_template", None) else \
            llm.generate([ns.prompt], _params(ns), use_tqdm=False)
    print(outs[0].outputs[0].text)
    return 0


def cmd_chat(ns) -> int:
    from core.entrypoints.llm import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(ns)))
    history: list[dict[str, str]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    print("Type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, _params(ns), use_tqdm=False)[0].outputs[0].text
        print(reply, flush=True)
        history.append({"role": "assistant", "content": reply})
    return 0


def cmd_platforms(ns) -> int:
    from core.plugins import PluginError, load_plugins

    env = envs.read()
    plugins = load_plugins(env.no_plugin_autoload, env.plugins)
    infos = plugins.discover()
    print(f"{'platform':<10} {'plugin':<14} {'score':>5}  {'verification':<28} probe")
    for i in infos:
        caps = ",".join(sorted(i.cls.capabilities)) or "-"
        print(f"{i.name:<10} {i.plugin:<14} {i.probe.score:>5}  {i.cls.verification:<28} {i.probe.reason} [caps: {caps}]")
    for name, err in plugins.load_errors.items():
        print(f"{name:<10} {'(failed)':<14} {'-':>5}  {'-':<28} failed to load: {err}")
    try:
        chosen = plugins.select(env.platform or ns.platform)
        print(f"\nselected: {chosen.name}")
    except PluginError as e:
        print(f"\nselected: none ({e})")
    return 0


def cmd_serve(ns) -> int:
    from core.entrypoints.openai.server import run_server

    return run_server(ns)


def cmd_bench_serve(ns) -> int:
    from core.benchmarks.serve import run_serve_bench

    return run_serve_bench(ns)


def cmd_bench_latency(ns) -> int:
    from core.benchmarks.latency import run_latency

    return run_latency(ns)


def cmd_bench(ns) -> int:
    from core.benchmarks.throughput import run_throughput

    return run_throughput(ns)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="core", description="LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate a reply to one prompt")
    p.add_argument("prompt")
    p.add_argument("--no-chat-template", dest="chat_template_off", action="store_true",
                   help="send the prompt as raw text instead of a chat turn")
    EngineArgs.add_cli_args(p)
    _sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat")
    p.add_argument("--system", default=None, help="system prompt")
    EngineArgs.add_cli_args(p)
    _sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("platforms", help="list discovered platforms and which would be chosen")
    p.add_argument("--platform", default=None)
    p.set_defaults(func=cmd_platforms)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL")
    p.set_defaults(func=cmd_serve)
    _add_serve_args(p)

    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    b = bsub.add_parser("throughput", help="offline throughput of N random-token requests")
    b.add_argument("--num-prompts", type=int, default=32)
    b.add_argument("--input-len", type=int, default=128)
    b.add_argument("--output-len", type=int, default=128)
    b.add_argument("--output-json", default=None)
    b.add_argument("--step-timing", action="store_true",
                   help="time schedule / execute / update of every step separately")
    EngineArgs.add_cli_args(b)
    b.set_defaults(func=cmd_bench)
    b = bsub.add_parser("latency", help="time per output token of small batches; engine start")
    from core.benchmarks.latency import add_latency_args

    add_latency_args(b)
    b.set_defaults(func=cmd_bench_latency)
    b = bsub.add_parser("serve", help="load an OpenAI server (TTFT/TPOT percentiles); --offline: same load in-process")
    from core.benchmarks.serve import add_serve_bench_args

    add_serve_bench_args(b)
    b.set_defaults(func=cmd_bench_serve)
    return parser


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    try:
        from core.entrypoints.openai.args import add_server_args
    except ImportError:  # server not installed in this build
        EngineArgs.add_cli_args(p)
        return
    add_server_args(p)


def main(argv: list[str] | None = None) -> int:
    from core.entrypoints.signals import exit_on_sigterm

    exit_on_sigterm()  # first: a SIGTERM during start-up (kernel build, model load) unwinds
    env = envs.read()
    logging.basicConfig(level=env.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    if getattr(ns, "model_pos", None) and not getattr(ns, "model", None):
        ns.model = ns.model_pos
    try:
        return ns.func(ns)
    except (ValueError, RuntimeError) as e:
        from core.plugins import PluginError

        if isinstance(e, (ValueError, PluginError)):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
