"""Plugin loading and platform selection (pluggy, entry-point group ``core.platforms``).

First-party platforms and third-party plugins take the same path: an entry point names a
module; the module declares ``CORE_PLUGIN_API`` and implements hooks from
:mod:`core.hookspecs`.
"""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass
from typing import Any

import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from core import hookspecs
from core.platform import Platform, ProbeResult, capabilities_in_force
from core.version import PLUGIN_API_VERSION

logger = logging.getLogger(__name__)

_PLUGIN_MODEL_TYPES: set[str] = set()
"""model_type names registered with transformers' AutoConfig by plugins in this process (a
later engine may register a new class object for one of them; transformers' own stay)."""

ENTRY_POINT_GROUP = "core.platforms"


class PluginError(RuntimeError):
    """A plugin could not be loaded, or a platform could not be selected."""


@dataclass(frozen=True)
class PlatformInfo:
    """One discovered platform and what its probe says about this host."""

    name: str
    plugin: str
    cls: type[Platform]
    probe: ProbeResult

    @property
    def capabilities(self) -> frozenset[str]:
        """The capability flags in force on this host (an emulation has none), without
        constructing the platform."""
        return capabilities_in_force(self.cls.capabilities, self.probe)


def check_api_version(plugin: Any, plugin_name: str) -> None:
    """Refuse a plugin whose declared ``CORE_PLUGIN_API`` range excludes ours."""
    declared = getattr(plugin, "CORE_PLUGIN_API", None)
    if declared is None:
        raise PluginError(
            f"plugin {plugin_name!r} does not declare CORE_PLUGIN_API; add e.g. "
            f'CORE_PLUGIN_API = ">={PLUGIN_API_VERSION},<{Version(PLUGIN_API_VERSION).major + 1}"'
            f" to its module (core's plugin API is {PLUGIN_API_VERSION})"
        )
    try:
        spec = SpecifierSet(declared)
    except InvalidSpecifier as e:
        raise PluginError(
            f"plugin {plugin_name!r} declares CORE_PLUGIN_API={declared!r}, which is not a "
            f"PEP 440 specifier such as '>=1.0,<2'"
        ) from e
    if Version(PLUGIN_API_VERSION) not in spec:
        raise PluginError(
            f"plugin {plugin_name!r} supports core plugin API {declared!r}, but this core "
            f"provides plugin API {PLUGIN_API_VERSION}; install a version of the plugin built "
            f"for plugin API {PLUGIN_API_VERSION} (or a core matching {declared!r})"
        )


