"""``shm`` engine transport: two POSIX shared-memory segments used ping-pong, plus a pyzmq control
channel. Same host only (trainer rank 0 and every rollout rank).

* Segments: created by the sender with mode 0600 (``shm_open`` + ``mmap``) and an
  unguessable name (``fastsync_`` + 128 random bits). Receivers learn the names over the control
  channel, map them, and report :class:`~verl_fastsync.wire.Attached`; the sender then unlinks the
  names at once, so nothing is left in ``/dev/shm`` even if every process is killed afterwards
  (the mappings stay valid until each side closes them). A side that fails before that point unlinks
  the names it knows.
* Control: the sender binds a ZMQ ROUTER on ``ipc://<private 0700 dir>/ctl.sock`` (socket file
  chmod 0600); each receiver connects a DEALER. Messages are :mod:`verl_fastsync.wire` structs.
* Flow per bucket ``k``: the sender waits until every receiver acked the bucket last held in slot
  ``k % 2``, packs bucket ``k`` into it and sends ``BucketReady``; receivers read straight from the
  segment (zero copy for whole tensors) and ack after their consumer moved on. Packing bucket ``k+1``
  overlaps the receivers reading bucket ``k``.

Received tensors live in host memory (or are copied straight to ``options.device``).
"""

from __future__ import annotations

import mmap
import os
import secrets
import shutil
import socket
import tempfile
import time
from typing import Any, ClassVar

import torch
import zmq

try:
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

from verl_fastsync.transports.base import BufferedTransport, TransportError, default_host
from verl_fastsync.wire import (
    Abort,
    Attached,
    BucketAck,
    BucketReady,
    Hello,
    Message,
    SyncEnd,
    Welcome,
    WireError,
    decode,
    encode,
)

__all__ = ["ShmTransport", "segment_prefix"]

_PREFIX = "fastsync_"


def segment_prefix() -> str:
    """Prefix of every segment name this transport creates (for leak checks)."""
    return _PREFIX


def _unlink_quietly(name: str) -> None:
    try:
        _posixshmem.shm_unlink("/" + name)
    except (FileNotFoundError, OSError):
        pass


class _Segment:
    """One mapped POSIX shared-memory segment (mode 0600) and a uint8 tensor over it.

    Uses ``shm_open`` + ``mmap`` directly rather than ``multiprocessing.shared_memory``: that class
    registers every attach with the (shared) resource tracker, which then unlinks or double-counts
    the sender's segment; here the sender unlinks the name itself once every receiver mapped it.
    """

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.name = name
        self.owner = create
        self.linked = True
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise TransportError(
                    f"shm transport: segment {name!r} is smaller than the bucket ({size} bytes)"
                )
            # MAP_POPULATE: fault the pages in now (init), not during the timed transfer
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.map: mmap.mmap | None = mmap.mmap(fd, size, flags=flags)
        except BaseException:
            if create:
                _unlink_quietly(name)
            raise
        finally:
            os.close(fd)
        self.tensor: torch.Tensor | None = torch.frombuffer(self.map, dtype=torch.uint8, count=size)

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            _unlink_quietly(self.name)

    def close(self) -> None:
        self.tensor = None
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:
                # a consumer still holds a zero-copy view; the mapping goes when the view does
                pass
            self.map = None


