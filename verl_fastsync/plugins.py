"""The plugin manager and the registry it feeds: one of each per process.

Build order (as tox and pluggy's own example do): specs -> block list -> third-party entry points of
group ``verl_fastsync`` -> built-ins registered as internal plugins -> ``check_pending()``, so a
misspelled hook implementation fails loudly instead of being ignored.

Then every hook of every plugin is called once, per plugin, and the ``{name: implementation}``
mappings are merged into a :class:`Registry`:

* a built-in name provided by a third party is *replaced* (allowed; :attr:`Provided.replaced` keeps
  what was replaced, doctor shows it, and building the registry logs one warning per replaced name,
  once per process);
* one name provided by two third-party plugins is a :class:`PluginConflictError` naming both
  distributions (no silent shadowing by install order);
* so is one *plugin* (entry-point) name claimed by two distributions, and an entry point named like a
  built-in plugin (:data:`BUILTIN_PLUGINS`): pluggy keeps one plugin per name, so either would drop
  one of them silently, by ``sys.path`` order. The same distribution seen twice is loaded once;
* every returned object is type-checked once, here, at start;
* a plugin written for the 0.1 hook shape (appending to ``available``) fails with a
  :class:`PluginShapeError` that says how to migrate.

The block list is the union of the ``disabled_plugins`` the caller passes (from the config) and the
environment variable :data:`ENV_DISABLED` (``VERL_FASTSYNC_DISABLED_PLUGINS``, comma-separated), which
reaches every verl process - checkpoint-engine workers and vLLM workers never see the config.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

from verl_fastsync import NAME, __version__, hookspecs

if TYPE_CHECKING:
    from verl_fastsync.cleanup import CleanupPolicy
    from verl_fastsync.transports.base import TransportFactory

logger = logging.getLogger(__name__)

BUILTIN_CLEANUP = "fastsync-cleanup"
BUILTIN_TRANSPORTS = "fastsync-transports"
BUILTIN_PLUGINS = (BUILTIN_CLEANUP, BUILTIN_TRANSPORTS)
BUILTIN_DISTRIBUTION = f"verl-fastsync {__version__}"

HOOKS = ("pre_resume_cleanup", "post_transfer_cleanup", "weight_transport")
BOUNDARIES = ("pre_resume_cleanup", "post_transfer_cleanup")
TRANSPORT_KINDS = ("engine", "colocated")

ENV_DISABLED = "VERL_FASTSYNC_DISABLED_PLUGINS"
"""Comma-separated plugin names blocked in every process that reads it (each Ray actor and vLLM worker
when set through ``+ray_kwargs.ray_init.runtime_env.env_vars``)."""

# the argument names of the 0.1 hook shape; an implementation that takes one of them was not migrated
_OLD_ARGS = frozenset({"available", "policy", "name"})


class UnknownPluginNameError(ValueError):
    """A policy or transport name that no registered plugin provides (the message lists them)."""


class PluginHookError(RuntimeError):
    """A plugin's hook implementation raised or returned something invalid; the message names it."""


class PluginConflictError(PluginHookError):
    """Two third-party distributions provide the same name for the same hook, or claim the same
    plugin (entry-point) name, or a third-party entry point is named like a built-in plugin."""


class PluginShapeError(PluginHookError):
    """A plugin implements a hook in the 0.1 shape (``available`` argument)."""


@dataclasses.dataclass(frozen=True)
class Provided:
    """One name of one hook (and kind), the plugin that provides it, and what it replaced."""

    name: str
    implementation: Any
    plugin: str
    distribution: str
    replaced: Provided | None = None

    @property
    def builtin(self) -> bool:
        return self.plugin in BUILTIN_PLUGINS