class Plugins:
    """The loaded plugins and the registries built from their hooks."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("core")
        self.pm.add_hookspecs(hookspecs)
        self.load_errors: dict[str, str] = {}
        """Entry points that failed to import: name -> error (shown by ``core platforms``)."""

    # ---- loading ------------------------------------------------------------------------
    def register(self, plugin: Any, name: str) -> None:
        """Register a plugin object after checking its API version and hook names."""
        check_api_version(plugin, name)
        self.pm.register(plugin, name=name)
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            self.pm.unregister(name=name)
            raise PluginError(f"plugin {name!r} implements an unknown hook: {e}") from e

    def load_entry_points(self, only: tuple[str, ...] = ()) -> None:
        """Load every ``core.platforms`` entry point (or only the named ones).

        A plugin that fails to import is recorded in :attr:`load_errors` and skipped, so one
        broken vendor package cannot take the others down; API-version and hook errors
        are raised, since they mean the installed versions do not fit together.
        """
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if only and ep.name not in only:
                continue
            if self.pm.has_plugin(ep.name):
                continue
            try:
                module = ep.load()
            except Exception as e:  # a broken plugin must not break the others
                self.load_errors[ep.name] = f"{type(e).__name__}: {e}"
                logger.warning("plugin %r failed to import: %s", ep.name, e)
                continue
            self.register(module, ep.name)

    # ---- registries -----------------------------------------------------------------------
    def _collect(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """(plugin name, result) for every implementation of a hook, oldest plugin first.

        Deliberately not ``self.pm.hook.<name>(**kwargs)``: that returns bare results, and
        the registries must name the plugin behind each one to report a conflict (two
        plugins claiming a platform, an op, an architecture). pluggy's own way to call one
        plugin, ``subset_hook_caller``, needs hashable plugin objects, which pluggy does
        not otherwise require. So the implementations pluggy validated at registration
        are called here, with pluggy's argument rule; core.hookspecs tells plugin authors
        the one difference (a defaulted parameter receives the hook argument too)."""
        hook = getattr(self.pm.hook, hook_name)
        out = []
        for impl in hook.get_hookimpls():
            # pluggy's rule: an implementation takes any subset of the hook's arguments.
            names = (*impl.argnames, *impl.kwargnames)
            result = impl.function(**{k: v for k, v in kwargs.items() if k in names})
            if result is not None:
                out.append((impl.plugin_name, result))
        return out

    def platforms(self) -> dict[str, tuple[str, type[Platform]]]:
        """Platform name -> (plugin name, class). Two plugins claiming a name is an error."""
        found: dict[str, tuple[str, type[Platform]]] = {}
        for plugin, classes in self._collect("core_platforms"):
            for cls in classes:
                if cls.name in found:
                    raise PluginError(
                        f"platform name {cls.name!r} is claimed by plugins {found[cls.name][0]!r} "
                        f"and {plugin!r}; uninstall one of them or disable it with "
                        f"CORE_PLUGINS=<comma-separated plugin names to load>"
                    )
                found[cls.name] = (plugin, cls)
        return found

    def model_architectures(self) -> dict[str, Any]:
        """Architecture name -> model class from plugins. A name provided twice (by two
        plugins, or by a plugin and the built-ins) maps to an
        :class:`~core.models.ArchitectureConflict`: loading that model fails with the
        reason, loading any other works (a warning is logged here)."""
        from core.models import ArchitectureConflict, builtin_architectures

        found: dict[str, Any] = {}
        owner: dict[str, str] = {}
        builtin = builtin_architectures()
        for plugin, archs in self._collect("core_model_architectures"):
            for arch, cls in archs.items():
                reason = None
                if arch in builtin:
                    reason = (
                        f"plugin {plugin!r} registers model architecture {arch!r}, which is "
                        "built in; a plugin may only add new architecture names"
                    )
                elif arch in found:
                    reason = (
                        f"model architecture {arch!r} is registered by plugins "
                        f"{owner[arch]!r} and {plugin!r}; only one may provide it"
                    )
                if reason is not None:
                    logger.warning("%s (models of that architecture will not load)", reason)
                    found[arch] = ArchitectureConflict(reason)
                else:
                    found[arch] = cls
                owner.setdefault(arch, plugin)
        return found

    def register_model_configs(self) -> list[str]:
        """Register the plugins' ``core_model_configs`` with ``transformers.AutoConfig``
        (process-wide; registering the same class again is a no-op). Returns the
        ``model_type`` names registered; refused ones are logged with the reason."""
        from transformers import AutoConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        offered: dict[str, list[tuple[str, type]]] = {}
        for plugin, configs in self._collect("core_model_configs"):
            for model_type, cls in configs.items():
                offered.setdefault(model_type, []).append((plugin, cls))
        done = []
        for model_type, owners in offered.items():
            names = [p for p, _ in owners]
            cls = owners[0][1]
            known = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
            if len(owners) > 1:
                logger.warning(
                    "model_type %r is provided by plugins %s; only one may provide it, so "
                    "none is registered", model_type, names,
                )
            elif getattr(cls, "model_type", None) != model_type:
                logger.warning(
                    "plugin %r maps model_type %r to %s, whose model_type is %r; not registered",
                    names[0], model_type, cls.__name__, getattr(cls, "model_type", None),
                )
            elif known is not None and known is not cls and model_type not in _PLUGIN_MODEL_TYPES:
                logger.warning(
                    "plugin %r provides model_type %r, which transformers already knows "
                    "(%s); not registered", names[0], model_type, known.__name__,
                )
            else:
                if known is not cls:  # new, or a plugin's class for it changed (a reload)
                    AutoConfig.register(model_type, cls, exist_ok=True)
                    _PLUGIN_MODEL_TYPES.add(model_type)
                done.append(model_type)
        return done

    def attention_backends(self, platform_name: str) -> dict[str, type]:
        """Backend name -> class, for the extra backends plugins add to ``platform_name``."""
        found: dict[str, type] = {}
        for plugin, triples in self._collect("core_attention_backends"):
            for pname, bname, cls in triples:
                if pname != platform_name:
                    continue
                if bname in found:
                    raise PluginError(
                        f"attention backend {bname!r} for platform {pname!r} is registered "
                        f"twice (second time by plugin {plugin!r})"
                    )
                found[bname] = cls
        return found

    def quantization_methods(self) -> dict[str, type]:
        """Method name -> QuantizationMethod class, for the methods plugins add. Two plugins
        naming one method is an error."""
        found: dict[str, tuple[str, type]] = {}
        for plugin, classes in self._collect("core_quantization_methods"):
            for cls in classes:
                if cls.name in found:
                    raise PluginError(
                        f"quantization method {cls.name!r} is registered by plugins "
                        f"{found[cls.name][0]!r} and {plugin!r}; only one may provide it"
                    )
                found[cls.name] = (plugin, cls)
        return {name: cls for name, (_, cls) in found.items()}

    def op_overrides(self, platform_name: str, config: Any = None) -> dict[str, Any]:
        """Op name -> callable overriding that op on ``platform_name`` for an engine of
        ``config`` (an EngineConfig)."""
        found: dict[str, Any] = {}
        owner: dict[str, str] = {}
        collected = self._collect("core_op_overrides", platform_name=platform_name, config=config)
        for plugin, ops in collected:
            for op, fn in ops.items():
                if op in found:
                    raise PluginError(
                        f"op {op!r} on platform {platform_name!r} is overridden by both "
                        f"{owner[op]!r} and {plugin!r}; only one plugin may override an op"
                    )
                found[op], owner[op] = fn, plugin
        return found

    # ---- selection ----------------------------------------------------------------------
    def discover(self) -> list[PlatformInfo]:
        """Every platform with its probe result, best score first."""
        infos = []
        for name, (plugin, cls) in self.platforms().items():
            try:
                probe = cls.probe()
            except Exception as e:  # a probe must not raise; treat it as unusable
                probe = ProbeResult(0, f"probe raised {type(e).__name__}: {e}")
            infos.append(PlatformInfo(name, plugin, cls, probe))
        return sorted(infos, key=lambda i: (-i.probe.score, i.name))

    def select(self, requested: str | None) -> PlatformInfo:
        """The platform to run on: ``requested`` if given (an emulation too), else the
        highest probe score among the platforms that are not emulations
        (``ProbeResult.emulated``); a tie at the top is an error."""
        infos = self.discover()
        listing = _listing(infos, self.load_errors)
        if requested:
            match = [i for i in infos if i.name == requested]
            if not match:
                raise PluginError(
                    f"unknown platform {requested!r}. Found: {listing}. Install the plugin "
                    f"that provides it (e.g. pip install 'core[{requested}]') or pick one of "
                    f"the found names with --platform"
                )
            if match[0].probe.score <= 0:
                raise PluginError(
                    f"platform {requested!r} is not usable on this host: "
                    f"{match[0].probe.reason}. Found: {listing}"
                )
            return match[0]
        usable = [i for i in infos if i.probe.score > 0 and not i.probe.emulated]
        if not usable:
            asked = [i.name for i in infos if i.probe.score > 0]
            hint = (
                f"; {', '.join(asked)} run only when named: --platform NAME" if asked else ""
            )
            raise PluginError(
                f"no usable platform found. Found: {listing or 'none'}{hint}. Install one, "
                f"e.g. pip install 'core[cpu]'"
            )
        best = [i for i in usable if i.probe.score == usable[0].probe.score]
        if len(best) > 1:
            names = ", ".join(i.name for i in best)
            raise PluginError(
                f"platforms {names} tie with probe score {best[0].probe.score}; choose one with "
                f"--platform NAME (or CORE_PLATFORM=NAME)"
            )
        return best[0]


def _listing(infos: list[PlatformInfo], errors: dict[str, str]) -> str:
    parts = [
        f"{i.name} (score {i.probe.score}{', emulation' if i.probe.emulated else ''}: "
        f"{i.probe.reason})"
        for i in infos
    ]
    parts += [f"{name} (failed to load: {err})" for name, err in errors.items()]
    return "; ".join(parts)


def load_plugins(no_autoload: bool = False, only: tuple[str, ...] = ()) -> Plugins:
    """Plugins as configured by the environment (see :mod:`core.envs`)."""
    plugins = Plugins()
    if not no_autoload:
        plugins.load_entry_points(only)
    return plugins
