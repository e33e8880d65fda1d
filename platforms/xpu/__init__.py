"""The Intel XPU platform plugin (entry point ``xpu`` in group ``core.platforms``).

Importing this package imports neither intel_extension_for_pytorch nor touches a device:
IPEX is imported when an attention backend is built, after the platform was chosen.
"""

import core
from platforms.xpu.platform import XpuPlatform

CORE_PLUGIN_API = ">=1.0,<2"


@core.hookimpl
def core_platforms():
    return [XpuPlatform]
