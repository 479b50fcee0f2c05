"""The transport protocol.

``TransportFactory`` is what the ``weight_transport`` hook returns. Its shape depends on the kind:

* ``kind="colocated"``: a callable returning the colocated transport object (see
  :mod:`verl_fastsync.colocated`).
* ``kind="engine"``: an :class:`EngineTransport` *class* (or an object with the same two entry
  points, such as :class:`LazyTransportClass`): ``factory.build_topology(...)`` (a classmethod) and
  ``factory(options)`` -> an :class:`EngineTransport` instance.

Engine transports mirror verl's checkpoint-engine lifecycle, once per weight sync::

    meta = [t.prepare() for t in all_ranks]                      # endpoints, no bucket memory yet
    actor_kw, rollout_kw = Cls.build_topology(n_actor, n_rollout, meta)
    t.init_process_group(**kw_of_this_rank)                      # connect, allocate 2 buckets
    stats = await trainer_rank0.send(named_tensors)             # (name, tensor), sync or async
    async for name, tensor in rollout_rank.receive(): ...       # in send order
    t.finalize()                                                 # free buffers, close sockets

Trainer rank 0 broadcasts to every rollout rank; other trainer ranks get ``rank=-1`` and take no part
(the engine still walks their weight generator). :class:`~verl_fastsync.transports.buffered.BufferedTransport`
(its own module, above this one) implements the double
buffering (bucket ``k+1`` is packed while bucket ``k`` moves; two bucket buffers per side), the
timeouts, the verify checksums, the abort path and the statistics once; a concrete transport only
supplies the buffers and how a bucket moves.

Byte ownership (sender): :meth:`BufferedTransport.send` plans with
:class:`~verl_fastsync.chunks.BucketPlanner` straight into the transport's slot buffers: each
tensor's bytes are in a bucket (or on a fenced device copy) before the producer is asked for the next
tensor, and no reference to a produced tensor is kept. Every device that took part in the copies
into a bucket is synchronized before the bucket is checksummed or posted.

Receiver contract: by default (``TransportOptions.zero_copy=False``) every yielded tensor is its own
memory and stays valid as long as the consumer holds it. With ``zero_copy=True`` a tensor carried
whole in one chunk is a view into the receive bucket, valid only until the consumer asks for the
next tensor.

API change in 0.2.0: ``send`` takes the named tensors, not pre-planned buckets (a planner that hands
buckets of views to a transport cannot own the bytes).
"""

from __future__ import annotations

import asyncio
import importlib
import socket
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from verl_fastsync.chunks import AlignSpec
from verl_fastsync.limits import DEFAULT_TIMEOUT_S, validate_timeout

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ConsumerError",
    "EngineTransport",
    "EngineTransportFactory",
    "LazyTransportClass",
    "PeerAbortedError",
    "TransferStats",
    "TransportError",
    "TransportFactory",
    "TransportOptions",
    "TransportTimeoutError",
    "allocate_bucket_buffers",
    "base_topology",
    "consumer_error",
    "default_host",
    "failure_reason",
    "rank_labels",
]


def default_host() -> str:
    """The address a multi-host transport binds and advertises when ``TransportOptions.host`` is unset."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


TransportFactory = Callable[..., Any]
"""What the ``weight_transport`` hook returns (see the module docstring for each kind)."""

SENDER_RANK = 0
"""Rank of trainer rank 0 in every transfer group; rollout ranks are ``1..world_size-1``."""


class TransportError(RuntimeError):
    """A weight transfer failed."""


class TransportTimeoutError(TransportError, TimeoutError):
    """A blocking wait of a transport expired; the message names peer, phase, bucket and tensor."""


class PeerAbortedError(TransportError):
    """Another rank failed the sync (its reason is in the message). ``origin`` (its transfer rank)
    and ``cause`` (its reason), when set, name the first failure: a side that fails with this error
    relays them unchanged, never its own text wrapped around them, so every rank of the group
    reports the first cause and the rank where it happened."""

    def __init__(self, message: str, origin: int | None = None, cause: str | None = None) -> None:
        super().__init__(message)
        self.origin = origin
        self.cause = cause


class ConsumerError(TransportError):
    """Thrown into a receive stream by whoever drives it (the plugin's wrapper around verl's
    ``update_weights``) when the consumer failed or stopped: the stream fails the sync with this text
    as the reason every other side sees."""


def failure_reason(exc: BaseException, tensors: int | None = None) -> str:
    """The reason a side sends its peers for ``exc``. A receive stream closed without an error
    (``GeneratorExit``: the consumer stopped iterating, or the stream was garbage-collected) says so
    in words instead of naming Python's close mechanism."""
    if isinstance(exc, ConsumerError):
        return str(exc)
    if isinstance(exc, GeneratorExit):
        after = "" if tensors is None else f" after {tensors} tensors"
        return f"the consumer stopped before the end of the sync (its receive stream was closed{after})"
    if isinstance(exc, asyncio.CancelledError):
        if exc.args and isinstance(exc.args[0], ConsumerError):
            return str(exc.args[0])  # a stream cancelled with its reason (the lanes of several senders)
        return f"the consumer's task was cancelled{f' ({exc})' if str(exc) else ''}"
    return f"{type(exc).__name__}: {exc}"


