"""The TPU platform plugin (entry point ``tpu`` in group ``core.platforms``).

Importing this package imports no torch_xla: that happens once the platform is chosen.
"""

import core
from platforms.tpu.platform import TpuPlatform

CORE_PLUGIN_API = ">=1.0,<2"


@core.hookimpl
def core_platforms():
    return [TpuPlatform]
