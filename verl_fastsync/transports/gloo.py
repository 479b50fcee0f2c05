"""``gloo`` engine transport: torch.distributed Gloo on CPU, across processes or hosts.

Trainer rank 0 hosts a ``TCPStore`` (opened in :meth:`prepare`, port chosen by the OS) and every
participant builds a private ``ProcessGroupGloo`` on it in :meth:`init_process_group` (a separate
group: verl's own default process group is never touched). Per bucket, rank 0 broadcasts a fixed
``int64`` header (magic, wire version, kind, metadata length, payload bytes), the msgpack-encoded
:class:`~verl_fastsync.wire.BucketReady` and the payload; the three broadcasts of bucket ``k`` are in
flight while bucket ``k+1`` is packed into the other buffer (two bucket buffers per side). Receivers
prefetch bucket ``k+1`` into their other buffer while their consumer handles bucket ``k``.

When every rollout rank is on trainer rank 0's host the data path uses loopback; otherwise
``options.host`` (default: the address of this host's name) is used. The store listens on the
machine's interfaces for the duration of one sync.
"""

from __future__ import annotations

import datetime
import socket
import time
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from verl_fastsync.transports.base import TransportError, allocate_bucket_buffers, default_host
from verl_fastsync.transports.buffered import BufferedTransport
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
_DEVICES = 2
_PARTS = 4
_MIN_PART = 1 << 20
_MIN_WAIT_S = 0.01  # a zero timedelta means "no timeout" to Work.wait: never pass less than this


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

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._store: Any = None
        self._pg: Any = None
        self._bufs: list[torch.Tensor] = []
        self._slot_works: list[list[Any]] = [[], []]
        self._keep: list[list[torch.Tensor]] = [[], []]
        self._peer = "?"

    def _td(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.options.timeout_s)

    def _deadline(self) -> float:
        """``timeout_s`` from now, on the monotonic clock: one budget shared by a group of waits."""
        return time.monotonic() + float(self.options.timeout_s)

    def prepare(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"transport": self.name, "host": socket.gethostname()}
        if self.options.is_master:
            self._close()
            addr = self.options.host or default_host()
            self._store = dist.TCPStore(addr, 0, None, True, self._td(), wait_for_workers=False)
            meta.update(addr=addr, port=int(self._store.port))
        return meta

    @classmethod
    def _topology_extra(
        cls, actor_metadata: list[dict[str, Any]], rollout_metadata: list[dict[str, Any]]
    ) -> dict[str, Any]:
        master = actor_metadata[0]
        if "port" not in master:
            raise TransportError("gloo transport: trainer rank 0 reported no store (is_master=True?)")
        local = all(m.get("host") == master.get("host") for m in rollout_metadata)
        return {
            "master_addr": "127.0.0.1" if local else master["addr"],
            "master_port": master["port"],
            "data_host": "127.0.0.1" if local else "",
        }

    def _connect(self, **kwargs: Any) -> None:
        addr, port = kwargs["master_addr"], int(kwargs["master_port"])
        self._peer = f"trainer rank 0 at {addr}:{port}"
        self.inflight.phase = "connect"
        try:
            if self.rank != 0:
                self._store = dist.TCPStore(addr, port, None, False, self._td())
            elif self._store is None:
                raise TransportError("gloo transport: init_process_group on trainer rank 0 before prepare()")
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = self._td()
            host = kwargs.get("data_host") or ""
            # two connections per peer and the payload broadcast in parts: gloo then moves the parts
            # on several threads/sockets at once (measured ~1.7x one 64 MiB broadcast on loopback)
            # across hosts each rank binds the address of its own host name (torch's default device)
            opts._devices = [
                dist.ProcessGroupGloo.create_device(hostname=host)
                if host
                else dist.ProcessGroupGloo.create_default_device()
                for _ in range(_DEVICES)
            ]
            opts._threads = 2 * _PARTS
            self._pg = dist.ProcessGroupGloo(
                dist.PrefixStore("fastsync-gloo", self._store), int(self.rank or 0), self.world_size, opts
            )
        except RuntimeError as exc:
            raise self._wrap(exc, "the process group (all ranks)") from exc
        self._bufs = allocate_bucket_buffers(self.bucket_size)

    def _close(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # pragma: no cover
                pass
        self._store = None
        self._bufs = []
        self._slot_works = [[], []]
        self._keep = [[], []]

    def _wrap(self, exc: BaseException, peer: str) -> TransportError:
        text = str(exc)
        if "imed out" in text or "timeout" in text.lower():
            return self._timeout_error(peer, text.splitlines()[0] if text else "")
        return TransportError(
            f"gloo transport, {self.role} rank {self.rank}: {type(exc).__name__} talking to {peer}: "
            f"{text.splitlines()[0] if text else ''}; {self.inflight.describe()}"
        )

    def _broadcast(self, tensor: torch.Tensor, deadline: float | None = None) -> Any:
        """Post one broadcast. gloo gives up on it ``timeout_s`` after it starts, or at ``deadline``:
        closing the group waits for every posted broadcast to end, so an abort posted late in its
        budget must not outlive that budget."""
        assert self._pg is not None
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if deadline is None:
            opts.timeout = self._td()
        else:
            opts.timeout = datetime.timedelta(seconds=max(deadline - time.monotonic(), _MIN_WAIT_S))
        return self._pg.broadcast([tensor], opts)

    def _wait(self, work: Any, peer: str, deadline: float) -> None:
        """Wait for ``work`` until ``deadline`` (:func:`time.monotonic`): only the time left of a
        budget shared with the other waits of the group, never a fresh ``timeout_s`` per work."""
        remaining = deadline - time.monotonic()
        if remaining <= 0 and not work.is_completed():
            raise self._timeout_error(peer)
        try:
            ok = work.wait(datetime.timedelta(seconds=max(remaining, _MIN_WAIT_S)))
        except RuntimeError as exc:
            raise self._wrap(exc, peer) from exc
        if ok is False:
            raise self._timeout_error(peer)

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

    def _post(
        self,
        slot: int,
        kind: int,
        message: Message,
        payload: torch.Tensor | None,
        deadline: float | None = None,
    ) -> None:
        meta = torch.frombuffer(bytearray(encode(message)), dtype=torch.uint8)
        nbytes = 0 if payload is None else payload.numel()
        header = torch.tensor([_MAGIC, WIRE_SCHEMA_VERSION, kind, meta.numel(), nbytes], dtype=torch.int64)
        works = [self._broadcast(header, deadline), self._broadcast(meta, deadline)]
        if payload is not None and nbytes:
            works.extend(self._broadcast(part, deadline) for part in _parts(payload))
        self._slot_works[slot] = works
        self._keep[slot] = [header, meta]

    def _post_bucket(self, slot: int, message: BucketReady) -> None:
        self._post(slot, _KIND_BUCKET, message, self._bufs[slot][: message.nbytes])

    def _post_end(self, message: SyncEnd) -> None:
        self._post(0, _KIND_END, message, None)
        self._wait_slot_free(0)

    def _post_abort(self, message: Abort) -> None:
        if self.rank != 0 or self._pg is None:
            return  # receivers leave the group on close; the sender then fails fast
        deadline = self._deadline()  # the whole abort path: one timeout_s, however much is pending
        try:
            for slot in (0, 1):
                self._wait_slot_free(slot, deadline)
            self._post(0, _KIND_ABORT, message, None, deadline)  # gloo drops it at the deadline too
            self._wait_slot_free(0, deadline)
        except Exception:
            pass

    # -- receiver ----------------------------------------------------------------------------

    def _receiver_buffer(self, slot: int) -> torch.Tensor:
        if slot not in (0, 1):
            raise TransportError(f"gloo transport: sender named slot {slot}; only 0 and 1 exist")
        return self._bufs[slot]

    def _recv_next(self) -> BucketReady | SyncEnd:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        self._wait(self._broadcast(header), self._peer, self._deadline())
        magic, version, kind, meta_len, nbytes = (int(v) for v in header.tolist())
        if magic != _MAGIC:
            raise TransportError(f"gloo transport: bad header from {self._peer}: {header.tolist()}")
        if version != WIRE_SCHEMA_VERSION:
            raise WireVersionError(
                f"incompatible verl-fastsync wire schema: {self._peer} sent version {version}, "
                f"this side speaks version {WIRE_SCHEMA_VERSION}; "
                "install the same verl-fastsync on both sides"
            )
        deadline = self._deadline()  # the header is here: metadata and payload share one budget
        meta = torch.empty(meta_len, dtype=torch.uint8)
        self._wait(self._broadcast(meta), self._peer, deadline)
        message = decode(meta.numpy().tobytes(), peer=self._peer)
        if kind == _KIND_ABORT or isinstance(message, Abort):
            reason = message.reason if isinstance(message, Abort) else "?"
            raise self._abort_error(self._peer, reason)
        if isinstance(message, SyncEnd):
            return message
        if not isinstance(message, BucketReady) or kind != _KIND_BUCKET:
            raise TransportError(f"gloo transport: unexpected {type(message).__name__} from {self._peer}")
        if message.nbytes != nbytes or not 0 <= nbytes <= self.bucket_size or message.slot not in (0, 1):
            raise TransportError(
                f"gloo transport: bucket {message.bucket_index} header says {nbytes} bytes in slot "
                f"{message.slot}, metadata {message.nbytes}; bucket size {self.bucket_size}"
            )
        if nbytes:
            works = [self._broadcast(part) for part in _parts(self._bufs[message.slot][:nbytes])]
            for work in works:
                self._wait(work, self._peer, deadline)
        return message

    def _release_slot(self, slot: int, bucket_index: int) -> None:
        """Nothing to tell: the next receive into this slot is only posted after this call."""
