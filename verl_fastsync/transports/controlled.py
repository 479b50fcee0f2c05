"""The zmq control protocol shared by the ``shm``, ``nixl`` and ``nccl`` engine transports.

:class:`ControlledTransport` is a :class:`~verl_fastsync.transports.buffered.BufferedTransport` whose
control messages (:mod:`verl_fastsync.wire`) travel over one
:class:`~verl_fastsync.io.control.ControlChannel`: trainer rank 0 binds a ROUTER in :meth:`prepare`
(``ipc://`` when :meth:`_control_host` is ``None``, else ``tcp://``), each rollout rank connects a
DEALER in ``init_process_group``.

* Handshake: every receiver sends :meth:`_hello_message` (``Hello``, or e.g. ``PeerBuffers``); once
  all receivers said hello the sender answers each with ``Welcome`` (:meth:`_welcome_buffers`), the
  receivers :meth:`_attach` and confirm ``Attached``; then :meth:`_all_attached` runs on the sender.
* Per bucket: the sender waits for every receiver's ``BucketAck`` of the bucket last held in the
  slot, packs, :meth:`_post_bucket` announces ``BucketReady``; receivers ack after their consumer
  moved on. ``SyncEnd`` ends a sync, ``Abort`` (either way) fails it with the reason.
* A failure anywhere ends the sync everywhere, with its first cause: a receiver that fails sends
  ``Abort`` (its reason, its rank) to the sender, which fails and relays that same ``Abort`` to every
  other receiver (:class:`~verl_fastsync.transports.base.PeerAbortedError`: the origin and cause
  travel unchanged, never wrapped in the relaying side's own text). A receiver on the sender's host
  whose process ends mid-sync (killed, crashed) is noticed by the sender within
  :data:`LIVENESS_S` (its ``Hello`` named its pid) and reported the same way. A peer on any host
  whose control connection closes mid-sync (its process died, its host left the network) is noticed
  at once by the socket monitor of :meth:`~verl_fastsync.io.control.ControlChannel.watch_peers`:
  the sender fails naming that rollout rank (and relays it), a receiver whose connection to the
  sender closed fails with "lost trainer rank 0". ``timeout_s`` is left for a peer that went silent
  with its connection open. The side that aborts
  lets its ``Abort`` out before its socket closes (:data:`ABORT_LINGER_MS`).

Subclasses supply the buffers: :meth:`_sender_setup`, :meth:`_attach`, :meth:`_release_buffers`,
:meth:`_sender_buffer`, :meth:`_receiver_buffer` (and may move data in :meth:`_post_bucket` /
:meth:`_recv_next`). The control channel lives for one sync (closed at ``finalize``); buffers may
live longer (:meth:`_end_sync` vs :meth:`_close`).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable
from typing import Any, ClassVar

import zmq

from verl_fastsync.io.control import DISCONNECT_GRACE_S, ControlChannel, PeerDisconnectedError
from verl_fastsync.transports.base import SENDER_RANK, PeerAbortedError, TransportError, TransportTimeoutError
from verl_fastsync.transports.buffered import BufferedTransport
from verl_fastsync.transports.control_join import answer_late_hellos, send_abort_once
from verl_fastsync.transports.sending import abort_for
from verl_fastsync.wire import (
    Abort,
    Attached,
    BucketAck,
    BucketReady,
    Hello,
    Message,
    SyncEnd,
    Welcome,
    decode,
    encode,
)

__all__ = ["ABORT_LINGER_MS", "LIVENESS_S", "MAX_SLOTS", "ControlledTransport", "process_ended"]

MAX_SLOTS = 4
"""The most slots a sender may pipeline over."""

LIVENESS_S = 0.1
"""How often a waiting sender checks that the receivers on its host are still alive (seconds)."""

ABORT_LINGER_MS = 300
"""How long closing the control channel after an ``Abort`` lets it out (zmq drops queued messages
of a socket closed with no linger: the reason would be lost and the peers would wait out
``timeout_s``)."""


def process_ended(pid: int) -> bool:
    """Whether process ``pid`` of this host is gone (a zombie, killed and not reaped yet, counts
    as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rpartition(")")[2].split()[:1]
    except FileNotFoundError:
        return True
    except OSError:  # pragma: no cover - no procfs: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    return state in (["Z"], ["X"])


class ControlledTransport(BufferedTransport):
    """Double-bucket transport with a zmq control channel (see the module docstring)."""

    name: ClassVar[str] = "?"
    progress_poll_s: ClassVar[float | None] = None
    """While waiting for a control message, call :meth:`_progress` about this often (seconds);
    ``None``: never. For transports whose data movement needs this side's help while it waits (NIXL
    without a progress thread), so that nothing needs a thread spinning between syncs."""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._channel: ControlChannel | None = None
        self._endpoint: str | None = None
        self._peers: dict[bytes, int] = {}  # zmq routing id -> rollout rank
        self._slot_bucket: list[int | None] = [None] * self.slots
        self._slot_acks: list[set[int]] = [set() for _ in range(self.slots)]
        self._peer_pids: dict[bytes, int] = {}  # sender: pid of each receiver on this host
        self._next_liveness = 0.0
        self._abort_posted = False  # close the channel with a linger (the Abort must get out)

    # -- what subclasses choose --------------------------------------------------------------

    def _control_host(self) -> str | None:
        """Address the sender binds its control socket on; ``None``: a private ``ipc://`` socket."""
        return None

    def _sender_setup(self) -> None:
        """Sender, in ``init_process_group`` before the handshake: make the bucket buffers."""

    def _welcome_buffers(self) -> list[str]:
        """Sender: transport-specific handles of its buffers, sent in ``Welcome``."""
        return []

    def _on_hello(self, ident: bytes, message: Message) -> bool:
        """Sender: record a receiver's introduction; False if ``message`` is not one."""
        if isinstance(message, Hello):
            self._peers[ident] = message.rank
            return True
        return False

    def _all_attached(self) -> None:
        """Sender: every receiver confirmed ``Attached``."""
        if self._channel is not None:
            self._channel.remove_socket_file()

    def _hello_message(self) -> Message:
        """Receiver: its introduction."""
        return Hello(rank=self.rank or 0, host=socket.gethostname(), pid=os.getpid())

    def _attach(self, welcome: Welcome) -> None:
        """Receiver: map/register the sender's buffers named in ``welcome``."""

    def _release_buffers(self) -> None:
        """Free this side's buffers (idempotent)."""

    # -- lifecycle ---------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"transport": self.name, "host": socket.gethostname()}
        if self.options.is_master:
            self._close_channel()
            self._channel = ControlChannel()
            self._endpoint = self._channel.bind(self._control_host())
            self._channel.watch_peers()
            meta["endpoint"] = self._endpoint
        return meta

    def _connect(self, **kwargs: Any) -> None:
        endpoint = kwargs.get("endpoint")
        if self.rank == 0:
            if self._channel is None:
                raise TransportError(
                    f"{self.name} transport: init_process_group on trainer rank 0 before prepare()"
                )
            try:
                self._sender_setup()
                self._handshake_sender()
            except BaseException as exc:
                self._abort_handshake(exc)
                raise
        else:
            if not endpoint:
                raise TransportError(f"{self.name} transport: init_process_group needs the sender's endpoint")
            self._close_channel()
            self._channel = ControlChannel()
            self._channel.connect(endpoint)
            self._channel.watch_peers()
            self._endpoint = endpoint
            self._handshake_receiver()

    def _close_channel(self) -> None:
        channel, self._channel = self._channel, None
        linger, self._abort_posted = (ABORT_LINGER_MS if self._abort_posted else None), False
        if channel is not None:
            channel.close(linger_ms=linger)
        self._peers = {}
        self._peer_pids = {}
        self._reset_slots()

    def _reset_slots(self) -> None:
        self._slot_bucket = [None] * self.slots
        self._slot_acks = [set() for _ in range(self.slots)]

    def _close(self) -> None:
        self._release_buffers()
        self._close_channel()

    # -- messages ----------------------------------------------------------------------------

    def _deadline(self) -> float:
        return time.monotonic() + self.options.timeout_s

    def _recv_msg(self, deadline: float, peer: str, detail: str = "") -> tuple[bytes | None, Message]:
        if self._channel is None:
            raise TransportError(f"{self.me}: control channel closed; {self.inflight.describe()}")
        got = self._recv_progressing(self._channel, deadline)
        if got is None:
            raise self._timeout_error(peer, detail)
        ident, data = got
        message = decode(data, peer=peer)
        if isinstance(message, Abort):
            raise self._aborted(ident, message)
        return ident, message

    def _aborted(self, ident: bytes | None, message: Abort) -> PeerAbortedError:
        """The error of an ``Abort`` from ``ident``: it names the rank where the sync failed first
        (``Abort.rank``, which a relaying sender keeps) and that rank's reason."""
        origin = message.rank
        if origin is None:
            origin = SENDER_RANK if ident is None else self._peers.get(ident)
        who = self.label(origin) if origin is not None else "a rollout rank"
        return PeerAbortedError(str(self._abort_error(who, message.reason)), origin, message.reason)

    def _recv_progressing(
        self, channel: ControlChannel, deadline: float
    ) -> tuple[bytes | None, bytes] | None:
        try:
            return self._recv_watching(channel, deadline)
        except PeerDisconnectedError as exc:
            raise self._disconnected(exc) from None

    def _recv_watching(self, channel: ControlChannel, deadline: float) -> tuple[bytes | None, bytes] | None:
        poll = self.progress_poll_s
        watch = bool(self._peer_pids)
        if poll is None and not watch:
            return channel.recv(deadline)
        step = min(poll if poll is not None else LIVENESS_S, LIVENESS_S)
        while True:
            got = channel.recv(min(deadline, time.monotonic() + step))
            if got is not None or time.monotonic() >= deadline:
                return got
            if poll is not None:
                self._progress()
            self._check_peers_alive()

    def _disconnected(self, exc: PeerDisconnectedError) -> PeerAbortedError:
        """The error of a control connection that closed mid-sync: on the sender, the first rollout
        rank lost (the cause it relays to the others); on a receiver, the sender."""
        if self.rank == SENDER_RANK:
            origin = next((self._peers.get(ident) for ident in exc.peers if ident is not None), None)
            who = self.label(origin) if origin is not None else "a rollout rank"
            cause = (
                f"its connection to {self.label(SENDER_RANK)} closed mid-sync (process died or network lost)"
            )
            return PeerAbortedError(
                f"{self.me}: {who} failed: {cause}; {self.inflight.describe()}", origin, cause
            )
        cause = "its connection closed mid-sync (process died or network lost)"
        return PeerAbortedError(
            f"{self.me}: lost {self.label(SENDER_RANK)}: {cause}; {self.inflight.describe()}",
            SENDER_RANK,
            cause,
        )

    def _labels(self, ranks: Iterable[int | None]) -> str:
        """verl's names of transfer ranks ``ranks``, in rank order ("rollout rank 0, rollout rank 3")."""
        return ", ".join(self.label(rank) for rank in sorted(r for r in ranks if r is not None)) or "none"

    def _record_pid(self, ident: bytes, message: Message) -> None:
        """Sender: remember the pid of a receiver on this host (from its introduction)."""
        pid, host = getattr(message, "pid", 0), getattr(message, "host", "")
        if pid and host == socket.gethostname():
            self._peer_pids[ident] = int(pid)

    def _check_peers_alive(self, force: bool = False) -> None:
        """Sender: fail the sync naming a receiver on this host whose process ended (checked at
        most every :data:`LIVENESS_S` unless ``force``)."""
        now = time.monotonic()
        if not self._peer_pids or (not force and now < self._next_liveness):
            return
        self._next_liveness = now + LIVENESS_S
        for ident, pid in self._peer_pids.items():
            if process_ended(pid):
                origin = self._peers.get(ident)
                cause = f"its process (pid {pid}) ended during the sync (killed or crashed)"
                raise PeerAbortedError(
                    f"{self.me}: {self.label(origin)} failed: {cause}; {self.inflight.describe()}",
                    origin,
                    cause,
                )

    def _progress(self) -> None:
        """Drive this side's part of a data movement (see :attr:`progress_poll_s`)."""

    def _send_to(self, ident: bytes | None, message: Message) -> None:
        if self._channel is None:
            raise TransportError(f"{self.me}: control channel closed; {self.inflight.describe()}")
        try:
            self._channel.send(encode(message), ident)
        except zmq.ZMQError as exc:
            # a peer that aborted sent its Abort before it closed: its reason, not "unreachable"
            self._raise_pending_abort()
            self._check_peers_alive(force=True)
            origin = SENDER_RANK if ident is None else self._peers.get(ident)
            cause = (
                f"its control connection closed: {exc} (it timed out or died before its reason could be read)"
            )
            raise PeerAbortedError(
                f"{self.me}: cannot send {type(message).__name__} to {self.label(origin)}: {cause}; "
                f"{self.inflight.describe()}",
                origin,
                cause,
            ) from exc

    def _handshake_sender(self) -> None:
        deadline = self._deadline()
        self.inflight.phase = "handshake"
        pending: list[bytes] = []
        while len(self._peers) < self.receivers:
            ident, message = self._recv_msg(
                deadline, "rollout ranks", f"hello from {self.receivers} receivers"
            )
            if self._on_hello(ident or b"", message):
                pending.append(ident or b"")
                self._record_pid(ident or b"", message)
        self._before_welcome()
        welcome = Welcome(
            bucket_size=self.bucket_size,
            buffers=self._welcome_buffers(),
            verify=self.options.verify,
            slots=self.slots,
        )
        for ident in pending:
            self._send_to(ident, welcome)
        attached: set[int] = set()
        while len(attached) < self.receivers:
            _, message = self._recv_msg(deadline, "rollout ranks", f"attach from {self.receivers} receivers")
            if isinstance(message, Attached):
                attached.add(message.rank)
        self._all_attached()

    def _abort_handshake(self, exc: BaseException) -> None:
        """Sender: its handshake failed with ``exc``: every receiver that said hello hears the first
        cause, and unless it timed out so do the hellos that still come (:func:`answer_late_hellos`)."""
        abort = abort_for(exc, self.rank, f"{type(exc).__name__}: {exc}")
        self._post_abort(abort)
        if self._channel is not None and not isinstance(exc, TransportTimeoutError):
            answer_late_hellos(self._channel, abort, {*self._peers.values(), abort.rank}, self.world_size)

    def _abort_join(self, reason: str, kwargs: dict[str, Any]) -> None:
        """Receiver that cannot join: tell the sender's handshake, on this rank's channel when it is
        connected there (the ``Abort`` then comes before its close), else on a short-lived one."""
        rank, endpoint = int(kwargs["rank"]), kwargs.get("endpoint")
        if rank == SENDER_RANK or not endpoint:
            return  # the sender relays its own failure (_abort_handshake)
        abort = Abort(reason=reason, rank=rank)
        if self._channel is not None and self._channel.is_open and self._endpoint == endpoint:
            self._abort_posted = self._channel.send_quietly(encode(abort)) or self._abort_posted
        else:
            send_abort_once(str(endpoint), abort, ABORT_LINGER_MS)

    def _before_welcome(self) -> None:
        """Sender: every receiver said hello (hook, e.g. to decide whether buffers can be reused)."""

    def _handshake_receiver(self) -> None:
        deadline = self._deadline()
        self.inflight.phase = "handshake"
        peer = f"{self.label(SENDER_RANK)} at {self._endpoint}"
        self._send_to(None, self._hello_message())
        _, message = self._recv_msg(deadline, peer, "welcome")
        if not isinstance(message, Welcome):
            raise TransportError(f"{self.me}: expected welcome from {peer}, got {type(message).__name__}")
        if message.bucket_size != self.bucket_size:
            raise TransportError(
                f"{self.me}: the sender's bucket_size {message.bucket_size} != this rank's {self.bucket_size}"
            )
        if message.verify != self.options.verify:
            raise TransportError(
                f"{self.me}: verify differs between {self.label(SENDER_RANK)} ({message.verify}) and "
                f"this rank ({self.options.verify}); set engine_kwargs.fastsync.verify the same everywhere"
            )
        if message.slots != self.slots:
            if not 2 <= message.slots <= MAX_SLOTS:
                raise TransportError(
                    f"{self.me}: the sender pipelines over {message.slots} slots; allowed: 2 to {MAX_SLOTS}"
                )
            self.slots = message.slots  # the sender's memory, the sender's choice
            self._reset_slots()
        self._attach(message)
        self._send_to(None, Attached(rank=self.rank or 0))

    # -- sender ------------------------------------------------------------------------------

    def _wait_slot_free(self, slot: int) -> None:
        bucket = self._slot_bucket[slot]
        if bucket is None:
            return
        deadline = self._deadline()
        while len(self._slot_acks[slot]) < self.receivers:
            missing = sorted(set(self._peers.values()) - self._slot_acks[slot])
            _, message = self._recv_msg(deadline, self._labels(missing), f"ack of bucket {bucket}")
            self._take_ack(message)
        self._slot_bucket[slot] = None

    def _take_ack(self, message: Message) -> None:
        """Sender: count ``message`` if it is an ack of the bucket now held in its slot."""
        if isinstance(message, BucketAck) and 0 <= message.slot < self.slots:
            if self._slot_bucket[message.slot] == message.bucket_index:
                self._slot_acks[message.slot].add(message.rank)
                self._on_ack(message)

    def _poll_control(self) -> None:
        """Inside a wait that is not for a control message (the sender's WRITE), or on a failure
        that may be a symptom of a peer's abort: read what the peers sent without blocking, so that
        an ``Abort`` fails the wait at once with the first failure's reason (raises
        :class:`~verl_fastsync.transports.base.PeerAbortedError`) and acks are not left unread.
        The sender also checks that its receivers are alive."""
        channel = self._channel
        if channel is None or not channel.is_open:
            return
        while (got := self._recv_nowait(channel)) is not None:
            ident, data = got
            who = self.label(self._peers.get(ident) if ident is not None else SENDER_RANK)
            message = decode(data, peer=who)
            if isinstance(message, Abort):
                raise self._aborted(ident, message)
            if self.rank == SENDER_RANK:
                self._take_ack(message)
        self._check_peers_alive()

    def _recv_nowait(self, channel: ControlChannel) -> tuple[bytes | None, bytes] | None:
        try:
            return channel.recv_nowait()
        except PeerDisconnectedError as exc:
            raise self._disconnected(exc) from None

    def _raise_pending_abort(self, grace_s: float = DISCONNECT_GRACE_S + 0.1) -> None:
        """A send found its peer gone: raise the :class:`PeerAbortedError` of an ``Abort`` it left,
        or of its closed connection, read for at most ``grace_s`` (the ``Abort`` precedes the
        disconnect on the same connection, but zmq may report the disconnect first; the disconnect
        is raised :data:`DISCONNECT_GRACE_S` after it was seen); return when there is neither."""
        end = time.monotonic() + grace_s
        while True:
            self._poll_control()
            if time.monotonic() >= end:
                return
            time.sleep(0.005)

    def _on_ack(self, message: BucketAck) -> None:
        """Sender: one receiver acked the bucket now in ``message.slot`` (hook, e.g. for lending)."""

    def _post_bucket(self, slot: int, message: BucketReady) -> None:
        self._slot_bucket[slot] = message.bucket_index
        self._slot_acks[slot] = set()
        for ident in self._peers:
            self._send_to(ident, message)

    def _post_end(self, message: SyncEnd) -> None:
        for ident in self._peers:
            self._send_to(ident, message)

    def _post_abort(self, message: Abort) -> None:
        channel = self._channel
        if channel is None or not channel.is_open:
            return
        data = encode(message)
        self._abort_posted = True
        if self.rank == 0:
            for ident in self._peers:
                channel.send_quietly(data, ident)
        else:
            channel.send_quietly(data)

    # -- receiver ----------------------------------------------------------------------------

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise TransportError(f"{self.me}: the sender named slot {slot}; only 0 to {self.slots - 1} exist")

    def _interrupt_receive(self) -> bool:
        channel = self._channel
        if channel is None:
            return False
        channel.interrupt()
        return True

    def _recv_next(self) -> BucketReady | SyncEnd:
        deadline = self._deadline()
        peer = f"{self.label(SENDER_RANK)} at {self._endpoint}"
        while True:
            _, message = self._recv_msg(deadline, peer, f"bucket {self.inflight.bucket}")
            if isinstance(message, BucketReady | SyncEnd):
                return message

    def _release_slot(self, slot: int, bucket_index: int) -> None:
        self._send_to(None, BucketAck(rank=self.rank or 0, bucket_index=bucket_index, slot=slot))
