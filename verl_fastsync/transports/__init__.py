"""Built-in weight transports and their ``weight_transport`` hook implementation.

The registry maps ``(kind, name)`` to a factory; the hook implementation returns the names of one
kind (a third-party transport of the same name replaces the built-in, see :mod:`verl_fastsync.plugins`).
"""

from __future__ import annotations

from collections.abc import Mapping

from verl_fastsync import hookimpl
from verl_fastsync.transports.base import TransportFactory

BUILTIN_TRANSPORTS: dict[tuple[str, str], TransportFactory] = {}


@hookimpl
def weight_transport(kind: str) -> Mapping[str, TransportFactory]:
    return {n: factory for (k, n), factory in BUILTIN_TRANSPORTS.items() if k == kind}


def _colocated_shm(**kwargs: object) -> object:
    """``("colocated", "shm")``: persistent POSIX shared-memory slots (lazy import)."""
    from verl_fastsync.colocated import make_shm_memory

    return make_shm_memory(**kwargs)


def _colocated_ipc(**kwargs: object) -> object:
    """``("colocated", "ipc")``: persistent CUDA-IPC slots, exported once (lazy import)."""
    from verl_fastsync.colocated import make_ipc_memory

    return make_ipc_memory(**kwargs)


BUILTIN_TRANSPORTS[("colocated", "shm")] = _colocated_shm
BUILTIN_TRANSPORTS[("colocated", "ipc")] = _colocated_ipc


def _register_engine_transports() -> None:
    """``("engine", name)``: the fastsync checkpoint engine's transports (classes load lazily)."""
    from verl_fastsync.transports.base import LazyTransportClass

    for name, target in (
        ("shm", "verl_fastsync.transports.shm:ShmTransport"),
        ("gloo", "verl_fastsync.transports.gloo:GlooTransport"),
        ("nixl", "verl_fastsync.transports.nixl:NixlTransport"),
        ("nccl", "verl_fastsync.transports.nccl:NcclTransport"),
    ):
        BUILTIN_TRANSPORTS[("engine", name)] = LazyTransportClass(name, target)


_register_engine_transports()
