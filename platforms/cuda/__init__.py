"""The CUDA platform plugin (entry point ``cuda`` in group ``core.platforms``).

Importing this package is cheap and has no side effects: the kernels are built or loaded
only when an attention backend is created (see :mod:`platforms.cuda.build`).
"""

import core
from platforms.cuda.platform import CudaPlatform

CORE_PLUGIN_API = ">=1.0,<2"


@core.hookimpl
def core_platforms():
    return [CudaPlatform]
