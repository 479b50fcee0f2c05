"""Constants, errors, control messages (msgspec, never pickle) and the per-process switch of the
colocated path."""

from __future__ import annotations

import os
import re
from typing import Any

from verl_fastsync import config, wire

SCHEMA_VERSION = wire.COLOCATED_SCHEMA_VERSION
"""Version of the control messages; a peer speaking another version is refused."""

# The names live in verl_fastsync.config with every variable that carries the config to other processes.
ENV_ENABLE = config.ENV_COLOCATED
"""Per-process switch (see the package docstring for the values)."""
ENV_TIMEOUT = config.ENV_COLOCATED_TIMEOUT
"""Override of the default timeout (seconds) of every blocking wait."""
ENV_VERIFY = config.ENV_COLOCATED_VERIFY
"""``1``: the sender attaches an xxhash checksum to every chunk and the receiver checks it (the adapter
sets it in the trainer process from ``custom.fastsync.verify``)."""

DEFAULT_TIMEOUT_S = config.DEFAULT_TIMEOUT_S
"""Default timeout of one blocking wait."""

METRIC_PREFIX = "fastsync/colocated/"

_OFF = config.COLOCATED_OFF
_ON = frozenset({"1", "true", "on", "yes", "auto"})


class ColocatedError(RuntimeError):
    """A colocated weight sync failed."""


class ColocatedTimeoutError(ColocatedError, TimeoutError):
    """A blocking wait of a colocated sync ran past its timeout."""


class ColocatedProtocolError(ColocatedError):
    """The peer sent something this side cannot accept (version, order, content)."""


class _PeerFailed(Exception):
    """Internal: the peer reported a failure while we were sending; read it with ``recv()``."""


# ---------------------------------------------------------------------------------------------
# control messages (msgspec, never pickle)
# ---------------------------------------------------------------------------------------------


# The messages live in verl_fastsync.wire with every other control message (one schema-version
# rule, verl_fastsync.wire.check_version); the colocated path keeps its short names.
Ready = wire.ColocatedReady
Hello = wire.ColocatedHello
HelloAck = wire.ColocatedHelloAck
BucketMsg = wire.ColocatedBucket
Ack = wire.ColocatedAck
Abort = wire.ColocatedAbort
Message = wire.ColocatedMessage
IpcHandle = wire.IpcHandle
SlotDesc = wire.SlotDesc
CODEC = wire.COLOCATED_CODEC


# ---------------------------------------------------------------------------------------------
# configuration helpers
# ---------------------------------------------------------------------------------------------


def colocated_enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether fastsync's colocated path is enabled for this process (:data:`ENV_ENABLE`)."""
    return colocated_transport_name(False, environ) is not None


def colocated_transport_name(use_shm: bool, environ: Any = None) -> str | None:
    """The colocated transport to use, or ``None`` when disabled. ``use_shm`` is verl's choice."""
    env = os.environ if environ is None else environ
    raw = str(env.get(ENV_ENABLE, "")).strip().lower()
    if raw in _OFF:
        return None
    if raw in _ON:
        return "shm" if use_shm else "ipc"
    if re.fullmatch(r"[a-z0-9_.-]+", raw):
        return raw
    raise ValueError(
        f"{ENV_ENABLE}={env.get(ENV_ENABLE)!r} is not valid; allowed: unset/0/false/off (verl's own "
        f"transfer), 1/true/on/auto (fastsync, shm or ipc as verl would pick), or a colocated transport "
        f"name such as shm or ipc"
    )


def _default_timeout() -> float:
    value = config.timeout_from_env(os.environ.get(ENV_TIMEOUT), ENV_TIMEOUT)
    return DEFAULT_TIMEOUT_S if value is None else value


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _ON


def _check_timeout(timeout_s: float | None) -> float:
    if timeout_s is None:
        return _default_timeout()
    try:
        return config.validate_timeout(timeout_s)
    except TypeError as exc:  # the colocated path has always raised ValueError for every bad timeout
        raise ValueError(str(exc)) from None
