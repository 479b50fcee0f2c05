"""Configured names checked against the plugin registry: the one module above both.

:mod:`verl_fastsync.config` is data and its own rules and never looks a name up;
:mod:`verl_fastsync.plugins` builds the registry and knows no config. What joins them lives here:

* :func:`validate_names`: the cleanup policies and the colocated transport of a ``custom.fastsync``
  config (a trainer worker at start, ``verl-fastsync doctor``);
* :func:`parse_engine_kwargs`: ``engine_kwargs.fastsync`` with its transport name and that transport's
  own options (the ``fastsync`` checkpoint engine when verl constructs it, ``doctor``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pluggy

from verl_fastsync import plugins
from verl_fastsync.config import (
    EngineSettings,
    FastsyncConfig,
    FastsyncConfigError,
    OptionValidator,
    parse_engine_settings,
)

__all__ = ["parse_engine_kwargs", "validate_names"]


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

