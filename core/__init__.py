"""core: an LLM inference and serving engine with pluggable hardware platforms."""

import pluggy

from core.version import PLUGIN_API_VERSION, __version__

hookimpl = pluggy.HookimplMarker("core")
"""Marker for plugin hook implementations: ``@core.hookimpl def core_platforms(): ...``."""

__all__ = ["LLM", "SamplingParams", "hookimpl", "__version__", "PLUGIN_API_VERSION"]


def __getattr__(name: str):
    # Lazy so that importing ``core`` (e.g. by a plugin for ``hookimpl``) stays cheap.
    if name == "LLM":
        from core.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'core' has no attribute {name!r}")