def consumer_error(exc: BaseException | None, tensors: int | None = None) -> ConsumerError:
    """What to throw into a receive stream whose consumer raised ``exc`` (``None``: it returned
    before the stream ended)."""
    if exc is None:
        return ConsumerError(failure_reason(GeneratorExit(), tensors))
    return ConsumerError(f"the consumer failed: {failure_reason(exc, tensors)}")


@dataclass
class TransportOptions:
    """Per-process options of an engine transport (from ``engine_kwargs.fastsync``)."""

    is_master: bool = False
    """True on trainer rank 0 (verl's ``is_master``)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Limit of every blocking wait (seconds)."""
    verify: bool = False
    """Per-chunk xxhash checksums, checked by the receiver."""
    device: str = "cpu"
    """Where received tensors are allocated (``"cpu"`` or e.g. ``"cuda:0"``)."""
    zero_copy: bool = False
    """``False`` (default): every yielded tensor keeps the bytes it was given for as long as the
    consumer holds it (a lending transport hands out views into a bucket it then never refills while
    a view lives; others copy). ``True``: tensors carried whole in one chunk are views into the
    receive bucket, valid only until the next item is requested from :meth:`EngineTransport.receive`
    (clone to keep)."""
    host: str | None = None
    """Address to bind network endpoints on (trainer rank 0); default: the transport's choice."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """The transport's own ``engine_kwargs.fastsync`` options (its ``engine_options``), validated."""

    def __post_init__(self) -> None:
        self.timeout_s = validate_timeout(self.timeout_s)


@dataclass
class TransferStats:
    """What one side of one sync did. ``peak_extra_bytes`` is this side's own accounting of the
    buffers it allocated: its bucket buffers plus, on a receiver, the destination tensors that were
    still incomplete at the same time (never more than the largest tensor)."""

    role: str = "sender"
    bytes: int = 0
    buckets: int = 0
    chunks: int = 0
    tensors: int = 0
    seconds: float = 0.0
    bucket_size: int = 0
    buffer_bytes: int = 0
    peak_extra_bytes: int = 0
    copied_bytes: int = 0
    """Receiver: bytes copied out of its buckets into memory of their own (tensors split over several
    buckets, buckets that could not be lent); 0 when every tensor was lent."""
    held_bytes: int = 0
    """Receiver: bytes of this side's buffers the consumer still referenced when the sync ended (lent
    buckets and split-tensor buffers). Not in ``peak_extra_bytes`` (they are the consumer's tensors);
    they go back to the transport, or are freed, the moment the consumer drops them."""

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9 bytes) per second."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_metrics(self, prefix: str = "fastsync/transfer") -> dict[str, float]:
        side = "sender" if self.role == "sender" else "receiver"
        extra = (
            {
                f"{prefix}/copied_bytes_receiver": float(self.copied_bytes),
                f"{prefix}/consumer_held_bytes_receiver": float(self.held_bytes),
            }
            if side == "receiver"
            else {}
        )
        return extra | {
            f"{prefix}/bytes": float(self.bytes),
            f"{prefix}/buckets": float(self.buckets),
            f"{prefix}/chunks": float(self.chunks),
            f"{prefix}/tensors": float(self.tensors),
            f"{prefix}/seconds": self.seconds,
            f"{prefix}/gbps": self.gbps,
            f"{prefix}/bucket_size": float(self.bucket_size),
            f"{prefix}/peak_extra_bytes_{side}": float(self.peak_extra_bytes),
        }


