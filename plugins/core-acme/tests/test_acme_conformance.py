"""core's platform conformance suite, run on platform acme inside this test session.

The same checks run from the command line (see README.md)::

    ACME_NPU_EMULATE=1 pytest --core-platform=acme --pyargs core.conformance

Here they are brought into this module as the suite documents (``all_checks()``), with
the ``core_platform`` fixture selecting acme through core's discovery; the suite's own
fixtures come from its pytest plugin when it is registered, else from the imports below.
"""

from __future__ import annotations

import pytest
from acme_testkit import SELECTION_VARS

from core.conformance import all_checks
from core.conformance.plugin import (  # noqa: F401 - fixtures the end-to-end check uses
    conformance_cpu_outputs,
    conformance_model_dir,
    select_platform,
)

globals().update(all_checks())


@pytest.fixture(scope="module")
def core_platform():
    """Platform acme, selected the way the engine selects it (probe must say usable)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ACME_NPU_EMULATE", "1")
        mp.setenv("ACME_NPU_MEMORY", "1GiB")
        for key in SELECTION_VARS:
            mp.delenv(key, raising=False)
        platform = select_platform("acme")
        assert platform.name == "acme"
        yield platform