class ShmTransport(BufferedTransport):
    """Shared-memory engine transport (see module docstring)."""

    name: ClassVar[str] = "shm"

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._dir: str | None = None
        self._endpoint: str | None = None
        self._segments: list[_Segment] = []
        self._segment_names: list[str] = []
        self._peers: dict[bytes, int] = {}  # zmq identity -> rollout rank
        self._slot_bucket: list[int | None] = [None, None]
        self._slot_acks: list[set[int]] = [set(), set()]

    # -- lifecycle ---------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"transport": self.name, "host": socket.gethostname()}
        if self.options.is_master:
            self._close()
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._endpoint = self._bind_control(self._sock)
            meta["endpoint"] = self._endpoint
        return meta

    def _bind_control(self, sock: zmq.Socket[Any]) -> str:
        """Bind the sender's control socket; return the endpoint receivers connect to."""
        self._dir = tempfile.mkdtemp(prefix="fastsync-")
        os.chmod(self._dir, 0o700)
        path = os.path.join(self._dir, "ctl.sock")
        sock.bind(f"ipc://{path}")
        os.chmod(path, 0o600)
        return f"ipc://{path}"

    @classmethod
    def _topology_extra(
        cls, actor_metadata: list[dict[str, Any]], rollout_metadata: list[dict[str, Any]]
    ) -> dict[str, Any]:
        master = actor_metadata[0]
        endpoint = master.get("endpoint")
        if not endpoint:
            raise TransportError(
                "shm transport: trainer rank 0 reported no control endpoint "
                "(was it created with is_master=True?)"
            )
        hosts = {m.get("host") for m in rollout_metadata}
        if hosts - {master.get("host")}:
            raise TransportError(
                "shm transport needs trainer rank 0 and every rollout rank on one host; "
                f"trainer rank 0 is on "
                f"{master.get('host')!r}, rollout ranks on {sorted(str(h) for h in hosts)}; use gloo or nixl"
            )
        return {"endpoint": endpoint}

    def _connect(self, **kwargs: Any) -> None:
        endpoint = kwargs.get("endpoint")
        if self.rank == 0:
            if self._sock is None:
                raise TransportError("shm transport: init_process_group on trainer rank 0 before prepare()")
            self._sender_setup()
            self._handshake_sender()
        else:
            if not endpoint:
                raise TransportError("shm transport: init_process_group needs the sender's endpoint")
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(endpoint)
            self._endpoint = endpoint
            self._handshake_receiver()

    def _sender_setup(self) -> None:
        """Allocate the sender's two bucket buffers (shm: create the segments)."""
        for _ in range(2):
            name = _PREFIX + secrets.token_hex(16)
            self._segment_names.append(name)
            self._segments.append(_Segment(name, self.bucket_size, create=True))

    def _deadline(self) -> float:
        return time.monotonic() + self.options.timeout_s

    def _recv_msg(self, deadline: float, peer: str, detail: str = "") -> tuple[bytes | None, Message]:
        assert self._sock is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(max(1, int(remaining * 1000))):
                if time.monotonic() >= deadline:
                    raise self._timeout_error(peer, detail)
                continue
            frames = self._sock.recv_multipart()
            ident = frames[0] if self.rank == 0 else None
            message = decode(frames[-1], peer=peer)
            if isinstance(message, Abort):
                who = peer if message.rank is None else f"rank {message.rank}"
                raise self._abort_error(who, message.reason)
            return ident, message

    def _send_to(self, ident: bytes | None, message: Message) -> None:
        assert self._sock is not None
        data = encode(message)
        if ident is None:
            self._sock.send(data)
        else:
            self._sock.send_multipart([ident, data])

    def _handshake_sender(self) -> None:
        deadline = self._deadline()
        self.inflight.phase = "handshake"
        attached: set[int] = set()
        # hellos and attach reports interleave across receivers: handle both in one loop
        while len(self._peers) < self.receivers or len(attached) < self.receivers:
            step = "hello" if len(self._peers) < self.receivers else "attach"
            waiting = f"{step} from {self.receivers} receivers"
            ident, message = self._recv_msg(deadline, "rollout ranks", waiting)
            if self._on_hello(ident or b"", message):
                welcome = Welcome(
                    bucket_size=self.bucket_size, buffers=self._welcome_buffers(), verify=self.options.verify
                )
                self._send_to(ident, welcome)
            elif isinstance(message, Attached):
                attached.add(message.rank)
        self._all_attached()

    def _on_hello(self, ident: bytes, message: Message) -> bool:
        """Record a receiver's introduction; False if ``message`` is not one."""
        if isinstance(message, Hello):
            self._peers[ident] = message.rank
            return True
        return False

    def _welcome_buffers(self) -> list[str]:
        return self._segment_names

    def _all_attached(self) -> None:
        for seg in self._segments:
            seg.unlink()  # every receiver mapped it: nothing can leak from here on
        if self._dir is not None:
            # Every receiver is connected: the socket file is no longer needed, and removing it now
            # means a killed trainer leaves no file behind.
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _hello_message(self) -> Message:
        return Hello(rank=self.rank or 0, host=socket.gethostname(), pid=os.getpid())

    def _attach(self, welcome: Welcome) -> None:
        self._segment_names = list(welcome.buffers)
        try:
            for name in welcome.buffers:
                self._segments.append(_Segment(name, self.bucket_size, create=False))
        except FileNotFoundError as exc:
            raise TransportError(f"shm transport: segment {exc.filename!r} vanished before attach") from exc

    def _handshake_receiver(self) -> None:
        deadline = self._deadline()
        self.inflight.phase = "handshake"
        peer = f"trainer rank 0 at {self._endpoint}"
        self._send_to(None, self._hello_message())
        _, message = self._recv_msg(deadline, peer, "welcome")
        if not isinstance(message, Welcome):
            raise TransportError(
                f"{self.name} transport: expected welcome from {peer}, got {type(message).__name__}"
            )
        if message.bucket_size != self.bucket_size:
            raise TransportError(
                f"{self.name} transport: sender bucket_size {message.bucket_size} "
                f"!= receiver {self.bucket_size}"
            )
        if message.verify != self.options.verify:
            raise TransportError(
                f"{self.name} transport: verify differs between sender ({message.verify}) and rollout rank "
                f"{self.rank} ({self.options.verify}); set engine_kwargs.fastsync.verify the same everywhere"
            )
        self._attach(message)
        self._send_to(None, Attached(rank=self.rank or 0))

    def _close(self) -> None:
        self._release_buffers()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._peers = {}
        self._slot_bucket = [None, None]
        self._slot_acks = [set(), set()]

    def _release_buffers(self) -> None:
        for seg in self._segments:
            seg.unlink()
            seg.close()
        for name in self._segment_names:
            if not self._segments:
                _unlink_quietly(name)
        self._segments = []
        self._segment_names = []

    # -- sender ------------------------------------------------------------------------------

    def _sender_buffer(self, slot: int) -> torch.Tensor:
        tensor = self._segments[slot].tensor
        assert tensor is not None
        return tensor

    def _wait_slot_free(self, slot: int) -> None:
        bucket = self._slot_bucket[slot]
        if bucket is None:
            return
        deadline = self._deadline()
        while len(self._slot_acks[slot]) < self.receivers:
            missing = sorted(set(self._peers.values()) - self._slot_acks[slot])
            _, message = self._recv_msg(deadline, f"rollout rank(s) {missing}", f"ack of bucket {bucket}")
            if isinstance(message, BucketAck):
                if self._slot_bucket[message.slot] == message.bucket_index:
                    self._slot_acks[message.slot].add(message.rank)
        self._slot_bucket[slot] = None

    def _post_bucket(self, slot: int, message: BucketReady) -> None:
        self._slot_bucket[slot] = message.bucket_index
        self._slot_acks[slot] = set()
        for ident in self._peers:
            self._send_to(ident, message)

    def _post_end(self, message: SyncEnd) -> None:
        for ident in self._peers:
            self._send_to(ident, message)

    def _post_abort(self, message: Abort) -> None:
        if self._sock is None:
            return
        try:
            if self.rank == 0:
                for ident in self._peers:
                    self._sock.send_multipart([ident, encode(message)], flags=zmq.NOBLOCK)
            else:
                self._sock.send(encode(message), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # -- receiver ----------------------------------------------------------------------------

    def _receiver_buffer(self, slot: int) -> torch.Tensor:
        if slot not in (0, 1):
            raise TransportError(f"shm transport: sender named slot {slot}; only 0 and 1 exist")
        tensor = self._segments[slot].tensor
        assert tensor is not None
        return tensor

    def _recv_next(self) -> BucketReady | SyncEnd:
        deadline = self._deadline()
        peer = f"trainer rank 0 at {self._endpoint}"
        while True:
            try:
                _, message = self._recv_msg(deadline, peer, f"bucket {self.inflight.bucket}")
            except WireError:
                raise
            if isinstance(message, BucketReady | SyncEnd):
                return message

    def _release_slot(self, slot: int, bucket_index: int) -> None:
        self._send_to(None, BucketAck(rank=self.rank or 0, bucket_index=bucket_index, slot=slot))


class TcpControlledTransport(ShmTransport):
    """Base of the multi-host transports (``nixl``, ``nccl``) that reuse this module's control
    protocol over TCP instead of an ``ipc://`` socket: receivers may live on other hosts."""

    def _bind_control(self, sock: zmq.Socket[Any]) -> str:
        self._bind_addr = self.options.host or default_host()
        port = sock.bind_to_random_port(f"tcp://{self._bind_addr}")
        return f"tcp://{self._bind_addr}:{port}"

    @classmethod
    def _topology_extra(
        cls, actor_metadata: list[dict[str, Any]], rollout_metadata: list[dict[str, Any]]
    ) -> dict[str, Any]:
        endpoint = actor_metadata[0].get("endpoint")
        if not endpoint:
            raise TransportError(
                f"{cls.name} transport: trainer rank 0 reported no control endpoint (is_master=True?)"
            )
        return {"endpoint": endpoint}
