"""The ``fastsync`` config: ``actor_rollout_ref.rollout.custom.fastsync.*``.

That namespace is the only one that survives verl's config dataclasses and reaches the trainer
workers, the checkpoint-engine workers and the rollout servers on every supported release
(``RolloutConfig.custom`` is a free-form dict). Users set it with Hydra's append syntax::

    +actor_rollout_ref.rollout.custom.fastsync.enable=true
    +actor_rollout_ref.rollout.custom.fastsync.pre_resume_cleanup=adaptive

Parsing is strict: an unknown key (a typo such as ``enabel``) or a value of the wrong type fails
with :class:`FastsyncConfigError`, naming the key, the value and what is allowed. This module is data
and its own rules: it never looks a name up. Policy and transport *names* are checked against the
registered plugins by :mod:`verl_fastsync.selection` (``validate_names``, ``parse_engine_kwargs``),
which the adapter calls when a worker starts, so a bad name fails before the first sync.

It imports no torch and nothing of the package but :mod:`verl_fastsync.limits` (the one rule of each
size and timeout, used here as :func:`validate_timeout`, :func:`validate_bucket_size` and
:data:`DEFAULT_TIMEOUT_S`), so the layers above it (colocated, transports, ...) can import it; it is
also the home of the environment variables that carry the config, :func:`timeout_from_env` and
:data:`COLOCATED_OFF`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from verl_fastsync.limits import DEFAULT_TIMEOUT_S, validate_bucket_size, validate_timeout

KEY_PREFIX = "actor_rollout_ref.rollout.custom.fastsync"

# The environment variables that carry the config to processes that never see it (vLLM's workers);
# they reach every Ray actor through ``+ray_kwargs.ray_init.runtime_env.env_vars``.
ENV_COLOCATED = "VERL_FASTSYNC_COLOCATED"
"""Per-process switch of the colocated transfer (see :mod:`verl_fastsync.colocated`)."""
ENV_COLOCATED_TIMEOUT = "VERL_FASTSYNC_COLOCATED_TIMEOUT_S"
"""Override of the default timeout (seconds) of every blocking wait of the colocated transfer."""
ENV_COLOCATED_VERIFY = "VERL_FASTSYNC_COLOCATED_VERIFY"
"""``1``: the colocated sender attaches an xxhash checksum to every chunk and the receiver checks it."""


COLOCATED_OFF = frozenset({"", "0", "false", "off", "no"})
"""Values of :data:`ENV_COLOCATED` (lower-cased, stripped) that leave verl's colocated transfer alone."""


def timeout_from_env(raw: str | None, what: str = ENV_COLOCATED_TIMEOUT) -> float | None:
    """The timeout an environment variable holds (``None`` when unset or blank), checked by
    :func:`validate_timeout`; ``ValueError`` naming ``what`` and the raw text otherwise."""
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{what}={raw!r} must be a positive number of seconds") from None
    return validate_timeout(value, f"{what}={raw!r}")


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
    """Plugin names to block (entry-point names, or ``fastsync-cleanup`` / ``fastsync-transports``);
    processes that never see the config read ``VERL_FASTSYNC_DISABLED_PLUGINS``, which must hold them
    too (the adapter checks it at worker start)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Upper bound of every blocking wait of the colocated transfer; vLLM's workers (the receivers)
    read it from ``VERL_FASTSYNC_COLOCATED_TIMEOUT_S``, which the adapter checks agrees."""
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
            try:
                values[field] = validate_timeout(value, field)
            except (TypeError, ValueError):
                raise _error(field, value, "a finite number > 0") from None
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


# -- checkpoint_engine.engine_kwargs.fastsync ---------------------------------------------------

ENGINE_KEY_PREFIX = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fastsync"
ENGINE_KEYS = (
    "transport",
    "bucket_bytes",
    "timeout_s",
    "verify",
    "device",
    "zero_copy",
    "align_experts",
    "senders",
    "delta",
    "hosts",
)
"""The keys of ``engine_kwargs.fastsync`` every engine transport accepts (a third-party transport may
declare more through ``engine_options``, see :func:`verl_fastsync.hookspecs.weight_transport`)."""
_RESERVED_ENGINE_KEYS = {
    "bucket_size": "verl passes bucket_size= (update_weights_bucket_megabytes) itself and would fail with "
    "\"got multiple values for keyword argument 'bucket_size'\"; use bucket_bytes (e.g. bucket_bytes=64MiB)",
    "is_master": "verl passes is_master= itself",
}
DEFAULT_ENGINE_TIMEOUT_S = DEFAULT_TIMEOUT_S


