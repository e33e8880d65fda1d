"""Every environment variable the product reads, read here and nowhere else.

Entry points call :func:`read` once and pass the values on; nothing below the entry
point looks at ``os.environ``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Env:
    platform: str | None
    """CORE_PLATFORM: platform name to use (same as ``--platform``)."""
    no_plugin_autoload: bool
    """CORE_NO_PLUGIN_AUTOLOAD=1: load no ``core.platforms`` entry points."""
    plugins: tuple[str, ...]
    """CORE_PLUGINS: comma-separated entry-point names to load (others are skipped)."""
    log_level: str
    """CORE_LOG_LEVEL: logging level of the ``core`` logger (default INFO)."""
    num_threads: int | None
    """CORE_NUM_THREADS: torch intra-op threads on the CPU platform."""
    cache_dir: str | None
    """CORE_CACHE_DIR: where derived files (e.g. a GGUF's config and tokenizer) are kept;
    default ~/.cache/core; set to an empty string to disable caching."""


def read(environ: dict[str, str] | None = None) -> Env:
    e = os.environ if environ is None else environ
    plugins = tuple(p.strip() for p in e.get("CORE_PLUGINS", "").split(",") if p.strip())
    threads = e.get("CORE_NUM_THREADS")
    return Env(
        platform=e.get("CORE_PLATFORM") or None,
        no_plugin_autoload=e.get("CORE_NO_PLUGIN_AUTOLOAD", "") not in ("", "0", "false"),
        plugins=plugins,
        log_level=e.get("CORE_LOG_LEVEL", "INFO"),
        num_threads=int(threads) if threads else None,
        cache_dir=_cache_dir(e),
    )


def _cache_dir(e) -> str | None:
    if "CORE_CACHE_DIR" in e:
        return e["CORE_CACHE_DIR"] or None
    base = e.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "core")
