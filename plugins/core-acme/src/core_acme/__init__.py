"""core-acme: the Acme NPU platform plugin for ``core``.

Registered under the ``core.platforms`` entry-point group as ``acme`` (see this
distribution's pyproject.toml); ``core`` loads this module, checks
:data:`CORE_PLUGIN_API` against its own plugin API version, and calls the hooks below.
Importing it changes nothing outside it.
"""

import core
from core_acme.platform import AcmePlatform

CORE_PLUGIN_API = ">=1.0,<2"
"""Plugin API versions this plugin works with: any 1.x (minor bumps only add)."""

__all__ = ["AcmePlatform", "CORE_PLUGIN_API", "core_platforms"]


@core.hookimpl
def core_platforms():
    return [AcmePlatform]
