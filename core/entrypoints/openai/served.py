"""What the server serves under which names: ``--served-model-name`` (one or more) and the
sampling defaults of ``--generation-config`` (``generation_config.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.entrypoints.openai.errors import clip
from core.entrypoints.openai.generation_config import GenerationDefaults


@dataclass(frozen=True)
class ServedModel:
    names: tuple[str, ...]
    """Every name a client may send as ``model``. A response carries the name its request
    sent (:meth:`answer_name`); the first one answers requests that send none and labels the
    metrics (as vLLM uses its first served name)."""
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)

    def __post_init__(self) -> None:
        if not self.names or any(not n.strip() for n in self.names):
            raise ValueError(f"--served-model-name {list(self.names)!r}: every name must be non-empty")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"--served-model-name {list(self.names)!r} names a model twice; list each once")

    @property
    def primary(self) -> str:
        return self.names[0]

    def answer_name(self, requested: str | None) -> str:
        """The ``model`` a response carries: the alias the client sent (so a client that
        routes by name sees its own), or the first name when it sent none. ``requested``
        has passed :meth:`ServerContext.check_model`, so it is one of :attr:`names`."""
        return requested if requested in self.names else self.primary

    def shown(self) -> str:
        """The names for an error message (quoted, clipped)."""
        return ", ".join(repr(clip(n, 60)) for n in self.names[:8]) + (" ..." if len(self.names) > 8 else "")

    def with_defaults(self, req: Any, max_tokens: int | None) -> tuple[Any, int | None]:
        """``req`` with the generation-config defaults it left out, and its max_tokens."""
        return self.defaults.apply(req), self.defaults.max_tokens_for(req, max_tokens)


def default_served_name(model_path: str) -> str:
    """The model's file stem (a .gguf) or directory name: never the full path."""
    p = Path(model_path)
    return p.stem if p.suffix == ".gguf" else p.name
