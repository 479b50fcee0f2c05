"""Configured names checked against the plugin registry: the one module above both.

:mod:`verl_fastsync.config` is data and its own rules and never looks a name up;
:mod:`verl_fastsync.plugins` builds the registry and knows no config. What joins them lives here:

* :func:`validate_names`: the cleanup policies and the colocated transport of a ``custom.fastsync``
  config (a trainer worker at start, ``verl-fastsync doctor``);
* :func:`parse_engine_kwargs`: ``engine_kwargs.fastsync`` with its transport name and that transport's
  own options (the ``fastsync`` checkpoint engine when verl constructs it, ``doctor``);
* :func:`colocated_transport`: the factory of a colocated transport name, which the colocated path
  (a layer below the registry, whose built-ins the registry registers) is given through
  :func:`wire_colocated` when it is imported (see :func:`verl_fastsync.verl.adapter.install_into_verl`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pluggy

from verl_fastsync import plugins
from verl_fastsync.config import (
    ENV_COLOCATED,
    EngineSettings,
    FastsyncConfig,
    FastsyncConfigError,
    OptionValidator,
    parse_engine_settings,
)

if TYPE_CHECKING:  # importing this module must not import torch (the adapter imports it at start)
    from verl_fastsync.transports.base import TransportFactory

__all__ = ["colocated_transport", "parse_engine_kwargs", "validate_names", "wire_colocated"]


def validate_names(config: FastsyncConfig, registry: plugins.Registry | pluggy.PluginManager) -> None:
    """Check policy and transport names against the registered plugins (raises FastsyncConfigError).

    :param registry: a :class:`verl_fastsync.plugins.Registry` (or a plugin manager).
    """
    reg = plugins.registry_of(registry)
    try:
        for boundary in plugins.BOUNDARIES:
            reg.cleanup_policy(boundary, getattr(config, boundary), key=config.key(boundary))
        if config.colocated_transport is not None:
            reg.transport("colocated", config.colocated_transport, key=config.key("colocated_transport"))
    except plugins.UnknownPluginNameError as exc:
        raise FastsyncConfigError(str(exc)) from exc


def parse_engine_kwargs(
    raw: Mapping[str, Any] | None, registry: plugins.Registry | pluggy.PluginManager | None = None
) -> EngineSettings:
    """Validate ``engine_kwargs.fastsync`` exactly as the engine does when verl constructs it.

    :param registry: a :class:`verl_fastsync.plugins.Registry`: the transport name is checked against
        it, and its ``engine_options`` validate the transport's own keys. ``None``: this process's.
    """

    def engine_options(transport: str, key: str) -> Mapping[str, OptionValidator]:
        reg = plugins.registry() if registry is None else plugins.registry_of(registry)
        factory = reg.transport("engine", transport, key=key)
        declared: Mapping[str, OptionValidator] = getattr(factory, "engine_options", None) or {}
        return declared

    return parse_engine_settings(raw, engine_options)


def colocated_transport(name: str) -> TransportFactory:
    """The factory of the colocated transport ``name`` in this process's registry (an unknown or
    blocked name raises :class:`~verl_fastsync.plugins.UnknownPluginNameError` naming
    :data:`~verl_fastsync.config.ENV_COLOCATED`)."""
    return plugins.select_transport(plugins.plugin_manager(), name, "colocated", key=ENV_COLOCATED)


def wire_colocated(memory_module: ModuleType) -> None:
    """Give the colocated path (:mod:`verl_fastsync.colocated.memory`, passed in once imported) this
    process's registry as its transport lookup."""
    memory_module.use_transport_lookup(colocated_transport)
