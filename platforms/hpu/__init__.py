"""The HPU (Intel Gaudi) platform plugin (entry point ``hpu`` in group ``core.platforms``).

Install with ``pip install 'core[hpu]'`` plus Intel's ``habana_frameworks`` (not on PyPI; it
comes with the Gaudi software stack). Without it the plugin still loads, and its probe says
"habana_frameworks not installed" (score 0: never selected).

Running on a host without Gaudi (verification only): set ``CORE_HPU_EMULATE=1``. The
platform's attention and cache ops then run on CPU tensors, and ``--platform hpu`` selects
it; the conformance suite runs against it with::

    CORE_HPU_EMULATE=1 pytest --core-platform=hpu --pyargs core.conformance

The attention is written with plain torch ops (index_select + matmul) and pads every
dynamic size to buckets so HPU graphs see a bounded set of shapes; see
:mod:`platforms.hpu.buckets` for the policy.
"""

import core
from platforms.hpu.platform import EMULATE_ENV, HpuPlatform

CORE_PLUGIN_API = ">=1.0,<2"

__all__ = ["EMULATE_ENV", "HpuPlatform", "core_platforms"]


@core.hookimpl
def core_platforms():
    return [HpuPlatform]
