"""The conformance suite's pytest plugin (entry point ``core_conformance`` in ``pytest11``).

Installed with ``core``, so it is active in every pytest run of an environment that has
core; it does nothing unless asked. It adds:

* ``--core-platform=NAME``: the platform the checks run against, selected the way the
  engine selects one (``core.plugins.load_plugins().select(NAME)``, so the platform must
  be installed and its probe must call it usable here);
* collection of the check modules (``core/conformance/checks_*.py``) whenever pytest is
  pointed at them (``--pyargs core.conformance``), whatever the project's
  ``python_files`` setting;
* fixtures ``core_platform`` (the selected :class:`~core.platform.Platform` instance),
  ``conformance_model_dir`` and ``conformance_cpu_outputs`` (end-to-end check);
* a terminal summary section per platform: each check, passed or failed, the device type
  the tensors lived on and the platform's ``verification`` level (real hardware,
  emulated on CPU, never run).

Nothing heavy is imported until a check runs, so other projects' test runs stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

CHECKS_DIR = Path(__file__).parent
CHECK_MODULE_PREFIX = "core.conformance.checks_"
RESULTS = pytest.StashKey[dict]()
"""config.stash key: (platform name, device type, verification) -> check -> CheckResult."""


@dataclass
class CheckResult:
    outcome: str = "passed"
    """passed | failed | error (setup or teardown failed) | skipped."""
    summary: str = ""
    """The check's docstring, one line."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("core-conformance", "core platform conformance suite")
    group.addoption(
        "--core-platform",
        dest="core_platform",
        default=None,
        metavar="NAME",
        help="platform to run the core conformance checks against "
        "(run them with: pytest --core-platform=NAME --pyargs core.conformance)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[RESULTS] = {}


def pytest_report_header(config: pytest.Config) -> str | None:
    name = config.getoption("core_platform", default=None)
    return f"core conformance: platform {name!r}" if name else None


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    if (
        file_path.parent == CHECKS_DIR
        and file_path.name.startswith("checks_")
        and file_path.suffix == ".py"
    ):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


# ---- fixtures -----------------------------------------------------------------------------
def select_platform(name: str):
    """Instantiate platform ``name`` through the engine's discovery and selection path."""
    from core import envs
    from core.plugins import load_plugins

    env = envs.read()
    info = load_plugins(env.no_plugin_autoload, env.plugins).select(name)
    return info.cls()


@pytest.fixture(scope="session")
def core_platform(request: pytest.FixtureRequest):
    """The Platform instance named by ``--core-platform``."""
    name = request.config.getoption("core_platform", default=None)
    if not name:
        raise pytest.UsageError(
            "the core conformance checks need a platform: pytest --core-platform=NAME "
            "--pyargs core.conformance (NAME as listed by `core platforms`)"
        )
    return select_platform(name)


@pytest.fixture(scope="session")
def conformance_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with its tokenizer, written once per session."""
    from core.conformance.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("conformance") / "tiny-llama")


@pytest.fixture(scope="session")
def conformance_cpu_outputs(conformance_model_dir: Path):
    """``dtype -> outputs of the CPU platform`` for the end-to-end check (computed once)."""
    from core.conformance.checks_e2e import generate

    done: dict[str, list] = {}

    def outputs(dtype: str) -> list:
        if dtype not in done:
            done[dtype] = generate(conformance_model_dir, "cpu", dtype)
        return done[dtype]

    return outputs


# ---- recording and the summary ----------------------------------------------------------------
@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    fn = getattr(item, "function", None)
    if fn is not None and fn.__module__.startswith(CHECK_MODULE_PREFIX):
        _record(item, report, fn)
    return report


def _record(item: pytest.Item, report: pytest.TestReport, fn) -> None:
    platform = getattr(item, "funcargs", {}).get("core_platform")
    if platform is not None:
        key = (platform.name, platform.device_type, platform.verification)
    else:  # setup failed before the platform existed
        name = item.config.getoption("core_platform", default=None) or "?"
        key = (name, "?", "not determined: platform setup failed")
    checks = item.config.stash[RESULTS].setdefault(key, {})
    doc = " ".join((fn.__doc__ or "").split())
    result = checks.setdefault(fn.__name__.removeprefix("test_"), CheckResult(summary=doc))
    if report.failed:
        result.outcome = "failed" if report.when == "call" else "error"
    elif report.skipped and result.outcome == "passed":
        result.outcome = "skipped"


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    results = config.stash.get(RESULTS, {})
    for (name, device_type, verification), checks in results.items():
        tr = terminalreporter
        tr.write_sep("=", f"core conformance: platform {name!r}")
        tr.write_line(
            f"tensors on device type {device_type!r}; verification level: {verification}"
        )
        for check, r in checks.items():
            mark = {"passed": "green", "skipped": "yellow"}.get(r.outcome, "red")
            tr.write(f"  {r.outcome.upper():8}", **{mark: True})
            tr.write_line(f"{check:28} {r.summary[:90]}")
        passed = sum(r.outcome == "passed" for r in checks.values())
        tr.write_line(f"  {passed}/{len(checks)} checks passed on {name!r} ({verification})")
