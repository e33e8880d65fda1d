"""The plugin hooks of ``core``: the whole surface a platform or vendor plugin may implement.

A plugin is a module (or object) registered under the ``core.platforms`` entry-point
group. It must declare ``CORE_PLUGIN_API`` — a PEP 440 specifier of the plugin API versions
it supports, e.g. ``">=1.0,<2"`` (see :data:`core.version.PLUGIN_API_VERSION`) — and may
implement any of the hooks below with ``@core.hookimpl``. Hooks are called with keyword
arguments; a hookimpl whose name is not listed here is refused at load.

Hooks are grouped by when they are called:

* discovery (once, when the plugin manager loads): ``core_platforms``,
  ``core_model_architectures``, ``core_model_configs``, ``core_attention_backends``,
  ``core_quantization_methods``;
* engine construction (once per engine, after a platform is chosen): ``core_op_overrides``.

How core calls them (one deviation from a plain pluggy hook call): every hook is a
"collect all" hook, and core needs to know which plugin returned what, to name both plugins
when two claim one platform, op or architecture. So :class:`core.plugins.Plugins` calls
each implementation that pluggy validated at registration itself, oldest plugin first,
rather than through ``pm.hook.<name>(...)``. For an author this changes two things only:
an implementation that returns ``None`` contributes nothing (as in pluggy), and a
parameter with a default value *is* passed the hook argument of that name (pluggy would
leave it at its default). pluggy's ``hookwrapper``/``wrapper`` and ``tryfirst``/
``trylast`` options have no effect on these hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from core.attention import AttentionBackend
    from core.config import EngineConfig
    from core.platform import Platform
    from core.quantization import QuantizationMethod

hookspec = pluggy.HookspecMarker("core")


# ---- discovery ------------------------------------------------------------------------
@hookspec
def core_platforms() -> list[type[Platform]]:
    """Platforms this plugin provides.

    :return: Platform subclasses (not instances). Names must be unique across all loaded
        plugins; a second plugin claiming a taken name is refused at load.
    """


@hookspec
def core_model_architectures() -> dict[str, Any]:
    """Model architectures this plugin adds.

    :return: mapping from an HF ``architectures`` name (e.g. ``"LlamaForCausalLM"``) to a
        model class following the contract in :mod:`core.models` (constructor
        ``(hf_config, ctx)``, ``forward``, ``load_weights``). A name already registered by
        another plugin or by core is refused.
    """


@hookspec
def core_model_configs() -> dict[str, type]:
    """Config classes for checkpoints whose ``config.json`` names a ``model_type`` that
    ``transformers`` does not know (plugin API 1.1).

    :return: mapping from a ``model_type`` to a ``transformers.PretrainedConfig`` subclass
        whose ``model_type`` attribute is that name. core registers each with
        ``transformers.AutoConfig`` before it reads a checkpoint's config. A ``model_type``
        transformers already knows, or that two plugins provide, is not registered (a
        warning names it); the other plugins' entries still are.
    """


@hookspec
def core_attention_backends() -> list[tuple[str, str, type[AttentionBackend]]]:
    """Extra attention backends for existing platforms.

    :return: ``(platform_name, backend_name, backend_class)`` triples. Users select one
        with ``--attention-backend backend_name``; the platform's default is unchanged.
    """


@hookspec
def core_quantization_methods() -> list[type[QuantizationMethod]]:
    """Quantization methods (checkpoint formats of quantized weights) this plugin adds.

    :return: :class:`core.quantization.QuantizationMethod` subclasses. Each ``name`` is a new
        ``--quantization`` value and ``quant_method`` of config.json; a built-in name is
        ignored (with a warning), one two plugins claim is refused. The method's
        ``linear_method(platform, dtype)`` says how its weights run on a platform (default:
        what :meth:`core.platform.Platform.quantization_methods` maps its name to).
    """


# ---- engine construction --------------------------------------------------------------
@hookspec
def core_op_overrides(platform_name: str, config: EngineConfig) -> dict[str, Any]:
    """Replace individual ops on one platform.

    Called once per engine with the chosen platform's name. Return ``{}`` for platforms
    the plugin does not target. An implementation may take only ``platform_name``.

    :param platform_name: the selected platform (e.g. ``"cpu"``).
    :param config: the engine's resolved configuration (model, dtype, weight format,
        scheduler, parallelism: every CLI flag), so an override can apply itself only where
        it fits (plugin API 1.1).
    :return: mapping from an op name in :data:`core.ops.DEFAULT_OPS` to a callable with
        the same signature. Overrides win over the platform's own ops; two plugins
        overriding the same op is an error.
    """
