"""Attention call sites: the seam where a graph strategy can take over each layer's
attention call.

Where the runner may replay steps from graphs, every layer's attention backend reaches the
model wrapped in an :class:`AttentionSite`. It forwards each call unchanged, unless a
platform's graph strategy has set its ``split`` hook: piecewise capture (platforms/cuda)
uses that to end a graph before each attention call and start the next after it, so that
steps whose attention cannot be captured (prompts of any lengths) still replay everything
around it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from core.attention import AttentionBackend, AttentionMetadata

SplitHook = Callable[
    ["AttentionSite", torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata],
    torch.Tensor,
]
"""``split(site, query, key, value, kv_cache, metadata) -> output`` in place of the call."""


class AttentionSite:
    """One layer's attention backend as the model sees it (see the module docstring)."""

    def __init__(self, backend: AttentionBackend):
        self.backend = backend
        self.split: SplitHook | None = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if self.split is not None:
            return self.split(self, query, key, value, kv_cache, metadata)
        return self.backend.forward(query, key, value, kv_cache, metadata)

    def __getattr__(self, name: str):
        # Anything else a model reads of its backend (spec, name, ...) is the backend's.
        if name in ("backend", "split"):
            raise AttributeError(name)
        return getattr(self.backend, name)