def blocked_from_env(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The block list in :data:`ENV_DISABLED` (empty entries ignored)."""
    raw = (os.environ if environ is None else environ).get(ENV_DISABLED, "")
    return tuple(dict.fromkeys(part.strip() for part in raw.split(",") if part.strip()))


def _entry_points() -> list[Any]:
    from importlib.metadata import entry_points

    return list(entry_points(group=NAME))


def _distribution_of(ep: Any) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return f"entry point {ep.name} = {ep.value}"
    return f"{dist.metadata['Name']} {dist.version}"


def _identity(ep: Any) -> tuple[str, str]:
    """What makes two entry points of one name the same plugin: its distribution's (normalized)
    name, and what the entry point loads."""
    dist = getattr(ep, "dist", None)
    name = "" if dist is None else str(dist.metadata["Name"]).lower().replace("_", "-").replace(".", "-")
    return name, str(ep.value)


def _check_claim(ep: Any, claimed: dict[str, Any]) -> bool:
    """Whether ``ep`` is a new plugin name (True), the same distribution's entry point seen again (False:
    skip it), or raise :class:`PluginConflictError` for a name that is a built-in's or another
    distribution's."""
    if ep.name in BUILTIN_PLUGINS:
        raise PluginConflictError(
            f"verl-fastsync plugin entry point {ep.name!r} ({_distribution_of(ep)}) is named like the "
            f"built-in plugin {ep.name!r} ({BUILTIN_DISTRIBUTION}), and only one plugin can hold a name; "
            f"rename the entry point (e.g. to a name of its own distribution) or uninstall it. To replace "
            f"a built-in policy or transport, a plugin of any other name returns the built-in's name"
        )
    first = claimed.get(ep.name)
    if first is None:
        claimed[ep.name] = ep
        return True
    if _identity(first) == _identity(ep):
        return False  # one distribution found twice on sys.path (a re-install): loaded once
    raise PluginConflictError(
        f"the verl-fastsync plugin name {ep.name!r} is claimed by two distributions: "
        f"{_distribution_of(first)} ({first.value}) and {_distribution_of(ep)} ({ep.value}); only one "
        f"plugin can hold a name, and which one would depend on sys.path order: uninstall one, or "
        f"rename one's entry point ({ENV_DISABLED}={ep.name} blocks both)"
    )


def _check_shape(plugin: Any, plugin_name: str, distribution: str) -> None:
    for hook in HOOKS:
        function = getattr(plugin, hook, None)
        code = getattr(function, "__code__", None)
        if code is None:
            continue
        args = set(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])
        if args & _OLD_ARGS:
            new = "kind" if hook == "weight_transport" else ""
            old = ", ".join(code.co_varnames[: code.co_argcount])
            raise PluginShapeError(
                f"verl-fastsync plugin {plugin_name!r} ({distribution}) implements {hook}({old}): the 0.1 "
                f"hook shape. Since verl-fastsync 0.2.0 a hook takes ({new}) and returns what the plugin "
                f"provides as {{name: implementation}}, e.g. `def {hook}({new}): return {{'mine': my_impl}}` "
                f"instead of appending to `available`; update the plugin, or block it with "
                f"{ENV_DISABLED}={plugin_name}"
            )


def _register_builtins(pm: pluggy.PluginManager) -> None:
    from verl_fastsync import cleanup, transports

    for name, module in ((BUILTIN_CLEANUP, cleanup), (BUILTIN_TRANSPORTS, transports)):
        if not pm.is_blocked(name):
            pm.register(module, name=name)


_DISTRIBUTIONS_ATTR = "_verl_fastsync_distributions"


def get_plugin_manager(blocked: Iterable[str] = ()) -> pluggy.PluginManager:
    """Build a plugin manager (never pickled or shared across processes).

    :param blocked: plugin names to leave out (entry-point names, or :data:`BUILTIN_PLUGINS`), in
        addition to :data:`ENV_DISABLED`.
    """
    pm = pluggy.PluginManager(NAME)
    pm.add_hookspecs(hookspecs)
    for name in (*blocked, *blocked_from_env()):
        pm.set_blocked(name)
    distributions: dict[str, str] = {name: BUILTIN_DISTRIBUTION for name in BUILTIN_PLUGINS}
    claimed: dict[str, Any] = {}
    for ep in _entry_points():
        if pm.is_blocked(ep.name):  # blocked: nothing of that name loads, whoever claims it
            continue
        if not _check_claim(ep, claimed):
            continue
        distribution = _distribution_of(ep)
        try:
            plugin = ep.load()
        except Exception as exc:
            raise PluginHookError(
                f"verl-fastsync plugin {ep.name!r} ({distribution}) cannot be imported: {exc!r}; "
                f"fix or uninstall it, or block it with {ENV_DISABLED}={ep.name}"
            ) from exc
        _check_shape(plugin, ep.name, distribution)
        try:
            pm.register(plugin, name=ep.name)
        except pluggy.PluginValidationError as exc:
            raise PluginHookError(
                f"verl-fastsync plugin {ep.name!r} ({distribution}) is invalid: {exc}"
            ) from exc
        distributions[ep.name] = distribution
    _register_builtins(pm)
    pm.check_pending()
    setattr(pm, _DISTRIBUTIONS_ATTR, distributions)
    return pm