class EngineTransport(ABC):
    """An engine transport (one instance per process, reused across syncs)."""

    name: ClassVar[str] = "?"
    one_copy_per_host: ClassVar[bool] = False
    """Whether ``engine_kwargs.fastsync.hosts=auto`` runs this transport over the host structure
    (:mod:`verl_fastsync.transports.hosts`): its groups connect across hosts and a rollout rank may
    send (relay) in one. A third-party transport opts in by setting it."""

    def __init__(self, options: TransportOptions | None = None) -> None:
        self.options = options or TransportOptions()

    @abstractmethod
    def prepare(self) -> dict[str, Any]:
        """Open endpoints (trainer rank 0) and return plain, picklable metadata for the topology."""

    @classmethod
    @abstractmethod
    def build_topology(
        cls, actor_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Per-rank ``init_process_group`` kwargs (lists as long as each world) from all metadata
        (actor ranks first, then rollout ranks). Always includes ``rank``, ``world_size``, ``role``
        and ``bucket_size`` (which the caller may overwrite, e.g. for ``auto``)."""

    @abstractmethod
    def init_process_group(self, **kwargs: Any) -> None:
        """Connect to the peers and allocate the two bucket buffers."""

    @abstractmethod
    async def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
        *,
        align: AlignSpec = None,
    ) -> TransferStats:
        """Move every tensor to every rollout rank (trainer rank 0). The bytes of each tensor must be
        owned by the transport before the next one is requested (see the module docstring)."""

    @abstractmethod
    def receive(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` in send order (rollout ranks)."""

    @abstractmethod
    def finalize(self) -> None:
        """Free buffers and close endpoints (idempotent; also safe after an error)."""

    def let_go_of_peers(self) -> None:
        """This side takes no part in the coming sync (a side of :mod:`~verl_fastsync.transports.hosts`
        the sync's plan does not use): let go of connections kept for a next sync with the same
        group, keep what ``prepare()`` made. Default: nothing is kept between syncs."""
        return None

    @property
    def last_stats(self) -> TransferStats | None:
        return None


class EngineTransportFactory(Protocol):
    """What the hook returns for ``kind="engine"``."""

    def __call__(self, options: TransportOptions) -> EngineTransport: ...

    def build_topology(
        self, actor_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]: ...


class LazyTransportClass:
    """An engine-transport factory that imports its module on first use (keeps registration cheap)."""

    def __init__(self, name: str, target: str) -> None:
        self.name = name
        self.target = target  # "package.module:ClassName"

    def load(self) -> type[EngineTransport]:
        module_name, _, attr = self.target.partition(":")
        cls: type[EngineTransport] = getattr(importlib.import_module(module_name), attr)
        return cls

    def __call__(self, options: TransportOptions | None = None) -> EngineTransport:
        return self.load()(options)

    @property
    def engine_options(self) -> Mapping[str, Any]:
        """The class's own ``engine_kwargs.fastsync`` keys (loads it: options are validated where the
        transport is about to be built)."""
        options: Mapping[str, Any] = getattr(self.load(), "engine_options", None) or {}
        return options

    def build_topology(
        self, actor_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return self.load().build_topology(actor_world_size, rollout_world_size, metadata)

    def __repr__(self) -> str:
        return f"LazyTransportClass({self.name!r}, {self.target!r})"


def rank_labels(rollout_world_size: int, sender: str = "trainer rank 0") -> list[str]:
    """verl's names for the ranks of one transfer group, indexed by transfer rank: 0 is the sender
    (``sender``: verl's trainer rank, plus the lane with several senders), ``j + 1`` is verl's
    rollout rank ``j``. Every error text names ranks this way, never by transfer rank."""
    return [sender] + [f"rollout rank {j}" for j in range(rollout_world_size)]


def base_topology(
    actor_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """The common part: trainer rank 0 -> rank 0, other trainer ranks -> -1, rollout -> 1..N, and
    every rank's ``rank_labels`` (see :func:`rank_labels`; the lanes of several senders replace the
    sender's label)."""
    for label, value in (("actor_world_size", actor_world_size), ("rollout_world_size", rollout_world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    if len(metadata) != actor_world_size + rollout_world_size:
        raise ValueError(
            f"build_topology got {len(metadata)} metadata entries for {actor_world_size} actor + "
            f"{rollout_world_size} rollout ranks"
        )
    world = 1 + rollout_world_size
    bucket = [m.get("bucket_size") for m in metadata]
    labels = rank_labels(rollout_world_size)
    actor: dict[str, list[Any]] = {
        "rank": [SENDER_RANK] + [-1] * (actor_world_size - 1),
        "world_size": [world] * actor_world_size,
        "role": ["trainer"] * actor_world_size,
        "bucket_size": bucket[:actor_world_size],
        "rank_labels": [labels] * actor_world_size,
    }
    rollout: dict[str, list[Any]] = {
        "rank": list(range(1, world)),
        "world_size": [world] * rollout_world_size,
        "role": ["rollout"] * rollout_world_size,
        "bucket_size": bucket[actor_world_size:],
        "rank_labels": [labels] * rollout_world_size,
    }
    return actor, rollout


def allocate_bucket_buffers(
    size: int, device: torch.device | str = "cpu", count: int = 2
) -> list[torch.Tensor]:
    """``count`` flat ``uint8`` bucket buffers. Host buffers are touched once here (pages faulted in
    at ``init_process_group``, not during the timed transfer)."""
    buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)]
    for buffer in buffers:
        if buffer.device.type == "cpu" and size:
            buffer.numpy().fill(0)
    return buffers
