"""The ROCm platform plugin (entry point ``rocm`` in group ``core.platforms``).

Importing this package is cheap and has no side effects: csrc/ is hipified and compiled (or
the prebuilt extension imported) only when an attention backend is created (see
:mod:`platforms.rocm.build`).
"""

import core
from platforms.rocm.platform import RocmPlatform

CORE_PLUGIN_API = ">=1.0,<2"


@core.hookimpl
def core_platforms():
    return [RocmPlatform]
