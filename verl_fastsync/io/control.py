"""One zmq control channel for the engine transports and the colocated path.

The owner (trainer rank 0, or the colocated sender) :meth:`ControlChannel.bind`\\ s a ROUTER, either on
``ipc://<private 0700 dir>/ctl.sock`` (socket file 0600; same host) or on ``tcp://<host>:<random
port>``; each peer :meth:`ControlChannel.connect`\\ s a DEALER (optionally with its own routing id).
Messages are bytes produced by a codec (see :mod:`verl_fastsync.wire`): this module never pickles
and knows no message type. Every receive has a deadline; nothing here blocks without one.

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

__all__ = ["ChannelClosedError", "ChannelInterruptedError", "ControlChannel"]


class ChannelClosedError(RuntimeError):
    """The channel was used after :meth:`ControlChannel.close`."""


class ChannelInterruptedError(RuntimeError):
    """:meth:`ControlChannel.interrupt` stopped a waiting :meth:`ControlChannel.recv`."""


_POLL_SLICE_MS = 100


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
            if sock.poll(max(1, min(_POLL_SLICE_MS, int(remaining * 1000)))):
                frames = sock.recv_multipart()
                return (frames[0] if self.is_owner else None), frames[-1]

    def recv_nowait(self) -> tuple[bytes | None, bytes] | None:
        """A message already queued, or ``None``."""
        sock = self.sock
        if not sock.poll(0):
            return None
        frames = sock.recv_multipart()
        return (frames[0] if self.is_owner else None), frames[-1]

    # -- teardown ----------------------------------------------------------------------------

    def close(self, linger_ms: int | None = None) -> None:
        """Close the socket and context and remove the socket file (idempotent). ``linger_ms``:
        let queued messages out for at most that long (e.g. an abort's reason), instead of the
        channel's own linger."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close(linger=self._linger if linger_ms is None else linger_ms)
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.term()
        self.remove_socket_file()
