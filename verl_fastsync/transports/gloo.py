"""``gloo`` engine transport: torch.distributed Gloo on CPU, across processes or hosts.

Trainer rank 0 hosts a ``TCPStore`` (opened in :meth:`prepare`, port chosen by the OS) and every
participant builds a private ``ProcessGroupGloo`` on it in :meth:`init_process_group` (a separate
group: verl's own default process group is never touched). Per bucket, rank 0 broadcasts a fixed
``int64`` header (magic, wire version, kind, metadata length, payload bytes), the msgpack-encoded
:class:`~verl_fastsync.wire.BucketReady` and the payload; the three broadcasts of bucket ``k`` are in
flight while bucket ``k+1`` is packed into the other buffer (two bucket buffers per side). Receivers
prefetch bucket ``k+1`` into their other buffer while their consumer handles bucket ``k``.

Across hosts the data path uses ``options.host`` (default: the address of this host's name); the
store listens on the machine's interfaces while the sender keeps it (see below).

**Lifetime: the store, the group and the bucket buffers live as long as the transport**, not one
sync (building them cost 0.1-0.4 s per sync, as much as moving a 256 MiB bucket). ``finalize`` ends
the sync only; the next sync reuses them while the peers are the same:

* Group *epoch*: every group is built under ``PrefixStore("fastsync-gloo/<epoch>")`` with an epoch
  id that names it. :meth:`prepare` reports what this process holds (``gloo_group``: ``[epoch, rank,
  world_size]`` of a healthy group, else ``None``) and trainer rank 0 also a fresh id
  (``gloo_next``) and the address of the store it keeps. :meth:`build_topology` (the driver) hands
  every rank one ``gloo_group``: the sender's epoch when *every* participant reported that same
  group with the rank and world size it gets now, else the fresh id. A rank reuses its group only if
  its epoch equals the one handed out (and the store address, rank, world size and data host are
  unchanged); otherwise it aborts its group and builds the new one. The decision is a function of
  the metadata every rank was handed, so both sides agree without a handshake: a receiver that
  restarted, failed its last sync, joined anew, or left its last sync unfinished (a peer's
  broadcasts may still be unread in its sockets) reports no group, and then everybody rebuilds.
* A stale topology (a restarted process handed an old epoch) cannot hang gloo's rendezvous: a rank
  claims ``(epoch, rank)`` on the store first and fails at once when it was already built. Then every
  rank waits on the store until all are in, or one that cannot join published why (it fails at once).
* Bucket buffers are reused while this side's bucket size is unchanged (the caller may overwrite it
  after :meth:`build_topology`, so it never takes part in the group decision).
* A failed sync (any error in ``send``/``receive``/``init_process_group``), a sync left unfinished
  (works still posted, no end seen) or :meth:`~GlooTransport.release` closes the group and drops the
  store and the buffers; the next :meth:`prepare` of trainer rank 0 opens a new store and everybody
  builds a new group.

**Failures** (:mod:`~verl_fastsync.transports.gloo_abort`): a failing rank publishes its cause on the
group's abort channel (the first cause wins) and shuts down the group's connections; every wait goes
in slices of 0.1 s and reads the channel between them. So one rank's failure ends the sync on every
rank at once with the first cause (a rank that sees a connection close first looks for its peer's
cause, up to half a second), a failed side frees its threads, sockets and buffers at once, and
``timeout_s`` is only for a peer gone silent.
* Cost between syncs: two buckets per side (a lending receiver's spare too), the group (let go of
  by a side a sync does not use: ``let_go_of_peers``), the store.

Receivers lend (:mod:`verl_fastsync.io.lending`): a tensor carried whole in one chunk is a view into
the receive buffer; a buffer the consumer still references stays with it while the slot takes a spare.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
import uuid
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from verl_fastsync.transports.base import TransportError, allocate_bucket_buffers, default_host
from verl_fastsync.transports.buffered import BufferedTransport
from verl_fastsync.transports.gloo_abort import (
    AbortChannel,
    GroupSockets,
    create_devices,
    frames_cleared_on_error,
    join_barrier,
    let_go_later,
    publish_join_abort,
)
from verl_fastsync.transports.gloo_topology import topology_extra
from verl_fastsync.wire import (
    WIRE_SCHEMA_VERSION,
    Abort,
    BucketReady,
    Message,
    SyncEnd,
    WireVersionError,
    decode,
    encode,
)

__all__ = ["GlooTransport"]

_MAGIC = 0x46535943  # "FSYC"
_KIND_BUCKET, _KIND_END, _KIND_ABORT = 1, 2, 3
_HEADER = 5  # magic, version, kind, meta length, payload bytes
_DEVICES, _PARTS, _MIN_PART = 2, 4, 1 << 20
_MIN_WAIT_S = 0.01  # a zero timedelta means "no timeout" to Work.wait: never pass less than this
_POLL_S = 0.1  # a blocked wait reads the abort channel this often (a broadcast that ends sooner: no cost)
_CAUSE_GRACE_S = 0.5  # how long a rank that saw a connection close looks for its peer's cause
_PREFIX = "fastsync-gloo"


def _parts(payload: torch.Tensor) -> list[torch.Tensor]:
    """The payload cut into up to ``_PARTS`` pieces of at least 1 MiB (same cut on every rank)."""
    n = payload.numel()
    count = max(1, min(_PARTS, n // _MIN_PART))
    step = -(-n // count)
    return [payload[i : i + step] for i in range(0, n, step)]


class GlooTransport(BufferedTransport):
    """Gloo broadcast engine transport (see module docstring)."""

    name: ClassVar[str] = "gloo"
    prefetch: ClassVar[bool] = True
    one_copy_per_host: ClassVar[bool] = True
    lends = True  # receive buffers are private: a slot whose buffer is on loan just takes another

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._store: Any = None
        self._pg: Any = None
        self._bufs: list[torch.Tensor] = []
        self._slot_works: list[list[Any]] = [[], []]
        self._keep: list[list[torch.Tensor]] = [[], []]
        self._peer = "?"
        self._store_addr = ""
        # (epoch, rank, world size, store address, store port, data host) of the group in self._pg
        self._key: tuple[str, int, int, str, int, str] | None = None
        self._mid_sync = False  # broadcasts posted and the sync's end not yet reached
        self._channel: AbortChannel | None = None  # the group's abort channel (gloo_abort)
        self._sockets = GroupSockets({})
        self._stop = threading.Event()  # set: the receive thread of this group gives up at once
        self._synced = False  # a whole sync (to its end) ran on the group since init_process_group
        self.groups_built = 0  # process groups built (for tests and figures: reuse keeps it constant)
        self.buffers_allocated = 0  # times this transport allocated its two bucket buffers

    @property
    def group_epoch(self) -> str | None:
        """Epoch of the group this transport holds (``None``: none)."""
        return None if self._key is None else self._key[0]

    def _group_state(self) -> list[Any] | None:
        """``[epoch, rank, world_size]`` of a healthy group this side can reuse, else ``None``."""
        if self._pg is None or self._key is None or self._unclean() or not self._synced:
            return None
        return [self._key[0], self._key[1], self._key[2]]

    def _unclean(self) -> bool:
        """The last sync did not end cleanly: broadcasts may still be posted on the group."""
        return self._mid_sync or any(self._slot_works)

    def _td(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.options.timeout_s)

    def _deadline(self) -> float:
        """``timeout_s`` from now, on the monotonic clock: one budget shared by a group of waits."""
        return time.monotonic() + float(self.options.timeout_s)

    def prepare(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"transport": self.name, "host": socket.gethostname()}
        if self._unclean():
            self._close()  # the previous sync was left half-way: nothing of it can be reused
        if self.options.is_master:
            if self._store is None:
                self._close()  # a group without its store is gone too
                addr = self.options.host or default_host()
                self._store = dist.TCPStore(addr, 0, None, True, self._td(), wait_for_workers=False)
                self._store_addr = addr
            meta.update(addr=self._store_addr, port=int(self._store.port), gloo_next=uuid.uuid4().hex)
        meta["gloo_group"] = self._group_state()
        return meta

    @classmethod
    def _topology_extra(
        cls, actor_metadata: list[dict[str, Any]], rollout_metadata: list[dict[str, Any]]
    ) -> dict[str, Any]:
        return topology_extra(actor_metadata, rollout_metadata)

    def _connect(self, **kwargs: Any) -> None:
        addr, port = str(kwargs["master_addr"]), int(kwargs["master_port"])
        group = kwargs.get("gloo_group")
        if not group:
            raise TransportError(
                "gloo transport: init_process_group needs gloo_group (use GlooTransport.build_topology)"
            )
        self._peer = f"{self.label(0)} at {addr}:{port}"
        self.inflight.phase = "connect"
        if self._unclean():
            self._close()  # never reuse a group with broadcasts of an unfinished sync on it
        rank = int(self.rank or 0)
        host = str(kwargs.get("data_host") or "")
        key = (str(group), rank, self.world_size, addr, port, host)
        if self._pg is None or self._key != key:
            self._build_group(key)
        if len(self._bufs) != 2 or any(buf.numel() != self.bucket_size for buf in self._bufs):
            self._bufs = []
            self._drop_lending_pool()
            self._bufs = allocate_bucket_buffers(self.bucket_size)
            self.buffers_allocated += 1
        self._slot_works = [[], []]
        self._keep = [[], []]
        self._mid_sync = False
        self._synced = False

    def _build_group(self, key: tuple[str, int, int, str, int, str]) -> None:
        epoch, rank, _, addr, port, host = key
        self._drop_group()
        try:
            if rank != 0:
                self._store = None
                self._store = dist.TCPStore(addr, port, None, False, self._td())
            elif self._store is None:
                raise TransportError("gloo transport: init_process_group on trainer rank 0 before prepare()")
            if int(self._store.add(f"{_PREFIX}-claims/{epoch}/{rank}", 1)) != 1:
                raise TransportError(
                    f"{self.me}: group {epoch} was already built with this rank (transfer rank "
                    f"{rank}: this process restarted or was handed a stale topology); call "
                    "prepare() on every rank and build_topology again"
                )
            # a rank that cannot join publishes why instead of coming (see gloo_abort.join_barrier)
            channel = AbortChannel(self._store, f"{_PREFIX}-abort/{epoch}")
            cause, joined = join_barrier(
                channel, f"{_PREFIX}-joined/{epoch}", self.world_size, self._deadline()
            )
            if cause is not None:
                raise self._abort_error(self.label(cause.rank), cause.reason)
            if joined < self.world_size:
                raise self._timeout_error(f"every rank to join ({joined} of {self.world_size} did)")
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = self._td()
            # two connections per peer and the payload broadcast in parts: gloo then moves the parts
            # on several threads/sockets at once (measured ~1.7x one 64 MiB broadcast on loopback)
            # across hosts each rank binds the address of its own host name (torch's default device)
            opts._devices, listeners = create_devices(
                (lambda: dist.ProcessGroupGloo.create_device(hostname=host))
                if host
                else dist.ProcessGroupGloo.create_default_device,
                _DEVICES,
            )
            opts._threads = 2 * _PARTS
            sockets_key = f"{_PREFIX}-sockets/{epoch}"
            GroupSockets.publish_listeners(self._store, sockets_key, rank, listeners)
            self._pg = dist.ProcessGroupGloo(
                dist.PrefixStore(f"{_PREFIX}/{epoch}", self._store), rank, self.world_size, opts
            )
            self._sockets = GroupSockets.exchange(
                self._store, sockets_key, rank, self.world_size, listeners, self.options.timeout_s
            )
        except TransportError:
            raise
        except RuntimeError as exc:
            raise self._wrap(exc, "the process group (all ranks)") from exc
        self._channel = channel
        self._stop = threading.Event()
        self._key = key
        self.groups_built += 1

    def _abort_join(self, reason: str, kwargs: dict[str, Any]) -> None:
        """Publish ``reason`` on the abort channel of the group the others wait to join (the barrier)."""
        publish_join_abort(kwargs, f"{_PREFIX}-abort/{kwargs['gloo_group']}", reason)

    def _drop_group(self) -> None:
        """Close the group (the store stays).

        gloo's ``abort()`` closes nothing: the group's connections are shut down here (see
        :mod:`~verl_fastsync.transports.gloo_abort`), which fails every broadcast posted on it at once,
        here and on the peers, and frees gloo's threads; a receive thread of this group stops at its
        next wait slice. The group's destructor joins gloo's threads: the last reference is still let
        go on a short-lived daemon thread, never on the caller's (the event loop's) thread."""
        held = [self._pg]  # the group's only reference from here on (see let_go_later)
        self._pg = None
        self._key = None
        self._channel = None  # it holds the store (on a receiver, its connection to trainer rank 0)
        self._stop.set()
        sockets, self._sockets = self._sockets, GroupSockets({})
        try:
            sockets.shutdown()
        except Exception:  # pragma: no cover - best effort: /proc unreadable
            pass
        if held[0] is not None:
            let_go_later(held)

    def let_go_of_peers(self) -> None:  # a kept group holds a connection to each of its ranks
        self._drop_group()

    def _end_sync(self) -> None:
        """``finalize``: a sync that ended cleanly keeps the group, the store and the buffers for the
        next one; one left half-way (broadcasts still posted) frees everything."""
        if self._unclean():
            self._close()
            return
        self._slot_works = [[], []]
        self._keep = [[], []]

    def _close(self) -> None:
        self._slot_works = [[], []]  # before the group: a work may be what keeps it alive
        self._keep = [[], []]
        self._drop_group()
        server = bool(self._store_addr)
        held, self._store = [self._store], None
        if held[0] is not None:  # the peers read a cause there a moment longer
            let_go_later(held, _CAUSE_GRACE_S if server else 0.0)
        self._store_addr = ""
        self._bufs = []
        self._drop_lending_pool()
        self._mid_sync = False
        self._synced = False

    def _wrap(self, exc: BaseException, peer: str, channel: AbortChannel | None = None) -> TransportError:
        """The error for a failed gloo call: the group's first cause when a rank published one (a
        failing rank publishes before it closes the sockets whose closing failed this call)."""
        text = str(exc)
        first = text.splitlines()[0] if text else ""
        timed_out = "imed out" in text or "timeout" in text.lower()
        # a closed connection is a symptom: the rank that closed it publishes its cause just before
        # (or, with several lanes closing at once, just after); a killed process never does
        # (this side's own cause standing: its own closing failed this call)
        deadline = time.monotonic() + (0.0 if timed_out else _CAUSE_GRACE_S)
        while True:
            aborted, stands = self._read_cause(channel or self._channel)
            if aborted is not None:
                return aborted
            if stands or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if timed_out:
            return self._timeout_error(peer, first)
        rank = self._sockets.rank_of(first)
        if rank is not None:
            peer = f"{peer} (the connection to {self.label(rank)} closed)"
        return TransportError(
            f"{self.me}: {type(exc).__name__} talking to {peer}: {first}; {self.inflight.describe()}"
        )

    def _published(self, channel: AbortChannel | None) -> TransportError | None:
        return self._read_cause(channel)[0]

    def _read_cause(self, channel: AbortChannel | None) -> tuple[TransportError | None, bool]:
        """(The cause another rank published on the group's abort channel, as this side's error;
        whether any cause stands, this side's own included)."""
        if channel is None:
            return None, False
        try:
            message = channel.read()
        except Exception as exc:  # the store lives in trainer rank 0's process
            return TransportError(
                f"{self.me}: lost {self.label(0)}: the group's store stopped answering "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                f"{self.inflight.describe()}"
            ), False
        if message is None or message.rank == self.rank:
            return None, message is not None
        return self._abort_error(self.label(message.rank), message.reason), True

    def _broadcast(self, tensor: torch.Tensor, group: Any = None) -> Any:
        """Post one broadcast on ``group`` (default: the current one); gloo gives up after ``timeout_s``."""
        pg = self._pg if group is None else group
        if pg is None:
            raise TransportError(f"{self.me}: the group was closed")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self._td()
        return pg.broadcast([tensor], opts)

    def _wait(
        self,
        work: Any,
        peer: str,
        deadline: float,
        channel: AbortChannel | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """Wait for ``work`` until ``deadline`` (:func:`time.monotonic`, a budget shared with the
        other waits of the group) in slices of ``_POLL_S`` (an expired ``Work.wait`` leaves the
        broadcast running), reading the group's abort channel and ``stop`` between slices."""
        channel = channel or self._channel
        stop = stop or self._stop
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and not work.is_completed():
                raise self._published(channel) or self._timeout_error(peer)
            try:
                if work.wait(datetime.timedelta(seconds=max(min(remaining, _POLL_S), _MIN_WAIT_S))):
                    return
            except RuntimeError as exc:
                if "Operation timed out" not in str(exc):
                    raise self._wrap(exc, peer, channel) from exc
            if stop.is_set():
                raise TransportError(f"{self.me}: this side closed the group (its sync failed)")
            aborted = self._published(channel)
            if aborted is not None:
                raise aborted

    # -- sender ------------------------------------------------------------------------------

    def _sender_buffer(self, slot: int) -> torch.Tensor:
        return self._bufs[slot]

    def _wait_slot_free(self, slot: int, deadline: float | None = None) -> None:
        """Every broadcast of ``slot`` done by ``deadline`` (default: ``timeout_s`` from now, one
        budget for all of the slot's works, not one per work)."""
        if deadline is None:
            deadline = self._deadline()
        for work in self._slot_works[slot]:
            self._wait(work, "rollout ranks", deadline)
        self._slot_works[slot] = []
        self._keep[slot] = []

    def _post(self, slot: int, kind: int, message: Message, payload: torch.Tensor | None) -> None:
        meta = torch.frombuffer(bytearray(encode(message)), dtype=torch.uint8)
        nbytes = 0 if payload is None else payload.numel()
        header = torch.tensor([_MAGIC, WIRE_SCHEMA_VERSION, kind, meta.numel(), nbytes], dtype=torch.int64)
        self._mid_sync = True
        works = [self._broadcast(header), self._broadcast(meta)]
        if payload is not None and nbytes:
            works.extend(self._broadcast(part) for part in _parts(payload))
        self._slot_works[slot] = works
        self._keep[slot] = [header, meta]

    def _post_bucket(self, slot: int, message: BucketReady) -> None:
        self._post(slot, _KIND_BUCKET, message, self._bufs[slot][: message.nbytes])

    def _post_end(self, message: SyncEnd) -> None:
        self._post(0, _KIND_END, message, None)
        self._wait_slot_free(0)
        self._mid_sync = False  # every broadcast of this sync is done: the group is clean
        self._synced = True

    def _post_abort(self, message: Abort) -> None:
        """Publish this side's cause on the group's abort channel (the first cause wins) before the
        group is closed: every rank, blocked in a broadcast or failing when the sockets close, reads
        it there. Nothing is broadcast: the group is failing, and a broadcast may wait."""
        channel = self._channel
        if channel is None or self._key is None:
            return
        try:
            channel.publish(message)
        except Exception:  # pragma: no cover - the store is gone: the closing sockets tell the peers
            pass

    def _interrupt_receive(self) -> bool:
        """Closing the sockets fails the receive thread's broadcast at once (it frees the bucket)."""
        self._drop_group()
        return True

    # -- receiver ----------------------------------------------------------------------------

    def _receiver_buffer(self, slot: int) -> torch.Tensor:
        if slot not in (0, 1):
            raise TransportError(f"gloo transport: sender named slot {slot}; only 0 and 1 exist")
        return self._bufs[slot]

    @frames_cleared_on_error  # the failure kept in a future must not keep the group (let_go_later)
    def _recv_next(self) -> BucketReady | SyncEnd:
        # Every broadcast goes to the group this call started on: after a failure this thread may
        # still be blocked in it while the transport already belongs to the next sync's group.
        group, buffers = self._pg, self._bufs  # _close() replaces the list, a lending swap edits it
        watch = (self._channel, self._stop)  # this group's, whatever comes next
        if group is None:
            raise TransportError(f"{self.me}: the group was closed")
        self._mid_sync = True
        header = torch.zeros(_HEADER, dtype=torch.int64)
        self._wait(self._broadcast(header, group=group), self._peer, self._deadline(), *watch)
        magic, version, kind, meta_len, nbytes = (int(v) for v in header.tolist())
        if magic != _MAGIC:
            raise TransportError(f"{self.me}: bad header from {self._peer}: {header.tolist()}")
        if version != WIRE_SCHEMA_VERSION:
            raise WireVersionError(
                f"incompatible verl-fastsync wire schema: {self._peer} sent version {version}, "
                f"this side speaks version {WIRE_SCHEMA_VERSION}; "
                "install the same verl-fastsync on both sides"
            )
        deadline = self._deadline()  # the header is here: metadata and payload share one budget
        meta = torch.empty(meta_len, dtype=torch.uint8)
        self._wait(self._broadcast(meta, group=group), self._peer, deadline, *watch)
        message = decode(meta.numpy().tobytes(), peer=self._peer)
        if kind == _KIND_ABORT or isinstance(message, Abort):
            reason = message.reason if isinstance(message, Abort) else "?"
            raise self._abort_error(self._peer, reason)
        if isinstance(message, SyncEnd):
            if group is self._pg:
                self._mid_sync = False  # the sender posts nothing more this sync
                self._synced = True
            return message
        if not isinstance(message, BucketReady) or kind != _KIND_BUCKET:
            raise TransportError(f"{self.me}: unexpected {type(message).__name__} from {self._peer}")
        if message.nbytes != nbytes or not 0 <= nbytes <= self.bucket_size or message.slot not in (0, 1):
            raise TransportError(
                f"{self.me}: bucket {message.bucket_index} header says {nbytes} bytes in slot "
                f"{message.slot}, metadata {message.nbytes}; bucket size {self.bucket_size}"
            )
        if nbytes:
            payload = buffers[message.slot][:nbytes]
            works = [self._broadcast(part, group=group) for part in _parts(payload)]
            for work in works:
                self._wait(work, self._peer, deadline, *watch)
        return message

    def _swap_receive_buffer(self, slot: int, buffer: torch.Tensor) -> None:
        self._bufs[slot] = buffer  # the sender broadcasts; where a receiver lands it is its own affair

    def _release_slot(self, slot: int, bucket_index: int) -> None:
        """Nothing to tell: the next receive into this slot is only posted after this call."""
