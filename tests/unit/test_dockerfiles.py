"""Invariants of the container images in docker/ (one Dockerfile per architecture).

CI has no Docker engine, so nothing here builds an image. Instead each Dockerfile is parsed with
dockerfile-parse and the properties a later edit must not silently drop are pinned: multi-stage
with a fresh runtime base, pinned base images, a non-root final user, a HEALTHCHECK that really
queries /health, the exposed port, installation only through docker/install.sh, `core serve` as
the default command, no model weights copied in, no secret-looking build args or env. The shared
entry point script and the .dockerignore allowlist are exercised for real.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"

# Dockerfile -> the docker/install.sh PLATFORM it must install.
IMAGES = {
    "Dockerfile": "cuda",
    "Dockerfile.rocm": "rocm",
    "Dockerfile.cpu": "cpu",
    "Dockerfile.arm": "cpu",
    "Dockerfile.xpu": "xpu",
    "Dockerfile.tpu": "tpu",
    "Dockerfile.hpu": "hpu",
}
# Images whose build stage compiles csrc/: (image prefix, marker of the toolkit flavour). The
# toolkit flavour belongs in the build stage only; the runtime stage must be the slim one.
COMPILERS = {
    "Dockerfile": ("nvidia/cuda:", "-devel-"),
    "Dockerfile.rocm": ("rocm/dev-", "-complete"),
}
WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")
SECRET_NAME = re.compile(r"token|secret|passw|api_?key|access_?key|credential|auth", re.I)
VENV = "/opt/core/venv"


@dataclass(frozen=True)
class Stage:
    name: str | None  # the `AS name`, if any
    base: str  # image reference after global-ARG substitution
    instrs: tuple[tuple[str, str], ...]  # (INSTRUCTION, value) in file order

    def values(self, instruction: str) -> list[str]:
        return [v for i, v in self.instrs if i == instruction]


def _substitute(text: str, args: dict[str, str]) -> str:
    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        return args.get(name, m.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, text)


def stages(name: str) -> list[Stage]:
    """Split a Dockerfile into stages; ARGs before the first FROM are substituted into FROM."""
    parser = DockerfileParser(fileobj=io.BytesIO((DOCKER / name).read_bytes()))
    global_args: dict[str, str] = {}
    out: list[Stage] = []
    current: list[tuple[str, str]] = []
    for item in parser.structure:
        instr, value = item["instruction"], item["value"]
        if instr == "COMMENT":
            continue
        if instr == "FROM":
            if out:
                out[-1] = Stage(out[-1].name, out[-1].base, tuple(current))
            ref, _, alias = _substitute(value, global_args).partition(" AS ")
            fields = ref.split()
            out.append(Stage(alias.strip() or None, fields[-1], ()))
            current = []
        elif not out and instr == "ARG":
            key, _, default = value.partition("=")
            global_args[key.strip()] = default.strip().strip('"')
        elif out:
            current.append((instr, value))
    out[-1] = Stage(out[-1].name, out[-1].base, tuple(current))
    return out


def _final(name: str) -> Stage:
    return stages(name)[-1]


def _json_list(value: str) -> list[str]:
    parsed = json.loads(value)
    assert isinstance(parsed, list), f"expected exec form (a JSON list), got {value!r}"
    return parsed


def _split_ref(ref: str) -> tuple[str, str | None, str | None]:
    """image reference -> (repository, tag or None, digest or None)."""
    ref, _, digest = ref.partition("@")
    last = ref.rsplit("/", 1)[-1]
    if ":" in last:
        repo, tag = ref.rsplit(":", 1)
        return repo, tag, digest or None
    return ref, None, digest or None


def _key_values(instr: str, value: str) -> dict[str, str]:
    """Names and values set by one ARG or ENV instruction (both `K=V ...` and legacy `K V`)."""
    if instr == "ENV" and "=" not in value.split()[0]:
        key, _, rest = value.partition(" ")
        return {key: rest.strip()}
    pairs = shlex.split(value.replace("\\\n", " "))
    return {k: v for k, _, v in (p.partition("=") for p in pairs)}


@pytest.fixture(params=sorted(IMAGES))
def dockerfile(request) -> str:
    return request.param


# --- structure ------------------------------------------------------------------------------


def test_exactly_the_seven_images_exist():
    found = {p.name for p in DOCKER.glob("Dockerfile*")}
    assert found == set(IMAGES), (
        f"docker/ holds {sorted(found)}; expected {sorted(IMAGES)}. A new image must be added to "
        "IMAGES here (and to docker/lint.sh) so its invariants are checked."
    )


def test_multi_stage_with_fresh_runtime_base(dockerfile):
    all_stages = stages(dockerfile)
    assert len(all_stages) >= 2, f"{dockerfile}: needs a build stage and a runtime stage"
    earlier = {s.name for s in all_stages[:-1] if s.name}
    final = all_stages[-1]
    assert final.base not in earlier, (
        f"{dockerfile}: the runtime stage starts FROM the build stage '{final.base}', so every "
        "build tool ends up in the image; start it from a base image and COPY --from the venv"
    )
    copies = [v for v in final.values("COPY") if v.startswith("--from=")]
    sources = {v.split()[0].removeprefix("--from=") for v in copies if VENV in v}
    assert sources & earlier, f"{dockerfile}: runtime stage must COPY {VENV} from a build stage"


def test_base_images_pinned(dockerfile):
    names = set()
    for stage in stages(dockerfile):
        if stage.base in names:  # FROM an earlier stage, not an image
            names.add(stage.name)
            continue
        names.add(stage.name)
        assert "$" not in stage.base, f"{dockerfile}: unresolved variable in FROM {stage.base}"
        repo, tag, digest = _split_ref(stage.base)
        if digest is not None:
            assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), f"{dockerfile}: bad digest"
        assert tag, f"{dockerfile}: FROM {stage.base} has no tag; pin a version tag"
        assert tag != "latest", f"{dockerfile}: FROM {stage.base} uses :latest; pin a version"
        assert re.search(r"\d", tag), f"{dockerfile}: tag '{tag}' of {repo} names no version"


@pytest.mark.parametrize("dockerfile", sorted(COMPILERS))
def test_csrc_compiling_images_use_toolkit_only_in_build(dockerfile):
    prefix, marker = COMPILERS[dockerfile]
    build, final = stages(dockerfile)[0], stages(dockerfile)[-1]
    assert build.base.startswith(prefix) and marker in build.base, (
        f"{dockerfile}: build stage {build.base} lacks the compiler toolkit ({prefix}*{marker}*)"
    )
    assert final.base.startswith(prefix) and marker not in final.base, (
        f"{dockerfile}: runtime stage {final.base} should be the slim {prefix} image"
    )


# --- runtime contract -----------------------------------------------------------------------


def test_final_stage_runs_as_non_root(dockerfile):
    users = _final(dockerfile).values("USER")
    assert users, f"{dockerfile}: the runtime stage sets no USER, so it runs as root"
    user = users[-1].split(":")[0].strip()
    assert user not in ("root", "0"), f"{dockerfile}: final USER is {users[-1]}"


def test_exposes_the_server_port(dockerfile):
    final = _final(dockerfile)
    ports = {p.split("/")[0] for v in final.values("EXPOSE") for p in v.split()}
    env = {}
    for v in final.values("ENV"):
        env.update(_key_values("ENV", v))
    assert "8000" in ports, f"{dockerfile}: EXPOSE 8000 missing (found {sorted(ports)})"
    assert env.get("CORE_PORT") == "8000", f"{dockerfile}: ENV CORE_PORT=8000 missing"


def test_default_command_is_core_serve(dockerfile):
    final = _final(dockerfile)
    entry = _json_list(final.values("ENTRYPOINT")[-1])
    cmd = _json_list(final.values("CMD")[-1])
    assert entry == ["core-entrypoint"], f"{dockerfile}: ENTRYPOINT is {entry}"
    assert cmd[:2] == ["core", "serve"], f"{dockerfile}: CMD is {cmd}, not core serve"
    copies = [v.split() for v in final.values("COPY")]
    assert any(
        c[-2:] == ["docker/entrypoint.sh", "/usr/local/bin/core-entrypoint"] for c in copies
    ), f"{dockerfile}: docker/entrypoint.sh is not installed as core-entrypoint"


def _healthcheck_code(dockerfile: str) -> str:
    checks = _final(dockerfile).values("HEALTHCHECK")
    assert checks, f"{dockerfile}: no HEALTHCHECK in the runtime stage"
    value = checks[-1]
    assert "NONE" not in value.split(), f"{dockerfile}: HEALTHCHECK is disabled"
    argv = _json_list(value.split(" CMD ", 1)[1].strip())
    assert argv[:2] == ["python", "-c"], (
        f"{dockerfile}: HEALTHCHECK should run `python -c` (the images carry no curl): {argv}"
    )
    return argv[2]


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def _run_probe(code: str, status: int) -> int:
    handler = type("Handler", (_Health,), {"status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {**os.environ, "CORE_PORT": str(server.server_address[1])}
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, timeout=30
        ).returncode
    finally:
        server.shutdown()
        server.server_close()


def test_healthcheck_queries_health_on_core_port(dockerfile):
    code = _healthcheck_code(dockerfile)
    assert "/health" in code
    assert _run_probe(code, 200) == 0, f"{dockerfile}: healthcheck fails against a healthy server"
    assert _run_probe(code, 503) != 0, f"{dockerfile}: healthcheck passes an unhealthy server"


# --- install recipe -------------------------------------------------------------------------


def test_installs_only_through_the_shared_script(dockerfile):
    platform = IMAGES[dockerfile]
    runs = [v for s in stages(dockerfile) for v in s.values("RUN")]
    calls = [r for r in runs if re.search(rf"docker/install\.sh {platform}(\s|$)", r)]
    assert calls, f"{dockerfile}: no RUN calls docker/install.sh {platform}"
    direct = [r for r in runs if re.search(r"\bpip3?(\.\d+)?\s+install\b|-m pip\b", r)]
    assert not direct, f"{dockerfile}: installs with pip directly, bypassing install.sh: {direct}"


def _install_sh_default_torch(platform: str) -> str | None:
    text = (DOCKER / "install.sh").read_text()
    m = re.search(rf'^\s*{platform}\)\s+default_torch="?([\w.+]*)"?;', text, re.M)
    assert m, f"install.sh has no default torch line for {platform}"
    return m.group(1) or None


def test_torch_pin_matches_install_script(dockerfile):
    platform = IMAGES[dockerfile]
    args = {}
    for stage in stages(dockerfile):
        for v in stage.values("ARG"):
            args.update(_key_values("ARG", v))
    expected = _install_sh_default_torch(platform)
    if expected is None:  # hpu: the vendor image's torch is kept
        assert "CORE_INSTALL_TORCH_VERSION" not in args
        return
    assert args.get("CORE_INSTALL_TORCH_VERSION") == expected, (
        f"{dockerfile} pins torch {args.get('CORE_INSTALL_TORCH_VERSION')}, install.sh {expected}"
    )


def test_no_model_weights_copied(dockerfile):
    for stage in stages(dockerfile):
        for instr, value in stage.instrs:
            if instr not in ("COPY", "ADD"):
                continue
            assert instr == "COPY", f"{dockerfile}: use COPY, not ADD ({value})"
            srcs = [w for w in value.split()[:-1] if not w.startswith("--")]
            weights = [s for s in srcs if s.lower().endswith(WEIGHT_SUFFIXES)]
            assert not weights, f"{dockerfile}: copies model weights into the image: {weights}"


def test_no_secret_looking_args_or_env(dockerfile):
    for stage in stages(dockerfile):
        for instr, value in stage.instrs:
            if instr in ("ARG", "ENV"):
                bad = [k for k in _key_values(instr, value) if SECRET_NAME.search(k)]
                assert not bad, (
                    f"{dockerfile}: {instr} {bad} looks like a secret baked into a layer"
                )


# --- .dockerignore --------------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _ignored(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        rx = _pattern_regex(raw.lstrip("!").strip("/"))
        if any(rx.fullmatch(p) for p in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_sources_and_drops_weights_and_secrets():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    for kept in (
        "pyproject.toml",
        "core/engine.py",
        "platforms/cpu/platform.py",
        "csrc/attention.cu",
        "docker/install.sh",
        "docker/entrypoint.sh",
    ):
        assert not _ignored(patterns, kept), f".dockerignore drops {kept}, which the build needs"
    for dropped in (
        "models/llama/model.safetensors",
        "core/weights/x.gguf",
        ".git/HEAD",
        ".venv/bin/python",
        ".env",
        "core/__pycache__/a.cpython-311.pyc",
        "build/lib/core/x.py",
        "tests/unit/test_x.py",
    ):
        assert _ignored(patterns, dropped), f".dockerignore lets {dropped} into the build context"


# --- entry point and install script behaviour -----------------------------------------------


def _entrypoint(tmp_path: Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    """Run docker/entrypoint.sh with a stand-in `core` that prints its argv, one per line."""
    fake = tmp_path / "bin" / "core"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("CORE_")}
    base["PATH"] = f"{fake.parent}{os.pathsep}{base.get('PATH', '')}"
    return subprocess.run(
        ["sh", str(DOCKER / "entrypoint.sh"), *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_entrypoint_serves_the_model_from_core_model(tmp_path):
    model = tmp_path / "my model.gguf"  # a space, to prove the path stays one argument
    model.write_bytes(b"GGUF")
    r = _entrypoint(
        tmp_path,
        ["core", "serve", "--max-model-len", "64"],
        CORE_MODEL=str(model),
        CORE_PORT="9001",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "serve",
        str(model),
        "--host",
        "0.0.0.0",
        "--port",
        "9001",
        "--max-model-len",
        "64",
    ]


def test_entrypoint_without_core_model_uses_the_embedded_default(tmp_path):
    r = _entrypoint(tmp_path, ["core", "serve"], CORE_MODEL="", CORE_HOST="127.0.0.1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["serve", "--host", "127.0.0.1", "--port", "8000"]


def test_entrypoint_refuses_a_model_path_that_is_not_mounted(tmp_path):
    missing = str(tmp_path / "models" / "absent")
    r = _entrypoint(tmp_path, ["core", "serve"], CORE_MODEL=missing)
    assert r.returncode == 64
    assert missing in r.stderr and "-v " in r.stderr and "/models" in r.stderr
    assert r.stdout == ""


def test_entrypoint_reads_the_api_key_from_a_mounted_secret(tmp_path):
    secret = tmp_path / "api-key"
    secret.write_text("s3cr3t\n")
    r = _entrypoint(
        tmp_path, ["core", "serve", "--port", "9"], CORE_API_KEY_FILE=str(secret), CORE_API_KEY="x"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "serve",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--api-key",
        "s3cr3t",
        "--port",
        "9",
    ]
    r = _entrypoint(tmp_path, ["core", "serve"], CORE_API_KEY_FILE=str(tmp_path / "absent"))
    assert r.returncode == 64 and "CORE_API_KEY_FILE" in r.stderr and r.stdout == ""


def test_entrypoint_runs_other_commands_unchanged(tmp_path):
    r = _entrypoint(tmp_path, ["core", "generate", "hello there"], CORE_MODEL="/nowhere")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["generate", "hello there"]


def test_install_script_rejects_an_unknown_platform():
    r = subprocess.run(
        ["bash", str(DOCKER / "install.sh"), "gpu"], capture_output=True, text=True, timeout=30
    )
    assert r.returncode != 0
    assert "unknown PLATFORM 'gpu'" in r.stderr and "cpu cuda rocm xpu tpu hpu" in r.stderr