class Registry:
    """The merged ``{name: implementation}`` of every hook (and transport kind) of one manager."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self.distributions: dict[str, str] = dict(getattr(pm, _DISTRIBUTIONS_ATTR, {}))
        self.cleanup: dict[str, dict[str, Provided]] = {
            b: self._merge(b, {}, _check_cleanup) for b in BOUNDARIES
        }
        self.transports: dict[str, dict[str, Provided]] = {
            kind: self._merge("weight_transport", {"kind": kind}, _TRANSPORT_CHECKS[kind])
            for kind in TRANSPORT_KINDS
        }
        self._show_replaced()

    def _show_replaced(self) -> None:
        """One warning per built-in name a third party replaced (once per process, see :func:`reset`)."""
        tables = [(f"{b}()", self.cleanup[b]) for b in BOUNDARIES]
        tables += [(f"weight_transport(kind={kind!r})", self.transports[kind]) for kind in TRANSPORT_KINDS]
        for hook, table in tables:
            for new in table.values():
                old, key = new.replaced, (hook, new.name, new.plugin, new.distribution)
                with _SHOWN_LOCK:
                    if old is None or key in _SHOWN:
                        continue
                    _SHOWN.add(key)
                logger.warning(
                    "verl-fastsync: %s: the built-in name %r (plugin %r, %s) is replaced by plugin %r (%s)",
                    *(hook, new.name, old.plugin, old.distribution, new.plugin, new.distribution),
                )

    def distribution(self, plugin: str) -> str:
        return self.distributions.get(plugin, f"plugin {plugin!r} registered directly")

    def _call_one(self, hook_name: str, plugin: Any, plugin_name: str, kwargs: dict[str, Any]) -> Any:
        others = [p for p in self.pm.get_plugins() if p is not plugin]
        caller = self.pm.subset_hook_caller(hook_name, remove_plugins=others)
        try:
            results = caller(**kwargs)
        except PluginHookError:
            raise
        except Exception as exc:
            raise PluginHookError(
                f"verl-fastsync plugin {plugin_name!r} ({self.distribution(plugin_name)}) raised in hook "
                f"{hook_name}: {exc!r}"
            ) from exc
        return results[0] if results else None

    def _merge(
        self, hook_name: str, kwargs: dict[str, Any], check: Callable[[Any], str | None]
    ) -> dict[str, Provided]:
        what = hook_name + (f"(kind={kwargs['kind']!r})" if kwargs else "()")
        merged: dict[str, Provided] = {}
        # built-ins first, then the others in registration order, so replacing is well defined
        impls = getattr(self.pm.hook, hook_name).get_hookimpls()
        ordered = sorted(impls, key=lambda impl: impl.plugin_name not in BUILTIN_PLUGINS)
        for impl in ordered:
            plugin_name = impl.plugin_name
            result = self._call_one(hook_name, impl.plugin, plugin_name, kwargs)
            if result is None:
                continue
            where = f"verl-fastsync plugin {plugin_name!r} ({self.distribution(plugin_name)})"
            if not isinstance(result, Mapping):
                raise PluginHookError(
                    f"{where} returned {result!r} from {what}; a hook returns {{name: implementation}} "
                    f"(or None for nothing)"
                )
            for name, implementation in result.items():
                if not isinstance(name, str) or not name.strip() or name != name.strip():
                    raise PluginHookError(
                        f"{where} returned the name {name!r} from {what}; names are "
                        "non-empty strings without surrounding blanks"
                    )
                problem = check(implementation)
                if problem is not None:
                    raise PluginHookError(
                        f"{where} returned {name!r}: {implementation!r} from {what}, which is not {problem}"
                    )
                current = merged.get(name)
                if current is not None and not current.builtin:
                    raise PluginConflictError(
                        f"{what}: the name {name!r} is provided by two plugins: {current.plugin!r} "
                        f"({current.distribution}) and {plugin_name!r} ({self.distribution(plugin_name)}); "
                        f"uninstall one, or block one with {ENV_DISABLED} or custom.fastsync.disabled_plugins"
                    )
                merged[name] = Provided(
                    name, implementation, plugin_name, self.distribution(plugin_name), replaced=current
                )
        return dict(sorted(merged.items()))

    # -- selection -------------------------------------------------------------------------------

    def cleanup_policy(self, boundary: str, policy: str, key: str | None = None) -> CleanupPolicy:
        """The cleanup policy named ``policy`` at ``boundary`` (one of :data:`BOUNDARIES`)."""
        if boundary not in BOUNDARIES:
            raise ValueError(f"unknown cleanup boundary {boundary!r}; allowed: {', '.join(BOUNDARIES)}")
        entry = self.cleanup[boundary].get(policy)
        if entry is None:
            raise self._unknown("cleanup policy", key or f"custom.fastsync.{boundary}", policy, boundary)
        implementation: CleanupPolicy = entry.implementation
        return implementation

    def transport(self, kind: str, name: str, key: str | None = None) -> TransportFactory:
        """The transport factory named ``name`` for ``kind`` (one of :data:`TRANSPORT_KINDS`)."""
        if kind not in TRANSPORT_KINDS:
            raise ValueError(f"unknown transport kind {kind!r}; allowed: {', '.join(TRANSPORT_KINDS)}")
        entry = self.transports[kind].get(name)
        if entry is None:
            raise self._unknown(f"{kind} transport", key or "transport", name, kind)
        implementation: TransportFactory = entry.implementation
        return implementation

    def _unknown(self, what: str, key: str, value: str, table: str) -> UnknownPluginNameError:
        names = list(self.cleanup[table] if table in self.cleanup else self.transports[table])
        text = ", ".join(names) or "(none registered)"
        blocked = sorted(self.blocked())
        suffix = f" (blocked by disabled_plugins: {', '.join(blocked)})" if blocked else ""
        provider = self.blocked_provider(table, value)
        if provider is not None:
            return UnknownPluginNameError(
                f"{key}={value!r}: {what} blocked by disabled_plugins (provided by plugin "
                f"{provider.plugin!r}, {provider.distribution}); available: {text}{suffix}"
            )
        return UnknownPluginNameError(f"{key}={value!r}: unknown {what}; available: {text}{suffix}")

    def blocked_provider(self, table: str, name: str) -> Provided | None:
        """The blocked plugin that would provide ``name`` for ``table`` (a boundary or a transport
        kind), or None. Blocked plugins are loaded and asked here only, never registered."""
        hook_name, kwargs = (table, {}) if table in BOUNDARIES else ("weight_transport", {"kind": table})
        for plugin_name in sorted(self.blocked()):
            try:
                plugin, distribution = _load_plugin(plugin_name)
                provided = getattr(plugin, hook_name, lambda **_: None)(**kwargs)
            except Exception:  # a blocked plugin that cannot even be asked provides nothing
                continue
            if isinstance(provided, Mapping) and name in provided:
                return Provided(name, provided[name], plugin_name, distribution)
        return None

    def blocked(self) -> set[str]:
        """The plugin names blocked in this manager."""
        names = {name for name in (*self.distributions, *BUILTIN_PLUGINS) if self.pm.is_blocked(name)}
        names.update(blocked_from_env())
        return names


def _load_plugin(plugin_name: str) -> tuple[Any, str]:
    """The plugin object named ``plugin_name`` (a built-in or an entry point) and its distribution."""
    if plugin_name in BUILTIN_PLUGINS:
        from verl_fastsync import cleanup, transports

        return (cleanup if plugin_name == BUILTIN_CLEANUP else transports), BUILTIN_DISTRIBUTION
    for ep in _entry_points():
        if ep.name == plugin_name:
            return ep.load(), _distribution_of(ep)
    raise LookupError(f"no verl-fastsync plugin named {plugin_name!r} is installed")


def _check_cleanup(obj: Any) -> str | None:
    return None if callable(obj) else "a callable (CleanupContext) -> CleanupOutcome"


def _check_engine(obj: Any) -> str | None:
    if callable(obj) and callable(getattr(obj, "build_topology", None)):
        options = getattr(obj, "engine_options", None)
        if options is None or (
            isinstance(options, Mapping)
            and all(callable(v) and isinstance(k, str) for k, v in options.items())
        ):
            return None
        return "an engine transport factory whose engine_options is a mapping key -> validator(key, value)"
    return "an engine transport factory: callable (options) -> EngineTransport with build_topology()"


def _check_colocated(obj: Any) -> str | None:
    return None if callable(obj) else "a colocated transport factory: callable (**kwargs) -> SlotMemory"


_TRANSPORT_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "engine": _check_engine,
    "colocated": _check_colocated,
}


# -- one manager and one registry per process --------------------------------------------------

_LOCK = threading.Lock()
_PROCESS: dict[tuple[str, ...], Registry] = {}
_BY_MANAGER: dict[int, Registry] = {}
_SHOWN: set[tuple[str, str, str, str]] = set()
"""The replaced built-in names already logged in this process (hook, name, plugin, distribution)."""
_SHOWN_LOCK = threading.Lock()  # not _LOCK: a registry is built while registry() holds that one


def registry(blocked: Iterable[str] = ()) -> Registry:
    """This process's registry for the block list ``blocked`` + :data:`ENV_DISABLED` (built, and
    type-checked, once per distinct block list)."""
    key = tuple(sorted({*blocked, *blocked_from_env()}))
    with _LOCK:
        reg = _PROCESS.get(key)
        if reg is None:
            reg = Registry(get_plugin_manager(key))
            _PROCESS[key] = reg
            _BY_MANAGER[id(reg.pm)] = reg
        return reg


def plugin_manager(blocked: Iterable[str] = ()) -> pluggy.PluginManager:
    """This process's plugin manager (the one behind :func:`registry`)."""
    return registry(blocked).pm


