"""One sync's zmq control channel (ROUTER on the sender, DEALER on the receiver)."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from verl_fastsync.colocated.protocol import (
    CODEC,
    ENV_ENABLE,
    Abort,
    Ack,
    ColocatedError,
    ColocatedProtocolError,
    ColocatedTimeoutError,
    Message,
    Ready,
    _PeerFailed,
)
from verl_fastsync.wire import WireError, WireVersionError


def _ipc_path(zmq_handle: str) -> str | None:
    return zmq_handle[len("ipc://") :] if zmq_handle.startswith("ipc://") else None


def _remove_path(zmq_handle: str) -> None:
    path = _ipc_path(zmq_handle)
    if path:
        try:
            os.remove(path)
        except OSError:
            pass


class _Channel:
    """One sync's control channel: the sender binds a ROUTER, the receiver connects a DEALER with a
    fresh routing id and announces itself with :class:`Ready` (resent until the hello arrives). The
    sender talks only to the routing id it chose, so a receiver of an earlier sync that is still
    closing, or a connection to a sender that is going away, cannot take a message of this sync.
    Every wait has a timeout; messages are msgspec-encoded :data:`Message` structs."""

    def __init__(self, zmq_handle: str, role: str, timeout_s: float, bind: bool) -> None:
        import zmq

        if not isinstance(zmq_handle, str) or "://" not in zmq_handle:
            raise ValueError(
                f"zmq_handle must be a ZMQ endpoint such as 'ipc:///tmp/x.sock', got {zmq_handle!r}"
            )
        self._zmq = zmq
        self.zmq_handle = zmq_handle
        self.role = role
        self.peer = "receiver" if role == "sender" else "sender"
        self.timeout_s = timeout_s
        self.bound = bind
        self.peer_id: bytes | None = None  # sender: the routing id of this sync's receiver
        self.peer_locked = False  # sender: set once that receiver acknowledged the hello
        self.early: list[Message] = []  # messages read while waiting to send
        self.owner = threading.get_ident()
        ctx: Any = zmq.Context.instance()
        self.socket: Any = ctx.socket(zmq.ROUTER if bind else zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, _LINGER_MS)
        try:
            if bind:
                self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
                _remove_path(zmq_handle)
                self.socket.bind(zmq_handle)
                path = _ipc_path(zmq_handle)
                if path:
                    os.chmod(path, 0o600)
            else:
                self.socket.setsockopt(zmq.ROUTING_ID, b"r" + uuid.uuid4().bytes)
                # the sender binds per sync, usually after we connect: retry every millisecond, not
                # zmq's default 100 ms (which would be added to every sync)
                self.socket.setsockopt(zmq.RECONNECT_IVL, 1)
                self.socket.connect(zmq_handle)
        except BaseException:
            self.socket.close(0)
            raise

    def _where(self, phase: str, seq: int | None, tensors: Iterable[str]) -> str:
        names = list(tensors)
        shown = ", ".join(repr(n) for n in names[:4]) + (
            f" (+{len(names) - 4} more)" if len(names) > 4 else ""
        )
        return (
            f"{self.peer} at {self.zmq_handle}; phase={phase}, bucket={seq if seq is not None else '-'}, "
            f"tensors in flight=[{shown}]"
        )

    def _timeout(
        self, doing: str, phase: str, seq: int | None, tensors: Iterable[str]
    ) -> ColocatedTimeoutError:
        return ColocatedTimeoutError(
            f"verl-fastsync {self.role}: timed out after {self.timeout_s:.0f}s {doing} the "
            f"{self._where(phase, seq, tensors)}. Is the peer running with {ENV_ENABLE} set the same "
            f"way (fastsync on both sides or on neither)?"
        )

    def send(self, msg: Message, phase: str, seq: int | None = None, tensors: Iterable[str] = ()) -> None:
        """Send ``msg``; while the peer cannot take it, read what it sent meanwhile, so that an error
        ack or an abort from a peer that has gone away surfaces at once instead of as a timeout."""
        zmq = self._zmq
        frames = [CODEC.encode(msg)]
        if self.bound:
            if self.peer_id is None:
                raise ColocatedProtocolError("verl-fastsync sender: no receiver has announced itself yet")
            frames.insert(0, self.peer_id)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                self.socket.send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                # the receiver's connection is gone; it may have left an error ack behind
                while self.socket.poll(0, zmq.POLLIN):
                    self._stash_or_raise(phase, seq, tensors)
                if time.monotonic() >= deadline:
                    raise ColocatedError(
                        f"verl-fastsync {self.role}: the {self._where(phase, seq, tensors)} went away"
                    ) from None
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            events = self.socket.poll(min(left_ms, 50), zmq.POLLIN | zmq.POLLOUT)
            if events & zmq.POLLIN:
                self._stash_or_raise(phase, seq, tensors)
            if time.monotonic() >= deadline:
                raise self._timeout("sending to", phase, seq, tensors)

    def send_nowait(self, msg: Message) -> None:
        """Best effort, never blocks (an abort on the way out)."""
        frames = [CODEC.encode(msg)]
        if self.bound:
            if self.peer_id is None:
                return
            frames.insert(0, self.peer_id)
        self.socket.send_multipart(frames, self._zmq.NOBLOCK)

    def _stash_or_raise(self, phase: str, seq: int | None, tensors: Iterable[str]) -> None:
        early = self._recv_now(phase, seq, tensors)
        if early is None:
            return
        if isinstance(early, Abort) or (isinstance(early, Ack) and early.error is not None):
            self.early.insert(0, early)  # the caller turns _PeerFailed into the peer's error
            raise _PeerFailed()
        self.early.append(early)

    def recv_within(self, window_s: float, phase: str) -> Message | None:
        """Like :meth:`recv`, but ``None`` when nothing (for this sync) arrives within ``window_s``."""
        if self.early:
            return self.early.pop(0)
        deadline = time.monotonic() + window_s
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self.socket.poll(left_ms, self._zmq.POLLIN):
                return None
            msg = self._recv_now(phase, None, ())
            if msg is not None:
                return msg

    def recv(self, phase: str, seq: int | None = None, tensors: Iterable[str] = ()) -> Message:
        msg = self.recv_within(self.timeout_s, phase)
        if msg is None:
            raise self._timeout("waiting for", phase, seq, tensors)
        return msg

    def peer_failure(self) -> ColocatedError:
        """The error for a failure the peer reported while we were sending (see :meth:`send`)."""
        early = self.early[0] if self.early else None
        if isinstance(early, Abort):
            return ColocatedError(f"verl-fastsync {self.role}: the {self.peer} aborted: {early.reason}")
        if isinstance(early, Ack):
            return ColocatedError(
                f"verl-fastsync {self.role}: the {self.peer} failed on bucket {early.seq}: {early.error}"
            )
        return ColocatedProtocolError(f"verl-fastsync {self.role}: the {self.peer} failed")

    def _recv_now(self, phase: str, seq: int | None, tensors: Iterable[str]) -> Message | None:
        """Read one message; ``None`` for one that is not from this sync's peer (ignored)."""
        frames = self.socket.recv_multipart()
        sender_id: bytes | None = None
        if self.bound:
            if len(frames) != 2:
                return None
            sender_id, raw = frames
        elif len(frames) != 1:
            return None
        else:
            raw = frames[0]
        # the one rule of every control message: the version first (verl_fastsync.wire.check_version)
        try:
            msg = CODEC.decode(raw, peer=f"the {self.peer}")
        except WireVersionError as exc:
            raise ColocatedProtocolError(f"verl-fastsync {self.role}: {exc}") from None
        except WireError as exc:
            raise ColocatedProtocolError(
                f"verl-fastsync {self.role}: undecodable message from {self._where(phase, seq, tensors)}: "
                f"{exc} (is the peer verl's original transfer? set {ENV_ENABLE} identically on both sides)"
            ) from None
        if self.bound:
            if isinstance(msg, Ready):
                if self.peer_locked:
                    return None  # the next sync's receiver, early: not ours
                self.peer_id = sender_id  # during the handshake the newest receiver wins
                return msg
            if sender_id != self.peer_id:
                return None  # a receiver of an earlier sync
        return msg

    def close(self) -> None:
        """Close the socket; only the thread that opened the channel may (zmq sockets are not
        thread-safe): a call from another thread raises instead of closing it under its feet."""
        if threading.get_ident() != self.owner:
            raise RuntimeError(
                f"verl-fastsync {self.role}: the control channel of {self.zmq_handle} belongs to another "
                f"thread; it closes itself when that thread's sync ends"
            )
        # no disconnect() first: it would drop the last ack still queued. A closing receiver that
        # reconnects to the next sync's sender is ignored there (another routing id).
        # let a last ack or abort leave before the socket goes (close does not block on it)
        self.socket.close(_LINGER_MS)
        if self.bound:
            _remove_path(self.zmq_handle)


_LINGER_MS = 2000
HELLO_RESEND_S = 0.25
"""The sender resends its hello (idempotent, keyed by sync id) this often until it is acknowledged:
a receiver of the previous sync that is still closing may reconnect and take the first copy."""

EventHook = Callable[[str, dict[str, Any]], None]
"""Optional tracer: ``hook(event, fields)``; events ``pack``, ``fence``, ``send``, ``ack`` (sender),
``attach``, ``detach``, ``bucket``, ``device_sync``, ``views_dropped``, ``ack`` (receiver)."""


def _noop_hook(event: str, fields: dict[str, Any]) -> None:
    return None
