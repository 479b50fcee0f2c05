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
(the engine still walks their weight generator). :class:`BufferedTransport` implements the double
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
import concurrent.futures
import importlib
import math
import socket
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import msgspec
import torch

from verl_fastsync.chunks import (
    AlignSpec,
    Allocate,
    Assembler,
    Bucket,
    BucketPlanner,
    ChunkMeta,
    bucket_chunk_views,
    chunk_checksum,
    unpack_item,
    validate_bucket_size,
)
from verl_fastsync.io.fence import synchronize_device
from verl_fastsync.wire import Abort, BucketReady, SyncEnd

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "BufferedTransport",
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
    "default_host",
]


def default_host() -> str:
    """The address a multi-host transport binds and advertises when ``TransportOptions.host`` is unset."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


TransportFactory = Callable[..., Any]
"""What the ``weight_transport`` hook returns (see the module docstring for each kind)."""

DEFAULT_TIMEOUT_S = 600.0
"""Default for every blocking wait of an engine transport, in seconds."""

SENDER_RANK = 0
"""Rank of trainer rank 0 in every transfer group; rollout ranks are ``1..world_size-1``."""


class TransportError(RuntimeError):
    """A weight transfer failed."""


class TransportTimeoutError(TransportError, TimeoutError):
    """A blocking wait of a transport expired; the message names peer, phase, bucket and tensor."""


class PeerAbortedError(TransportError):
    """The peer reported a failure (its reason is in the message)."""


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
    """``False`` (default): every yielded tensor is its own memory, valid as long as the consumer
    holds it. ``True``: tensors carried whole in one chunk are views into the receive bucket, valid
    only until the next item is requested from :meth:`EngineTransport.receive` (clone to keep)."""
    host: str | None = None
    """Address to bind network endpoints on (trainer rank 0); default: the transport's choice."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """The transport's own ``engine_kwargs.fastsync`` options (its ``engine_options``), validated."""

    def __post_init__(self) -> None:
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float):
            raise TypeError(f"timeout_s must be a number of seconds, got {self.timeout_s!r}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0 of seconds, got {self.timeout_s}")


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

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9 bytes) per second."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_metrics(self, prefix: str = "fastsync/transfer") -> dict[str, float]:
        side = "sender" if self.role == "sender" else "receiver"
        return {
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

    def build_topology(
        self, actor_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return self.load().build_topology(actor_world_size, rollout_world_size, metadata)

    def __repr__(self) -> str:
        return f"LazyTransportClass({self.name!r}, {self.target!r})"


def base_topology(
    actor_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """The common part: trainer rank 0 -> rank 0, other trainer ranks -> -1, rollout -> 1..N."""
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
    actor: dict[str, list[Any]] = {
        "rank": [SENDER_RANK] + [-1] * (actor_world_size - 1),
        "world_size": [world] * actor_world_size,
        "role": ["trainer"] * actor_world_size,
        "bucket_size": bucket[:actor_world_size],
    }
    rollout: dict[str, list[Any]] = {
        "rank": list(range(1, world)),
        "world_size": [world] * rollout_world_size,
        "role": ["rollout"] * rollout_world_size,
        "bucket_size": bucket[actor_world_size:],
    }
    return actor, rollout


@dataclass
class _InFlight:
    """What a side is doing right now, for error messages."""

    phase: str = "idle"
    bucket: int | None = None
    tensor: str | None = None
    last_tensor: str | None = None

    def describe(self) -> str:
        bucket = "none" if self.bucket is None else str(self.bucket)
        if self.tensor is not None:
            tensor = repr(self.tensor)
        elif self.last_tensor is not None:
            tensor = f"none (last complete: {self.last_tensor!r})"
        else:
            tensor = "none"
        return f"phase {self.phase!r}, bucket {bucket}, tensor in flight {tensor}"


@dataclass
class _SyncState:
    sync_id: str = ""
    stats: TransferStats = field(default_factory=TransferStats)


class BufferedTransport(EngineTransport):
    """Double-buffered engine transport: subclasses provide buffers and movement primitives.

    Sender primitives: :meth:`_sender_buffer`, :meth:`_wait_slot_free`, :meth:`_post_bucket`,
    :meth:`_post_end`, :meth:`_post_abort`. Receiver primitives: :meth:`_receiver_buffer`,
    :meth:`_recv_next` (blocking; runs in a worker thread), :meth:`_release_slot`. Plus
    :meth:`_connect` / :meth:`_close` for the lifecycle. Set ``prefetch = True`` when
    :meth:`_recv_next` itself moves the data (e.g. a collective) so bucket ``k+1`` arrives while the
    consumer handles bucket ``k``; it must then not share a non-thread-safe handle with
    :meth:`_release_slot`.
    """

    prefetch: ClassVar[bool] = False

    def __init__(self, options: TransportOptions | None = None) -> None:
        super().__init__(options)
        self.rank: int | None = None
        self.world_size = 0
        self.role = "?"
        self.bucket_size = 0
        self.inflight = _InFlight()
        self._stats: TransferStats | None = None
        self._executor: ThreadPoolExecutor | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def build_topology(
        cls, actor_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        actor, rollout = base_topology(actor_world_size, rollout_world_size, metadata)
        extra = cls._topology_extra(metadata[:actor_world_size], metadata[actor_world_size:])
        for key, value in extra.items():
            actor[key] = [value] * actor_world_size
            rollout[key] = [value] * rollout_world_size
        return actor, rollout

    @classmethod
    def _topology_extra(
        cls, actor_metadata: list[dict[str, Any]], rollout_metadata: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """Values every rank gets (e.g. the master endpoint from ``actor_metadata[0]``)."""
        return {}

    def init_process_group(self, **kwargs: Any) -> None:
        rank = kwargs.pop("rank")
        world_size = kwargs.pop("world_size")
        role = kwargs.pop("role", "trainer" if rank <= 0 else "rollout")
        bucket_size = kwargs.pop("bucket_size", None)
        self.rank, self.world_size, self.role = int(rank), int(world_size), str(role)
        if self.rank < 0:
            return
        self.bucket_size = validate_bucket_size(bucket_size)
        self.inflight = _InFlight(phase="init_process_group")
        if self.rank != SENDER_RANK:
            # a receiver whose previous sync was never finalized starts with a fresh channel; the
            # sender's endpoints were opened by this sync's prepare()
            self._safe_end_sync()
        try:
            self._connect(**kwargs)
        except BaseException:
            self._safe_close()
            raise
        self.inflight = _InFlight()

    def finalize(self) -> None:
        """End of one sync (verl calls it after every sync): close what is per sync. Resources a
        transport keeps for the next sync (see :meth:`_end_sync`) stay; a failed sync already freed
        everything."""
        self._safe_end_sync()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        self.rank = None

    def release(self) -> None:
        """Free everything now, including what a transport keeps between syncs (idempotent)."""
        self.finalize()
        self._safe_close()

    def _end_sync(self) -> None:
        """What ``finalize`` closes; default: everything (:meth:`_close`). A transport that keeps
        buffers from sync to sync overrides this to close only its per-sync endpoints."""
        self._close()

    def _safe_end_sync(self) -> None:
        try:
            self._end_sync()
        except Exception:  # pragma: no cover - cleanup is best effort
            pass

    def _safe_close(self) -> None:
        try:
            self._close()
        except Exception:  # pragma: no cover - cleanup is best effort
            pass

    @abstractmethod
    def _connect(self, **kwargs: Any) -> None: ...

    @abstractmethod
    def _close(self) -> None: ...

    @property
    def last_stats(self) -> TransferStats | None:
        return self._stats

    @property
    def receivers(self) -> int:
        return self.world_size - 1

    def _buffer_bytes(self) -> int:
        """Bytes of bucket buffers this side allocated (default: two buckets)."""
        return 2 * self.bucket_size

    def _timeout_error(self, peer: str, detail: str = "") -> TransportTimeoutError:
        extra = f" ({detail})" if detail else ""
        return TransportTimeoutError(
            f"{self.name} transport, {self.role} rank {self.rank}: timed out after "
            f"{self.options.timeout_s:g}s waiting for {peer}{extra}; {self.inflight.describe()}"
        )

    def _abort_error(self, peer: str, reason: str) -> PeerAbortedError:
        return PeerAbortedError(
            f"{self.name} transport, {self.role} rank {self.rank}: {peer} aborted the sync: {reason}; "
            f"{self.inflight.describe()}"
        )

    # -- sender ------------------------------------------------------------------------------

    @abstractmethod
    def _sender_buffer(self, slot: int) -> torch.Tensor: ...

    @abstractmethod
    def _wait_slot_free(self, slot: int) -> None:
        """Block (at most ``timeout_s``) until every receiver is done with ``slot``."""

    @abstractmethod
    def _post_bucket(self, slot: int, message: BucketReady) -> None:
        """Start moving the packed bucket in ``slot`` to every receiver."""

    @abstractmethod
    def _post_end(self, message: SyncEnd) -> None: ...

    @abstractmethod
    def _post_abort(self, message: Abort) -> None:
        """Best effort: tell the receivers this sync failed (must not block past the timeout)."""

    def _device_sync(self, buffer: torch.Tensor) -> None:
        """Make device copies into/out of ``buffer`` complete before it is handed over."""
        synchronize_device(buffer.device)

    async def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
        *,
        align: AlignSpec = None,
    ) -> TransferStats:
        if self.rank is None or self.rank != SENDER_RANK:
            raise TransportError(
                f"{self.name} transport: send() on rank {self.rank}; only trainer rank 0 sends "
                "(call init_process_group first)"
            )
        stats = TransferStats(role="sender", bucket_size=self.bucket_size, buffer_bytes=self._buffer_bytes())
        stats.peak_extra_bytes = stats.buffer_bytes
        self._stats = stats
        sync_id = uuid.uuid4().hex
        tensors: set[int] = set()
        start = time.perf_counter()

        def acquire(index: int) -> torch.Tensor:
            slot = index % 2
            self.inflight.phase = "wait-slot-free"
            self.inflight.bucket = index
            self._wait_slot_free(slot)
            self.inflight.phase = "pack"
            return self._sender_buffer(slot)

        def ship(bucket: Bucket) -> None:
            assert bucket.buffer is not None
            buffer = bucket.buffer
            metas: list[ChunkMeta] = bucket.metas
            if self.options.verify:
                metas = [
                    msgspec.structs.replace(
                        m,
                        checksum=chunk_checksum(buffer[m.bucket_offset : m.bucket_offset + m.chunk_size]),
                    )
                    for m in metas
                ]
            self.inflight.phase = "post-bucket"
            self.inflight.bucket = bucket.index
            self._post_bucket(
                bucket.index % 2,
                BucketReady(
                    sync_id=sync_id,
                    bucket_index=bucket.index,
                    slot=bucket.index % 2,
                    nbytes=bucket.nbytes,
                    chunks=metas,
                ),
            )
            stats.buckets += 1
            stats.chunks += len(metas)
            stats.bytes += sum(m.chunk_size for m in metas)
            tensors.update(m.tensor_index for m in metas)
            if metas:
                self.inflight.last_tensor = metas[-1].name
            self.inflight.phase = "pack"

        planner = BucketPlanner(self.bucket_size, align=align, acquire=acquire, on_full=ship)
        self.inflight = _InFlight(phase="pack", bucket=0)
        try:
            async for item in _aiter(named_tensors):
                name, tensor = unpack_item(item)
                del item
                self.inflight.tensor = name if isinstance(name, str) else None
                planner.add(name, tensor)
                del tensor  # the bytes are ours now: keep nothing of the producer's
                self.inflight.last_tensor, self.inflight.tensor = self.inflight.tensor, None
            planner.finish()
            self.inflight = _InFlight(phase="drain", last_tensor=self.inflight.last_tensor)
            for slot in (0, 1):
                self._wait_slot_free(slot)
            stats.tensors = len(tensors)
            self.inflight.phase = "end"
            self._post_end(
                SyncEnd(
                    sync_id=sync_id,
                    num_buckets=stats.buckets,
                    num_tensors=stats.tensors,
                    total_bytes=stats.bytes,
                )
            )
        except BaseException as exc:
            try:
                self._post_abort(Abort(reason=f"{type(exc).__name__}: {exc}", rank=self.rank))
            finally:
                self._safe_close()
            raise
        stats.seconds = time.perf_counter() - start
        self.inflight = _InFlight()
        return stats

    # -- receiver ----------------------------------------------------------------------------

    @abstractmethod
    def _receiver_buffer(self, slot: int) -> torch.Tensor: ...

    @abstractmethod
    def _recv_next(self) -> BucketReady | SyncEnd:
        """Block (at most ``timeout_s``) for the next bucket (data in its slot) or the end.
        Raises :class:`PeerAbortedError` on an :class:`Abort`."""

    @abstractmethod
    def _release_slot(self, slot: int, bucket_index: int) -> None:
        """The consumer is done with ``slot``; tell the sender if it needs to know."""

    def _receive_done(self) -> None:
        """Hook run after the end message (e.g. a final ack)."""

    def _interrupt_receive(self) -> bool:
        """Make a running :meth:`_recv_next` return promptly (it may raise); True when supported.
        Called on the receive error path so that no handle is closed while the worker thread uses it."""
        return False

    def _destination_allocator(self) -> Allocate | None:
        """Where received tensors are allocated (``None``: ``torch.empty``)."""
        return None

    async def receive(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        if self.rank is None or self.rank < 1:
            raise TransportError(
                f"{self.name} transport: receive() on rank {self.rank}; only rollout ranks receive "
                "(call init_process_group first)"
            )
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fastsync-{self.name}")
        loop = asyncio.get_running_loop()
        assembler = Assembler(
            self.options.device,
            zero_copy=self.options.zero_copy,
            verify=self.options.verify,
            allocate=self._destination_allocator(),
        )
        stats = TransferStats(
            role="receiver", bucket_size=self.bucket_size, buffer_bytes=self._buffer_bytes()
        )
        self._stats = stats
        start = time.perf_counter()
        executor = self._executor
        pending: concurrent.futures.Future[BucketReady | SyncEnd] | None = None
        expected = 0
        try:
            self.inflight = _InFlight(phase="wait-bucket", bucket=0)
            pending = executor.submit(self._recv_next)
            while True:
                message = await asyncio.wrap_future(pending, loop=loop)
                pending = None
                if isinstance(message, SyncEnd):
                    self.inflight.phase = "end"
                    assembler.finish()
                    if (message.num_buckets, message.num_tensors, message.total_bytes) != (
                        stats.buckets,
                        assembler.num_tensors,
                        stats.bytes,
                    ):
                        raise TransportError(
                            f"{self.name} transport, rollout rank {self.rank}: sender reports "
                            f"{message.num_buckets} buckets / {message.num_tensors} tensors / "
                            f"{message.total_bytes} bytes, received {stats.buckets} / "
                            f"{assembler.num_tensors} / {stats.bytes}"
                        )
                    self._receive_done()
                    break
                if message.bucket_index != expected:
                    raise TransportError(
                        f"{self.name} transport, rollout rank {self.rank}: expected bucket {expected}, "
                        f"got bucket {message.bucket_index}"
                    )
                expected += 1
                if self.prefetch:
                    self.inflight.bucket = message.bucket_index + 1
                    pending = executor.submit(self._recv_next)
                buffer = self._receiver_buffer(message.slot)
                self._device_sync(buffer)
                self.inflight.phase = "assemble"
                self.inflight.bucket = message.bucket_index
                for meta, data in bucket_chunk_views(buffer[: message.nbytes], message.chunks):
                    self.inflight.tensor = meta.name
                    stats.chunks += 1
                    stats.bytes += meta.chunk_size
                    completed = assembler.feed(meta, data)
                    while completed:
                        item = completed.pop()
                        self.inflight.tensor = None
                        self.inflight.last_tensor = item[0]
                        self.inflight.phase = "consumer"
                        yield item
                        # drop our reference: the consumer alone decides how long a tensor lives
                        del item
                        self.inflight.phase = "assemble"
                    if assembler.incomplete:
                        self.inflight.tensor = assembler.incomplete[0]
                stats.buckets += 1
                stats.peak_extra_bytes = stats.buffer_bytes + assembler.peak_in_progress_bytes
                self._device_sync(buffer)  # non-blocking copies out of the slot are done
                self._release_slot(message.slot, message.bucket_index)
                if pending is None:
                    self.inflight.phase = "wait-bucket"
                    self.inflight.bucket = expected
                    pending = executor.submit(self._recv_next)
                else:
                    self.inflight.phase = "wait-bucket"
        except BaseException as exc:
            try:
                self._post_abort(Abort(reason=f"{type(exc).__name__}: {exc}", rank=self.rank))
            except Exception:  # pragma: no cover - best effort
                pass
            if pending is not None and not pending.cancel():
                # _recv_next is running on the worker thread: stop it before its handles close
                if self._interrupt_receive():
                    concurrent.futures.wait([pending], timeout=self.options.timeout_s)
            self._safe_close()
            raise
        stats.tensors = assembler.num_tensors
        stats.seconds = time.perf_counter() - start
        stats.peak_extra_bytes = stats.buffer_bytes + assembler.peak_in_progress_bytes
        self.inflight = _InFlight()


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


async def _aiter(items: Iterable[Any] | AsyncIterable[Any]) -> AsyncGenerator[Any, None]:
    """One async iterator over a sync or async iterable that holds no reference to an item once the
    consumer asks for the next one."""
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
            del item
    else:
        for item in items:
            yield item
            del item
