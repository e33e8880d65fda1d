"""The platform conformance suite: one set of checks every platform must pass.

Run it against any installed platform (first-party or a vendor's plugin)::

    pytest --core-platform=NAME --pyargs core.conformance

(for the HPU platform on a host without Gaudi, emulated on CPU tensors:
``CORE_HPU_EMULATE=1 pytest --core-platform=hpu --pyargs core.conformance``).

The pytest plugin (:mod:`core.conformance.plugin`, registered under ``pytest11``) adds the
option, selects the platform through the engine's own discovery path, collects the
checks below and ends the run with a summary naming each check, its outcome, the device
type the tensors lived on and the platform's verification level.

Checks (each compares the platform's attention backend with
:func:`core.attention.reference_attention` on seeded random data, over every supported
dtype and block size, grouped-query and multi-head):

* ``checks_layout``: the declared KV layout and allocation; ``write_kv`` with padding slots;
* ``checks_attention``: prefill, chunked prefill over cached context, decode, mixed
  batches, and all of them under a sliding window;
* ``checks_blocks``: ``copy_blocks`` across layers, ``swap_blocks`` device -> host -> device;
* ``checks_platform``: probe, device facts, dtypes and block sizes, ``validate``;
* ``checks_e2e``: greedy generation through ``core.LLM`` on a tiny random Llama equals the
  CPU platform's tokens.

Tolerances per dtype are in :data:`core.conformance.harness.TOLERANCES`.

A project can also run the checks inside its own test session: define a ``core_platform``
fixture and bring the checks into a test module with ``globals().update(all_checks())``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

CHECK_MODULES = ("layout", "attention", "blocks", "platform", "e2e")


def all_checks() -> dict[str, Callable[..., None]]:
    """Every check function by its ``test_*`` name, in suite order."""
    checks: dict[str, Callable[..., None]] = {}
    for name in CHECK_MODULES:
        module = importlib.import_module(f"core.conformance.checks_{name}")
        checks.update({k: v for k, v in vars(module).items() if k.startswith("test_") and callable(v)})
    return checks
