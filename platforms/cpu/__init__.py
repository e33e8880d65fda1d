"""The CPU platform plugin (entry point ``cpu`` in group ``core.platforms``)."""

import core
from platforms.cpu.platform import CpuPlatform

CORE_PLUGIN_API = ">=1.0,<2"


@core.hookimpl
def core_platforms():
    return [CpuPlatform]
