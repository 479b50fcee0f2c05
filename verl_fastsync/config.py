"""The ``fastsync`` config: ``actor_rollout_ref.rollout.custom.fastsync.*``.

That namespace is the only one that survives verl's config dataclasses and reaches the trainer
workers, the checkpoint-engine workers and the rollout servers on every supported release
(``RolloutConfig.custom`` is a free-form dict). Users set it with Hydra's append syntax::

    +actor_rollout_ref.rollout.custom.fastsync.enable=true
    +actor_rollout_ref.rollout.custom.fastsync.pre_resume_cleanup=adaptive

Parsing is strict: an unknown key (a typo such as ``enabel``) or a value of the wrong type fails
with :class:`FastsyncConfigError`, naming the key, the value and what is allowed. Policy and
transport *names* are checked against the registered plugins by :func:`validate_names`, which the
adapter calls when a worker starts, so a bad name fails before the first sync.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pluggy

KEY_PREFIX = "actor_rollout_ref.rollout.custom.fastsync"


class FastsyncConfigError(ValueError):
    """An invalid ``custom.fastsync`` value; the message names key, value and what is allowed."""


@dataclasses.dataclass(frozen=True)
class FastsyncConfig:
    """Resolved ``custom.fastsync`` settings of one run."""

    enable: bool = False
    """Master switch. False or absent: verl runs exactly as without the plugin."""
    pre_resume_cleanup: str = "light"
    """Cleanup policy before the rollout maps its weights back (``light``, ``adaptive``,
    ``aggressive``, ``none`` or a third-party name)."""
    post_transfer_cleanup: str = "light"
    """Cleanup policy after the transfer and offload, before the KV cache is resumed."""
    adaptive_headroom_gib: float = 4.0
    """``adaptive`` runs GC + ``empty_cache()`` only when the device has less free memory than this."""
    disabled_plugins: tuple[str, ...] = ()
    """Plugin names to block (entry-point names, or ``fastsync-cleanup`` / ``fastsync-transports``)."""
    timeout_s: float = 600.0
    """Upper bound of every blocking wait of the colocated transfer."""
    colocated_transport: str | None = None
    """Colocated transport replacing verl's bucketed sender/receiver (``shm``, ``ipc``); None keeps
    verl's own."""
    verify: bool = False
    """Colocated transport: an xxhash checksum per chunk, checked by the receiver (a debugging aid)."""

    def key(self, field: str) -> str:
        """The full Hydra key of ``field``."""
        return f"{KEY_PREFIX}.{field}"


_FIELDS = {f.name: f for f in dataclasses.fields(FastsyncConfig)}


def _error(field: str, value: Any, allowed: str) -> FastsyncConfigError:
    return FastsyncConfigError(f"{KEY_PREFIX}.{field}={value!r} is invalid; allowed: {allowed}")


def _as_bool(field: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise _error(field, value, "true or false")


def _as_name(field: str, value: Any, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if isinstance(value, str) and value.strip() and value == value.strip():
        return value
    raise _error(field, value, "a non-empty name" + (" or null" if optional else ""))


def _as_number(field: str, value: Any, minimum: float, inclusive: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value >= minimum if inclusive else value > minimum):
        return float(value)
    bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
    raise _error(field, value, f"a finite number {bound}")


def _as_names(field: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise _error(field, value, "a list of plugin names, e.g. [my_plugin]")
    names = tuple(value)
    for name in names:
        if not isinstance(name, str) or not name:
            raise _error(field, value, "a list of non-empty plugin names")
    return names


def _to_plain(raw: Any) -> Any:
    """OmegaConf containers -> plain Python, without importing omegaconf when it is not needed."""
    to_container = getattr(type(raw), "to_container", None)
    if to_container is not None and type(raw).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(raw, resolve=True)
    return raw


def parse_fastsync_config(raw: Mapping[str, Any] | None) -> FastsyncConfig:
    """Parse the ``custom.fastsync`` mapping (None or absent -> all defaults, disabled)."""
    raw = _to_plain(raw)
    if raw is None:
        return FastsyncConfig()
    if not isinstance(raw, Mapping):
        raise FastsyncConfigError(f"{KEY_PREFIX}={raw!r} is invalid; allowed: a mapping of fastsync settings")
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise FastsyncConfigError(
            f"{KEY_PREFIX}.{unknown[0]}={raw[unknown[0]]!r}: unknown key; allowed keys: {', '.join(_FIELDS)}"
        )
    values: dict[str, Any] = {}
    for field, value in raw.items():
        if field in ("enable", "verify"):
            values[field] = _as_bool(field, value)
        elif field in ("pre_resume_cleanup", "post_transfer_cleanup"):
            values[field] = _as_name(field, value)
        elif field == "colocated_transport":
            values[field] = _as_name(field, value, optional=True)
        elif field == "adaptive_headroom_gib":
            values[field] = _as_number(field, value, 0.0, inclusive=True)
        elif field == "timeout_s":
            values[field] = _as_number(field, value, 0.0, inclusive=False)
        elif field == "disabled_plugins":
            values[field] = _as_names(field, value)
    return FastsyncConfig(**values)


def _get(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping) or hasattr(obj, "get"):
        return obj.get(name)
    return getattr(obj, name, None)


def config_from_rollout(rollout_config: Any) -> FastsyncConfig:
    """The fastsync config inside a rollout config (DictConfig, dict or verl's RolloutConfig)."""
    return parse_fastsync_config(_get(_get(rollout_config, "custom"), "fastsync"))


def validate_names(config: FastsyncConfig, pm: pluggy.PluginManager) -> None:
    """Check policy and transport names against the registered plugins (raises FastsyncConfigError)."""
    from verl_fastsync import plugins

    try:
        for boundary in plugins.BOUNDARIES:
            plugins.select_cleanup(pm, boundary, getattr(config, boundary), key=config.key(boundary))
        if config.colocated_transport is not None:
            plugins.select_transport(
                pm, config.colocated_transport, "colocated", key=config.key("colocated_transport")
            )
    except plugins.UnknownPluginNameError as exc:
        raise FastsyncConfigError(str(exc)) from exc
