"""core-extras: the extension points besides platforms, one small example each.

* ``core_model_architectures``: OLMo (``OlmoForCausalLM``), an architecture core lacks;
* ``core_attention_backends``: ``cpu_naive``, a second attention backend for platform cpu
  (``--attention-backend cpu_naive``);
* ``core_op_overrides``: ``rms_norm`` on platform cpu, when ``CORE_EXTRAS_RMS_NORM=1``.

Registered under the ``core.platforms`` entry-point group as ``extras``; it provides no
platform of its own. Importing it changes nothing outside it.
"""

import core
from core_extras import envs
from core_extras.naive_attention import NaiveCpuAttentionBackend
from core_extras.olmo import OlmoForCausalLM
from core_extras.rms_norm import counting_rms_norm

CORE_PLUGIN_API = ">=1.0,<2"


@core.hookimpl
def core_model_architectures():
    return {"OlmoForCausalLM": OlmoForCausalLM}


@core.hookimpl
def core_attention_backends():
    return [("cpu", NaiveCpuAttentionBackend.name, NaiveCpuAttentionBackend)]


@core.hookimpl
def core_op_overrides(platform_name):
    if platform_name != "cpu" or not envs.read().override_rms_norm:
        return {}
    return {"rms_norm": counting_rms_norm()}