class EngineKwargsError(FastsyncConfigError, TypeError):
    """An invalid ``engine_kwargs.fastsync`` key or value (a ValueError and, for verl's keyword-argument
    call, a TypeError)."""


_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}


def parse_bucket_bytes(value: object, key: str = "engine_kwargs.fastsync.bucket_bytes") -> int | None:
    """``None``/``"auto"`` -> ``None`` (auto); a positive int or ``"<n><unit>"`` -> bytes; else error."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if isinstance(value, bool):
        raise ValueError(
            f"{key}={value!r}: expected a positive number of bytes, a size like '64MiB', or 'auto'"
        )
    size: object = value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", value)
        size = None
        if match and match.group(2).lower() in _UNITS:
            size = int(match.group(1)) * _UNITS[match.group(2).lower()]
    if isinstance(size, int):
        try:
            return validate_bucket_size(size, key)
        except ValueError:
            raise ValueError(f"{key}={value!r}: the bucket size must be > 0 bytes (or 'auto')") from None
    raise ValueError(
        f"{key}={value!r}: not a bucket size; use a positive int (bytes), a size such as '64MiB' "
        "(units B, KiB, MiB, GiB, KB, MB, GB) or 'auto'"
    )


def parse_senders(value: object, key: str = "engine_kwargs.fastsync.senders") -> int | None:
    """``engine_kwargs.fastsync.senders``: a positive int (``"2"`` too) -> that many sending trainer
    ranks; ``"all"`` -> ``None`` (every trainer rank); anything else raises :class:`EngineKwargsError`."""
    number: object = value
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "all":
            return None
        number = int(text) if text.isdigit() else None
    if isinstance(number, int) and not isinstance(number, bool) and number >= 1:
        return number
    raise EngineKwargsError(
        f"{key}={value!r} is invalid; allowed: a positive int (1 = trainer rank 0 only, the default) "
        "or 'all' (every trainer rank sends a byte-balanced share)"
    )


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """Resolved ``engine_kwargs.fastsync`` of the ``fastsync`` checkpoint engine."""

    transport: str = "shm"
    bucket_bytes: int | None = None
    """Explicit bucket size in bytes; None with :attr:`bucket_auto` false: verl's bucket_size."""
    bucket_auto: bool = False
    timeout_s: float = DEFAULT_ENGINE_TIMEOUT_S
    verify: bool = False
    device: str = "cpu"
    zero_copy: bool = False
    align_experts: bool = False
    senders: int | None = 1
    """How many trainer ranks send (``engine_kwargs.fastsync.senders``): 1 (trainer rank 0 only, the
    default), ``n`` (the first ``n``, spread over hosts) or ``None`` for ``all``."""
    delta: bool = False
    """Send each tensor as its difference from what was sent in the last sync
    (``engine_kwargs.fastsync.delta``; :mod:`verl_fastsync.delta.stream`)."""
    hosts: str = "auto"
    """``auto`` (default): one copy per host for transports that support it (``gloo``, ``nixl``):
    one rank per rollout host receives across the network, hosts are chained, and each host's ranks
    read what arrived from shared memory (:mod:`verl_fastsync.transports.hosts`). ``off``: every
    rollout rank is its own destination across the network."""
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The selected transport's own declared options (``engine_options``), validated."""


HOSTS_MODES = ("auto", "off")
"""Allowed values of ``engine_kwargs.fastsync.hosts``."""


OptionValidator = Callable[[str, Any], Any]
"""``validator(key, value) -> value``: one option a transport declares in ``engine_options``."""
EngineOptions = Callable[[str, str], Mapping[str, OptionValidator]]
"""``engine_options(transport, key) -> {option: validator}``: the options the engine transport named
``transport`` declares; raises (naming ``key``) for a name it does not know."""