def reset() -> None:
    """Forget this process's managers and registries (tests that install plugins call it)."""
    with _LOCK:
        _PROCESS.clear()
        _BY_MANAGER.clear()
    with _SHOWN_LOCK:
        _SHOWN.clear()


def registry_of(pm_or_registry: pluggy.PluginManager | Registry) -> Registry:
    """The registry of a manager (built now for a manager that is not this process's own)."""
    if isinstance(pm_or_registry, Registry):
        return pm_or_registry
    with _LOCK:
        reg = _BY_MANAGER.get(id(pm_or_registry))
    if reg is not None and reg.pm is pm_or_registry:
        return reg
    return Registry(pm_or_registry)


# -- the call forms the rest of the package uses -----------------------------------------------


def select_cleanup(
    pm: pluggy.PluginManager | Registry, boundary: str, policy: str, key: str | None = None
) -> CleanupPolicy:
    """The cleanup policy for ``boundary`` (one of :data:`BOUNDARIES`) named ``policy``."""
    return registry_of(pm).cleanup_policy(boundary, policy, key)


def available_cleanup_policies(pm: pluggy.PluginManager | Registry, boundary: str) -> list[str]:
    """Every policy name registered for ``boundary``."""
    return list(registry_of(pm).cleanup[boundary])


def select_transport(
    pm: pluggy.PluginManager | Registry, name: str, kind: str, key: str | None = None
) -> TransportFactory:
    """The transport factory named ``name`` for ``kind`` (one of :data:`TRANSPORT_KINDS`)."""
    return registry_of(pm).transport(kind, name, key)


def available_transports(pm: pluggy.PluginManager | Registry, kind: str) -> list[str]:
    """Every transport name registered for ``kind``."""
    return list(registry_of(pm).transports[kind])


def hook_owners(pm: pluggy.PluginManager | Registry) -> dict[str, list[str]]:
    """Hook name -> the plugin names implementing it, built-ins first (for ``doctor``)."""
    reg = registry_of(pm)
    owners: dict[str, list[str]] = {}
    for hook_name in HOOKS:
        impls = getattr(reg.pm.hook, hook_name).get_hookimpls()
        owners[hook_name] = sorted(
            (impl.plugin_name for impl in impls), key=lambda name: (name not in BUILTIN_PLUGINS, name)
        )
    return owners
