"""The plugin manager: one factory, and the selection calls with their errors.

Build order (as tox and pluggy's own example do): specs -> block list -> third-party entry points of
group ``verl_fastsync`` -> built-ins (``trylast``) -> ``check_pending()``, so a misspelled hook
implementation fails loudly instead of being ignored.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pluggy

from verl_fastsync import NAME, hookspecs

if TYPE_CHECKING:
    from verl_fastsync.cleanup import CleanupPolicy
    from verl_fastsync.transports.base import TransportFactory

BUILTIN_CLEANUP = "fastsync-cleanup"
BUILTIN_TRANSPORTS = "fastsync-transports"
BUILTIN_PLUGINS = (BUILTIN_CLEANUP, BUILTIN_TRANSPORTS)

BOUNDARIES = ("pre_resume_cleanup", "post_transfer_cleanup")
TRANSPORT_KINDS = ("engine", "colocated")


class UnknownPluginNameError(ValueError):
    """A policy or transport name that no registered plugin owns."""


class PluginHookError(RuntimeError):
    """A plugin's hook implementation raised; the message names the plugin."""


def _register_builtins(pm: pluggy.PluginManager) -> None:
    from verl_fastsync import cleanup, transports

    for name, module in ((BUILTIN_CLEANUP, cleanup), (BUILTIN_TRANSPORTS, transports)):
        if not pm.is_blocked(name):
            pm.register(module, name=name)


def get_plugin_manager(blocked: Iterable[str] = ()) -> pluggy.PluginManager:
    """Build a plugin manager (never pickled or shared across processes).

    :param blocked: plugin names to leave out: entry-point names of third-party plugins or the
        built-in names :data:`BUILTIN_PLUGINS`.
    """
    pm = pluggy.PluginManager(NAME)
    pm.add_hookspecs(hookspecs)
    for name in blocked:
        pm.set_blocked(name)
    pm.load_setuptools_entrypoints(NAME)
    _register_builtins(pm)
    pm.check_pending()
    return pm


@functools.lru_cache(maxsize=8)
def plugin_manager(blocked: tuple[str, ...] = ()) -> pluggy.PluginManager:
    """The process's plugin manager for a block list (built once per distinct list)."""
    return get_plugin_manager(blocked)


def _raising_plugin(hook: Any, exc: BaseException) -> str:
    """The plugin whose implementation appears in the exception's traceback (innermost wins)."""
    owners = {impl.function.__code__: impl.plugin_name for impl in hook.get_hookimpls()}
    owner, tb = "<unknown>", exc.__traceback__
    while tb is not None:
        owner = owners.get(tb.tb_frame.f_code, owner)
        tb = tb.tb_next
    return owner


def _call_selection(pm: pluggy.PluginManager, hook_name: str, **kwargs: Any) -> tuple[Any, list[str]]:
    available: list[str] = []
    hook = getattr(pm.hook, hook_name)
    try:
        result = hook(available=available, **kwargs)
    except Exception as exc:
        raise PluginHookError(
            f"verl-fastsync plugin {_raising_plugin(hook, exc)!r} raised in hook {hook_name}: {exc!r}"
        ) from exc
    return result, available


def _unknown(what: str, key: str, value: str, available: list[str]) -> UnknownPluginNameError:
    names = ", ".join(sorted(set(available))) or "(none registered)"
    return UnknownPluginNameError(f"{key}={value!r}: unknown {what}; available: {names}")


def select_cleanup(
    pm: pluggy.PluginManager, boundary: str, policy: str, key: str | None = None
) -> CleanupPolicy:
    """The cleanup policy for ``boundary`` (one of :data:`BOUNDARIES`) named ``policy``."""
    if boundary not in BOUNDARIES:
        raise ValueError(f"unknown cleanup boundary {boundary!r}; allowed: {', '.join(BOUNDARIES)}")
    result, available = _call_selection(pm, boundary, policy=policy)
    if result is None:
        raise _unknown("cleanup policy", key or f"custom.fastsync.{boundary}", policy, available)
    return result


def available_cleanup_policies(pm: pluggy.PluginManager, boundary: str) -> list[str]:
    """Every policy name registered for ``boundary``."""
    _, available = _call_selection(pm, boundary, policy="")
    return sorted(set(available))


def select_transport(
    pm: pluggy.PluginManager, name: str, kind: str, key: str | None = None
) -> TransportFactory:
    """The transport factory named ``name`` for ``kind`` (one of :data:`TRANSPORT_KINDS`)."""
    if kind not in TRANSPORT_KINDS:
        raise ValueError(f"unknown transport kind {kind!r}; allowed: {', '.join(TRANSPORT_KINDS)}")
    result, available = _call_selection(pm, "weight_transport", name=name, kind=kind)
    if result is None:
        raise _unknown(f"{kind} transport", key or "transport", name, available)
    return result


def available_transports(pm: pluggy.PluginManager, kind: str) -> list[str]:
    """Every transport name registered for ``kind``."""
    _, available = _call_selection(pm, "weight_transport", name="", kind=kind)
    return sorted(set(available))


def hook_owners(pm: pluggy.PluginManager) -> dict[str, list[str]]:
    """Hook name -> plugin names implementing it, in call order (for ``doctor``)."""
    owners: dict[str, list[str]] = {}
    for hook_name in ("pre_resume_cleanup", "post_transfer_cleanup", "weight_transport"):
        impls = getattr(pm.hook, hook_name).get_hookimpls()
        owners[hook_name] = [impl.plugin_name for impl in reversed(impls)]
    return owners
