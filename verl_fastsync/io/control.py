"""One zmq control channel for the engine transports and the colocated path.

The owner (trainer rank 0, or the colocated sender) :meth:`ControlChannel.bind`\\ s a ROUTER, either on
``ipc://<private 0700 dir>/ctl.sock`` (socket file 0600; same host) or on ``tcp://<host>:<random
port>``; each peer :meth:`ControlChannel.connect`\\ s a DEALER (optionally with its own routing id).
Messages are bytes produced by a codec (see :mod:`verl_fastsync.wire`): this module never pickles
and knows no message type. Every receive has a deadline; nothing here blocks without one.

:meth:`ControlChannel.watch_peers` makes a closed connection an error, for the length of a sync: a
process that dies (killed, crashed) or whose host drops off the network has its TCP or ``ipc://``
connection closed by its kernel, which zmq reports as ``ZMQ_EVENT_DISCONNECTED`` on a socket monitor.
The monitor is polled with the channel's own socket (no thread, nothing on a clean sync but one more
poll item); the owner maps the event's file descriptor to a peer by the descriptor its messages
came in on (``ZMQ_SRCFD``), so only a peer that already sent something (its hello) is watched. Why
not zmq heartbeats: they detect the same thing only after their timeout and need it tuned per
network, while a closed connection is known at once; a peer that went silent without closing
anything is what ``timeout_s`` is for.

A channel is used by one thread at a time (zmq sockets are not thread-safe); :meth:`close` is
idempotent and must run on the thread that uses the socket, or after that thread is done.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

__all__ = ["ChannelClosedError", "ChannelInterruptedError", "ControlChannel", "PeerDisconnectedError"]


class ChannelClosedError(RuntimeError):
    """The channel was used after :meth:`ControlChannel.close`."""


class ChannelInterruptedError(RuntimeError):
    """:meth:`ControlChannel.interrupt` stopped a waiting :meth:`ControlChannel.recv`."""


class PeerDisconnectedError(RuntimeError):
    """A watched connection closed (:meth:`ControlChannel.watch_peers`): ``peers`` are the routing
    ids of the peers lost (owner), or ``[None]`` (peer: the owner is lost)."""

    def __init__(self, peers: list[bytes | None]) -> None:
        super().__init__("control connection closed")
        self.peers = peers


_POLL_SLICE_MS = 100

DISCONNECT_GRACE_S = 0.2
"""How long after a watched connection closed its last messages may still be read (zmq may report
the close before the messages sent just before it, e.g. a peer's ``Abort``, are readable)."""


class ControlChannel:
    """A ROUTER (owner) or DEALER (peer) socket with deadlines.

    :param linger_ms: how long :meth:`close` lets queued messages out (0: drop them).
    """

    def __init__(self, *, linger_ms: int = 0) -> None:
        self._ctx: zmq.Context[Any] | None = zmq.Context()
        self._sock: zmq.Socket[Any] | None = None
        self._dir: str | None = None
        self.endpoint: str | None = None
        self.is_owner = False
        self._linger = linger_ms
        self._interrupted = threading.Event()
        self._monitor: zmq.Socket[Any] | None = None
        self._poller: zmq.Poller | None = None
        self._peer_fds: dict[int, bytes] = {}  # owner: connection fd -> routing id of its peer
        self._lost: list[bytes | None] = []
        self._lost_at = 0.0

    # -- setup -------------------------------------------------------------------------------

    def _socket(self, kind: int) -> zmq.Socket[Any]:
        if self._ctx is None:
            raise ChannelClosedError("control channel is closed")
        if self._sock is not None:
            raise RuntimeError("control channel is already bound or connected")
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, self._linger)
        self._sock = sock
        return sock

    def bind(self, host: str | None = None, *, endpoint: str | None = None) -> str:
        """Owner: bind a ROUTER; ``host=None`` -> private ``ipc://`` socket, else ``tcp://host``.
        ``endpoint``: bind exactly there instead (a fixed path both sides know, as verl's colocated
        ``zmq_handle``): a stale ``ipc://`` file is replaced and the new one made 0600; the caller
        removes it. Returns the endpoint peers connect to."""
        sock = self._socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.is_owner = True
        if endpoint is not None:
            path = endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None
            if path:
                try:
                    os.remove(path)
                except OSError:
                    pass
            sock.bind(endpoint)
            if path:
                os.chmod(path, 0o600)
            self.endpoint = endpoint
        elif host is None:
            self._dir = tempfile.mkdtemp(prefix="fastsync-")
            os.chmod(self._dir, 0o700)
            path = os.path.join(self._dir, "ctl.sock")
            sock.bind(f"ipc://{path}")
            os.chmod(path, 0o600)
            self.endpoint = f"ipc://{path}"
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
            self.endpoint = f"tcp://{host}:{port}"
        return self.endpoint

    def connect(
        self, endpoint: str, routing_id: bytes | None = None, *, reconnect_ivl_ms: int | None = None
    ) -> None:
        """Peer: connect a DEALER to the owner's endpoint (``reconnect_ivl_ms``: retry interval
        while the owner is not bound yet; zmq's default is 100 ms)."""
        sock = self._socket(zmq.DEALER)
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if reconnect_ivl_ms is not None:
            sock.setsockopt(zmq.RECONNECT_IVL, reconnect_ivl_ms)
        sock.connect(endpoint)
        self.endpoint = endpoint

    def watch_peers(self) -> None:
        """From now on :meth:`recv` and :meth:`recv_nowait` raise :class:`PeerDisconnectedError` once
        a peer's connection closed (owner: a peer that sent a message; peer: the owner) and every
        message that came before the close was read."""
        sock = self.sock
        if self._monitor is None:
            self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._poller = zmq.Poller()
            self._poller.register(sock, zmq.POLLIN)
            self._poller.register(self._monitor, zmq.POLLIN)

    def remove_socket_file(self) -> None:
        """Owner: delete the ``ipc://`` socket file and its directory once every peer is connected
        (established connections stay; a killed owner then leaves no file behind)."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # -- messages ----------------------------------------------------------------------------

    @property
    def sock(self) -> zmq.Socket[Any]:
        if self._sock is None:
            raise ChannelClosedError("control channel is closed (or was never bound/connected)")
        return self._sock

    @property
    def is_open(self) -> bool:
        return self._sock is not None

    def send(self, data: bytes, to: bytes | None = None, *, nowait: bool = False) -> None:
        """Send one message (owner: to the peer with routing id ``to``). ``nowait`` raises
        ``zmq.Again`` instead of blocking when the message cannot be queued."""
        flags = zmq.NOBLOCK if nowait else 0
        if to is None:
            self.sock.send(data, flags=flags)
        else:
            self.sock.send_multipart([to, data], flags=flags)

    def send_quietly(self, data: bytes, to: bytes | None = None) -> bool:
        """Best-effort, never-blocking send (abort paths); False when it could not be queued."""
        if self._sock is None:
            return False
        try:
            self.send(data, to, nowait=True)
        except zmq.ZMQError:
            return False
        return True

    def interrupt(self) -> None:
        """Make a :meth:`recv` waiting on another thread raise :class:`ChannelInterruptedError`
        within ~0.1 s (thread-safe; the socket itself is not touched)."""
        self._interrupted.set()

    def recv(self, deadline: float) -> tuple[bytes | None, bytes] | None:
        """The next message as ``(routing id or None, data)``, or ``None`` once ``deadline``
        (a ``time.monotonic()`` value) has passed."""
        sock = self.sock
        while True:
            if self._interrupted.is_set():
                raise ChannelInterruptedError("control channel wait interrupted (the sync is being aborted)")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            timeout = max(1, min(_POLL_SLICE_MS, int(remaining * 1000)))
            if self._poller is None:
                if sock.poll(timeout):
                    return self._read()
                continue
            ready = dict(self._poller.poll(timeout))
            if sock in ready:
                return self._read()
            self._check_lost(monitor_ready=self._monitor in ready)

    def recv_nowait(self) -> tuple[bytes | None, bytes] | None:
        """A message already queued, or ``None``."""
        if self.sock.poll(0):
            return self._read()
        if self._monitor is not None:
            self._check_lost(monitor_ready=bool(self._monitor.poll(0)))
        return None

    def _read(self) -> tuple[bytes | None, bytes]:
        if self._monitor is None or not self.is_owner:
            frames = self.sock.recv_multipart()
            return (frames[0] if self.is_owner else None), frames[-1]
        parts = self.sock.recv_multipart(copy=False)
        ident = parts[0].bytes
        self._peer_fds[parts[-1].get(zmq.SRCFD)] = ident
        return ident, parts[-1].bytes

    def _check_lost(self, monitor_ready: bool) -> None:
        """Record the connections the monitor reports closed; raise once the grace for their last
        messages has passed."""
        monitor = self._monitor
        while monitor_ready and monitor is not None and monitor.poll(0):
            event = recv_monitor_message(monitor)
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            if self.is_owner:
                ident = self._peer_fds.pop(int(event["value"]), None)
                if ident is None:
                    continue  # a peer that never said anything: not ours to watch
            else:
                ident = None
            if not self._lost:
                self._lost_at = time.monotonic()
            self._lost.append(ident)
        if self._lost and time.monotonic() - self._lost_at >= DISCONNECT_GRACE_S:
            raise PeerDisconnectedError(list(self._lost))

    # -- teardown ----------------------------------------------------------------------------

    def close(self, linger_ms: int | None = None) -> None:
        """Close the socket and context and remove the socket file (idempotent). ``linger_ms``:
        let queued messages out for at most that long (e.g. an abort's reason), instead of the
        channel's own linger."""
        monitor, self._monitor, self._poller = self._monitor, None, None
        if monitor is not None and self._sock is not None:
            self._sock.disable_monitor()
            monitor.close(linger=0)
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close(linger=self._linger if linger_ms is None else linger_ms)
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.term()
        self.remove_socket_file()