def parse_engine_settings(raw: Mapping[str, Any] | None, engine_options: EngineOptions) -> EngineSettings:
    """Validate ``engine_kwargs.fastsync``; the transport's name and its own options are whatever
    ``engine_options`` says (this module looks no name up: :func:`verl_fastsync.selection.parse_engine_kwargs`
    passes this process's registry, exactly as the engine does when verl constructs it)."""
    raw = dict(_to_plain(raw) or {})
    where = "engine_kwargs.fastsync"
    for key, why in _RESERVED_ENGINE_KEYS.items():
        if key in raw:
            raise EngineKwargsError(f"{where}.{key}={raw[key]!r} cannot be set: {why}")
    transport = raw.pop("transport", "shm")
    if not isinstance(transport, str) or not transport.strip():
        raise EngineKwargsError(f"{where}.transport={transport!r} is invalid; allowed: a transport name")
    declared = engine_options(transport, f"{where}.transport")
    unknown = sorted(set(raw) - set(ENGINE_KEYS) - set(declared))
    if unknown:
        allowed = ", ".join((*ENGINE_KEYS, *declared))
        raise EngineKwargsError(f"unknown {where} key(s) {unknown}; allowed: {allowed}")
    values: dict[str, Any] = {"transport": transport}
    if "bucket_bytes" in raw:
        try:
            size = parse_bucket_bytes(raw["bucket_bytes"], f"{where}.bucket_bytes")
        except ValueError as exc:
            raise EngineKwargsError(str(exc)) from exc
        values["bucket_bytes"], values["bucket_auto"] = size, size is None
    if "timeout_s" in raw:
        try:
            values["timeout_s"] = validate_timeout(raw["timeout_s"])
        except (TypeError, ValueError):
            raise EngineKwargsError(
                f"{where}.timeout_s={raw['timeout_s']!r} is invalid: timeout_s must be a finite number > 0 "
                "of seconds"
            ) from None
    for flag in ("verify", "zero_copy", "align_experts", "delta"):
        if flag in raw:
            try:
                values[flag] = _as_bool(flag, raw[flag])
            except FastsyncConfigError:
                raise EngineKwargsError(
                    f"{where}.{flag}={raw[flag]!r} is invalid; allowed: true or false"
                ) from None
    if "senders" in raw:
        values["senders"] = parse_senders(raw["senders"], f"{where}.senders")
    if "hosts" in raw:
        mode = str(raw["hosts"]).strip().lower() if isinstance(raw["hosts"], str) else raw["hosts"]
        if mode is False:
            mode = "off"  # YAML reads a bare off as false
        if mode not in HOSTS_MODES:
            raise EngineKwargsError(
                f"{where}.hosts={raw['hosts']!r} is invalid; allowed: auto (one copy per host, the "
                "default) or off (every rollout rank its own destination)"
            )
        values["hosts"] = mode
    if "device" in raw:
        device = raw["device"]
        if not isinstance(device, str) or not device.strip():
            raise EngineKwargsError(
                f"{where}.device={device!r} is invalid; allowed: a device such as cpu or cuda:0"
            )
        values["device"] = device
    extra: dict[str, Any] = {}
    for key in sorted(set(raw) & set(declared) - set(ENGINE_KEYS)):
        try:
            extra[key] = declared[key](f"{where}.{key}", raw[key])
        except (ValueError, TypeError) as exc:
            raise EngineKwargsError(str(exc)) from exc
    return EngineSettings(**values, extra=extra)


def engine_bucket_size(settings: EngineSettings, verl_bucket_size: object) -> int | None:
    """The engine's explicit bucket size in bytes: ``bucket_bytes``, else verl's ``bucket_size``
    (``update_weights_bucket_megabytes`` << 20); None for ``bucket_bytes=auto``."""
    if settings.bucket_auto:
        return None
    if settings.bucket_bytes is not None:
        return settings.bucket_bytes
    key = "checkpoint_engine.update_weights_bucket_megabytes"
    if isinstance(verl_bucket_size, str) or verl_bucket_size is None:
        raise EngineKwargsError(f"{key}: bucket_size={verl_bucket_size!r} is not a positive number of bytes")
    try:
        size = parse_bucket_bytes(verl_bucket_size, key)
    except ValueError as exc:
        raise EngineKwargsError(str(exc)) from exc
    if size is None:  # pragma: no cover - a non-string is never "auto"
        raise EngineKwargsError(f"{key}: bucket_size={verl_bucket_size!r} is not a positive number of bytes")
    return size
