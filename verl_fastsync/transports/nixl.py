"""``nixl`` engine transport: NIXL agents move the buckets (one-sided WRITE from trainer rank 0 into
each rollout rank's registered bucket), a pyzmq channel carries the control messages.

* Buffers: two bucket buffers per side, registered with the agent: ``DRAM`` (host memory) when
  ``options.device`` is ``cpu``, ``VRAM`` on an accelerator.
* Handshake (in :meth:`init_process_group`): every receiver registers its buffers and sends
  :class:`~verl_fastsync.wire.PeerBuffers` (agent name + metadata + buffer addresses) to the sender's
  ZMQ ROUTER (``tcp://`` on ``options.host``, or this host's address; loopback when every rank shares
  the host); the sender adds each remote agent and answers ``Welcome``; receivers confirm
  ``Attached``.
* Per bucket: the sender waits for every receiver's ack of the bucket last held in the slot, packs
  the bucket, starts WRITEs of its used bytes into each receiver's buffer of the same slot and goes
  on packing the next bucket into the other slot while they move; it sends ``BucketReady`` as soon
  as it sees them complete (it checks between tensors and while it waits, bounded by
  ``timeout_s``). One bucket's WRITEs are in flight at a time. Receivers read in place and ack when
  their consumer moved on.
* **Lending (the safe default on host memory):** a host receiver registers two spare buckets beside
  its two slots (all four announced in ``PeerBuffers``, slots first) and hands the consumer views into
  the bucket. When its consumer still references the bucket at the ack, the slot moves to a free
  spare and the ack tells the sender the new address (``BucketAck.address``); the referenced buffer
  is written again only after its last view is gone. A bucket arriving while no spare is free (the
  consumer holds two buckets or more) is copied out instead, as are tensors split over several
  buckets. A consumer iterating ``for name, t in weights`` holds the last tensor of the bucket it
  just finished in its loop variable, so in steady state the buffers rotate and nothing is copied.

The control flow (handshake, acks, end, abort, timeouts) is the ``shm`` transport's; only the
buffers and the data movement differ. ``nixl`` is imported lazily, when a process group is built.

**Buffer lifetime.** A WRITE lands in the receiver's memory without the receiver doing anything, so
a receiver may free its buffers only when no WRITE of the sender can still be in flight. The buffers
and their registration therefore live as long as the transport, not one sync (``finalize`` closes the
control channel only; the next sync reuses them). A receiver whose sync failed mid-way (its consumer
raised, a checksum failed, it timed out) keeps them: the sender may be in the middle of a WRITE into
them right now. Freeing them there let a late WRITE overwrite whatever glibc had put in that memory
since (heap corruption: ``corrupted double-linked list``). They are reused by the next sync, whose
``Welcome`` the sender sends only once every WRITE it abandoned towards that receiver left NIXL's
in-progress state (:mod:`verl_fastsync.transports.nixl_writes`; bounded by ``timeout_s``, else the
new sync fails naming the ranks). Buffers that must be replaced while a WRITE may still touch them
(the bucket size changed after a failed sync) are *quarantined*: kept registered, unused, and freed
by the first clean sync after it (receiver) or once the abandoned WRITEs settled (sender). Only a
transport released while that is still pending keeps them until the process exits (logged).

**Failures reach the sender at once.** Every wait of the sender, the wait for a WRITE included, also
reads the control channel, so a receiver's ``Abort`` fails the sync with the receiver's reason even
while a WRITE into that receiver cannot complete (over UCX/TCP a WRITE completes only while its
target progresses, and a failed receiver stops progressing).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from verl_fastsync.io.lending import Lease, lend
from verl_fastsync.transports.base import PeerAbortedError, TransportError, allocate_bucket_buffers
from verl_fastsync.transports.nixl_writes import BucketWrite, WriteFailedError, Writes
from verl_fastsync.transports.tcp import TcpControlledTransport
from verl_fastsync.wire import BucketAck, BucketReady, Message, PeerBuffers, Welcome

__all__ = ["NixlTransport"]

log = logging.getLogger(__name__)

# Buffers (with their registration and agent) that a peer may still WRITE into when their transport
# was released: kept alive until the process exits instead of handing the memory back to the heap.
_KEPT_UNTIL_EXIT: list[tuple[Any, ...]] = []


class NixlTransport(TcpControlledTransport):
    """NIXL engine transport (see module docstring)."""

    name: ClassVar[str] = "nixl"
    # No NIXL progress thread: it spins for the agent's whole life, burning a core between syncs on
    # a host the rollout engine shares. UCX progresses instead while a side waits: the sender polls
    # its WRITEs, a receiver polls the agent between control-channel checks (one-sided WRITEs over
    # some UCX transports, TCP among them, complete only while the target progresses).
    progress_poll_s: ClassVar[float | None] = 0.001
    lends = True
    one_copy_per_host: ClassVar[bool] = True
    spares: ClassVar[int] = 2
    """Registered buckets a lending receiver keeps beside its two slots."""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._agent: Any = None
        self._agent_name = ""
        self._bufs: list[torch.Tensor] = []
        self._reg: Any = None
        self._remote: dict[bytes, PeerBuffers] = {}
        self._remote_names: dict[bytes, str] = {}
        self._local_descs: list[Any] = []
        # sender: where each receiver wants each slot written; receiver: which buffer is each slot,
        # buffers on loan to the consumer, and the address the next ack announces
        self._slot_addrs: dict[bytes, list[int]] = {}
        self._slot_buf: list[int] = [0, 1]
        self._lent: dict[int, Lease] = {}
        self._next_address = 0
        # receiver: the sender may WRITE into our buffers (from our Hello until a clean SyncEnd)
        self._peer_may_write = False
        self._writes = Writes()  # sender: the bucket's WRITEs in flight, and abandoned ones
        # buffer sets replaced while a WRITE may still touch them: (registration, buffers)
        self._quarantine: list[tuple[Any, list[torch.Tensor]]] = []

    def _buffer_bytes(self) -> int:
        """The registered buckets: two slots, and on a lending receiver the spares."""
        return max(2, len(self._bufs)) * self.bucket_size

    # -- setup -------------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        meta = super().prepare()
        if self.options.is_master:
            meta["addr"] = self._bind_addr
        return meta

    def _mem_type(self) -> tuple[str, torch.device, int]:
        device = torch.device(self.options.device)
        if device.type == "cpu":
            return "DRAM", device, 0
        return "VRAM", device, device.index or 0

    def _ensure_agent(self) -> Any:
        if self._agent is None:
            try:
                from nixl._api import nixl_agent, nixl_agent_config
            except ImportError as exc:  # pragma: no cover - depends on the install
                raise TransportError(
                    "nixl transport needs the nixl package (pip install 'verl-fastsync[nixl]')"
                ) from exc
            self._agent_name = f"fastsync-{self.role}-{self.rank}-{os.getpid()}-{secrets.token_hex(4)}"
            self._agent = nixl_agent(
                self._agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            )
        return self._agent

    def _allocate(self) -> None:
        """Two registered bucket buffers of this sync's size: last sync's when they fit."""
        agent = self._ensure_agent()
        _mem_type, device, _dev_id = self._mem_type()
        count = 2 + (self.spares if self.rank != 0 and self._lends_now() else 0)
        if (
            len(self._bufs) == count
            and all(b.numel() == self.bucket_size and b.device == device for b in self._bufs)
            and self._reg is not None
        ):
            return
        self._settle_abandoned_now()
        self._retire_buffers()
        self._bufs = allocate_bucket_buffers(self.bucket_size, device, count=count)
        self._reg = agent.register_memory(self._bufs)
        self._slot_buf = [0, 1]
        self._lent = {}

    def _sender_setup(self) -> None:
        self._allocate()

    def _on_hello(self, ident: bytes, message: Message) -> bool:
        if not isinstance(message, PeerBuffers):
            return False
        if len(message.addresses) < 2:
            raise TransportError(
                f"{self.me}: {self.label(message.rank)} sent {len(message.addresses)} buffers, "
                "at least 2 (its slots) are needed"
            )
        self._slot_addrs[ident] = list(message.addresses[:2])
        name = self._agent.add_remote_agent(message.agent_metadata)
        self._remote_names[ident] = name.decode() if isinstance(name, bytes) else str(name)
        self._remote[ident] = message
        self._peers[ident] = message.rank
        return True

    def _welcome_buffers(self) -> list[str]:
        return [self._agent_name]

    def _all_attached(self) -> None:
        pass

    def _hello_message(self) -> Message:
        self._allocate()
        self._next_address = 0  # a move made when the last sync failed: the Hello's order says it
        # from here on the sender knows our addresses and may WRITE into them (until SyncEnd)
        self._peer_may_write = True
        mem_type, _device, dev_id = self._mem_type()
        return PeerBuffers(
            rank=self.rank or 0,
            host=socket.gethostname(),
            pid=os.getpid(),
            agent=self._agent_name,
            agent_metadata=self._agent.get_agent_metadata(),
            addresses=self._announced_addresses(),
            mem_type=mem_type,
            device_id=dev_id,
        )

    def _announced_addresses(self) -> list[int]:
        """Every registered buffer, the two slots first (the sender writes only those, until an ack
        moves a slot)."""
        order = self._slot_buf + [i for i in range(len(self._bufs)) if i not in self._slot_buf]
        return [int(self._bufs[i].data_ptr()) for i in order]

    def _attach(self, welcome: Welcome) -> None:
        pass

    def _progress(self) -> None:
        agent = self._agent
        if agent is not None and self._bufs:
            agent.get_new_notifs()  # progresses the UCX workers (there is no progress thread)
        self._complete_write(block=False)  # the sender, waiting for acks: announce a bucket landed

    def _receive_done(self) -> None:
        # SyncEnd is sent only after every WRITE of the sync completed, and the sync's Welcome only
        # after every WRITE abandoned towards us settled: nothing can be in flight now
        self._peer_may_write = False
        self._free_quarantine()
        super()._receive_done()

    def _before_welcome(self) -> None:
        """Sender: no WRITE a failed sync abandoned towards this sync's receivers may still move
        when they hear ``Welcome`` (they reuse the buffers it targets). They progress it while they
        wait; bounded by ``timeout_s``."""
        if not self._writes.abandoned:
            return
        agents = set(self._remote_names.values())
        moving = self._writes.settle(self._agent, self._deadline(), agents)
        if moving:
            ranks = ", ".join(
                self.label(rank)
                for rank in sorted(self._peers[i] for i, name in self._remote_names.items() if name in moving)
            )
            raise TransportError(
                f"{self.me}: WRITEs that the failed previous sync "
                f"abandoned towards {ranks} are still in progress after "
                f"{self.options.timeout_s:g}s; a new sync cannot start while one may still land in "
                "their buffers"
            )
        self._settle_abandoned_now()

    def _settle_abandoned_now(self) -> None:
        """Sender: release the abandoned WRITEs that are over (one check, no wait); once none is
        left, the quarantined buffers are free."""
        if self._writes.abandoned and self._agent is not None:
            self._writes.settle(self._agent, time.monotonic())
        if self._writes.idle:
            self._free_quarantine()

    def _end_sync(self) -> None:
        self._close_channel()  # the registered buffers stay for the next sync
        self._remote = {}
        self._remote_names = {}
        self._slot_addrs = {}

    def _touched(self) -> bool:
        """A remote WRITE may still land in (receiver) or read from (sender) our buffers."""
        return self._peer_may_write or not self._writes.idle

    def _release_buffers(self) -> None:
        """Failed sync: the control channel closes; the buffers stay while a WRITE may touch them
        (the next sync reuses them, see the module docstring), else they are freed."""
        self._remote = {}
        self._remote_names = {}
        self._slot_addrs = {}
        if not self._touched():
            self._retire_buffers()

    @property
    def quarantined_bytes(self) -> int:
        """Bytes of buffer sets kept registered and unused until no WRITE can touch them."""
        return sum(b.numel() for _reg, bufs in self._quarantine for b in bufs)

    def release(self) -> None:
        super().release()
        self._settle_abandoned_now()
        if self._touched() and (self._bufs or self._quarantine):
            kept = sum(b.numel() for b in self._bufs) + self.quarantined_bytes
            log.warning(
                "%s: released while a WRITE of a failed sync may still touch "
                "its buffers; keeping %d bytes alive until the process exits instead of freeing "
                "memory a late WRITE could overwrite",
                self.me,
                kept,
            )
            _KEPT_UNTIL_EXIT.append((self._agent, self._reg, self._bufs, self._quarantine, self._writes))
            self._quarantine = []
            self._writes = Writes()
            self._forget_buffers()
        else:
            self._retire_buffers()
            self._free_quarantine()
        self._peer_may_write = False

    def _retire_buffers(self) -> None:
        """This buffer set is done with: freed, or quarantined while a WRITE may still touch it."""
        if not self._bufs:
            return
        if self._touched():
            self._quarantine.append((self._reg, self._bufs))
        else:
            self._deregister(self._reg)
        self._forget_buffers()

    def _forget_buffers(self) -> None:
        self._reg = None
        self._bufs = []
        self._slot_buf = [0, 1]
        self._lent = {}

    def _free_quarantine(self) -> None:
        """No WRITE can touch the quarantined buffers any more: deregister and free them."""
        quarantine, self._quarantine = self._quarantine, []
        for reg, _bufs in quarantine:
            self._deregister(reg)

    def _deregister(self, reg: Any) -> None:
        # Remote agents stay added for the agent's lifetime: NIXL/UCX keep a removed agent's endpoint
        # (and its socket) open, so removing it after every sync leaked one fd per sync on each side.
        # The next handshake re-adds the same metadata, which NIXL accepts.
        agent = self._agent
        if agent is not None and reg is not None:
            try:
                agent.deregister_memory(reg)
            except Exception:  # pragma: no cover - best effort
                pass

    # -- data path ---------------------------------------------------------------------------

    def _sender_buffer(self, slot: int) -> torch.Tensor:
        return self._bufs[slot]

    def _receiver_buffer(self, slot: int) -> torch.Tensor:
        if slot not in (0, 1):
            raise TransportError(f"{self.me}: the sender named slot {slot}; only 0 and 1 exist")
        return self._bufs[self._slot_buf[slot]]

    def _free_spares(self) -> list[int]:
        for index, lease in list(self._lent.items()):
            if not lease.active:
                del self._lent[index]
        return [i for i in range(len(self._bufs)) if i not in self._slot_buf and i not in self._lent]

    def _lend_bucket(self, slot: int, buffer: torch.Tensor) -> tuple[torch.Tensor, Lease]:
        return lend(buffer)  # registered buffers never go back to the heap: only their use is tracked

    def _held_bytes(self) -> int:
        self._free_spares()  # forgets leases that ended
        return len(self._lent) * self.bucket_size + super()._held_bytes()

    def _can_lend(self, slot: int) -> bool:
        return bool(self._free_spares())  # so that a slot still referenced at the ack can move

    def _settle(self, slot: int, lease: Lease) -> None:
        if not lease.active:
            return
        free = self._free_spares()
        if not free:  # _can_lend saw a free spare and nothing took it since: cannot happen
            raise TransportError(f"{self.me}: slot {slot} is still lent and no spare bucket is free")
        self._lent[self._slot_buf[slot]] = lease
        self._slot_buf[slot] = free[0]
        self._next_address = int(self._bufs[free[0]].data_ptr())

    def _release_slot(self, slot: int, bucket_index: int) -> None:
        address, self._next_address = self._next_address, 0
        ack = BucketAck(rank=self.rank or 0, bucket_index=bucket_index, slot=slot, address=address)
        self._send_to(None, ack)

    def _on_ack(self, message: BucketAck) -> None:
        if not message.address:
            return
        ident = next((i for i, rank in self._peers.items() if rank == message.rank), None)
        peer = self._remote.get(ident) if ident is not None else None
        if ident is None or peer is None or message.address not in peer.addresses:
            raise TransportError(
                f"{self.me}: {self.label(message.rank)} moved slot {message.slot} to address "
                f"{message.address:#x}, which it never announced"
            )
        self._slot_addrs[ident][message.slot] = message.address

    # -- sender: WRITEs overlap the packing of the next bucket --------------------------------

    def _post_bucket(self, slot: int, message: BucketReady) -> None:
        self._complete_write(block=True)  # one bucket in flight: the previous one lands first
        with self._nixl_errors(message):
            self._start_write(slot, message)
        self._complete_write(block=False)

    def _between_tensors(self) -> None:
        self._complete_write(block=False)  # each check also progresses UCX

    def _wait_slot_free(self, slot: int) -> None:
        write = self._writes.current
        if write is not None and write.slot == slot:
            self._complete_write(block=True)  # its receivers cannot ack what was never announced
        super()._wait_slot_free(slot)

    def _post_end(self, message: Any) -> None:
        self._complete_write(block=True)
        self._settle_abandoned_now()
        super()._post_end(message)

    def _post_abort(self, message: Any) -> None:
        super()._post_abort(message)  # the receivers hear of it first
        self._writes.abandon()

    @contextlib.contextmanager
    def _nixl_errors(self, message: BucketReady) -> Iterator[None]:
        """A failure while a bucket's WRITEs may be moving abandons them (their handles are kept
        and progressed later, the buffers are not freed); an error of NIXL's own types becomes a
        :class:`TransportError` naming the bucket."""
        try:
            yield
        except BaseException as exc:
            self._writes.abandon()
            if isinstance(exc, PeerAbortedError) or not isinstance(exc, Exception):
                raise
            self._explain_failed_write()
            if isinstance(exc, TransportError):
                raise
            raise TransportError(
                f"{self.me}: WRITE of bucket {message.bucket_index} "
                f"to {self._labels(self._peers.values())} failed: {type(exc).__name__}: {exc}; "
                f"{self.inflight.describe()}"
            ) from exc

    def _explain_failed_write(self) -> None:
        """A WRITE failed: most often because its receiver failed (its ``Abort`` says why, and
        arrives around the disconnect NIXL reports) or its process died; raise that first cause
        instead of the WRITE's symptom when there is one."""
        self._raise_pending_abort()
        self._check_peers_alive(force=True)

    def _start_write(self, slot: int, message: BucketReady) -> None:
        nbytes = message.nbytes
        write = BucketWrite(slot, message, self._deadline())
        self._writes.current = write
        if not nbytes:
            return
        agent = self._agent
        mem_type, _device, dev_id = self._mem_type()
        local = agent.get_xfer_descs([(int(self._bufs[slot].data_ptr()), nbytes, dev_id)], mem_type)
        for ident, peer in self._remote.items():
            where = [(self._slot_addrs[ident][slot], nbytes, peer.device_id)]
            remote = agent.get_xfer_descs(where, peer.mem_type)
            try:
                handle = agent.initialize_xfer("WRITE", local, remote, self._remote_names[ident])
                write.handles.append((ident, self._remote_names[ident], handle))
                started = agent.transfer(handle)
            except Exception as exc:
                raise TransportError(
                    f"{self.me}: WRITE of bucket {message.bucket_index} to {self.label(peer.rank)} failed: "
                    f"{type(exc).__name__}: {exc}; {self.inflight.describe()}"
                ) from exc
            if started == "ERR":
                raise TransportError(
                    f"{self.me}: WRITE of bucket "
                    f"{message.bucket_index} to {self.label(peer.rank)} failed to start; "
                    f"{self.inflight.describe()}"
                )

    def _complete_write(self, block: bool) -> None:
        """Announce the bucket in flight once every WRITE of it completed (``block``: wait for that,
        at most ``timeout_s`` from its start, reading the control channel meanwhile so that a
        receiver's ``Abort`` fails the wait at once); raise when one failed or timed out."""
        write = self._writes.current
        if write is None:
            return
        with self._nixl_errors(write.message):
            while True:
                try:
                    pending = self._writes.pending(self._agent)
                except WriteFailedError as exc:
                    raise TransportError(
                        f"{self.me}: WRITE of bucket "
                        f"{write.message.bucket_index} to {self.label(self._peers.get(exc.ident))} "
                        f"failed; {self.inflight.describe()}"
                    ) from None
                if not pending:
                    break
                if not block:
                    return
                self.inflight.phase = "wait-write"
                self._poll_control()
                if time.monotonic() > write.deadline:
                    raise self._timeout_error(
                        self._labels(self._peers.get(i, -1) for i in pending),
                        f"WRITE of bucket {write.message.bucket_index}",
                    )
                time.sleep(0.0002)  # check_xfer_state progresses UCX; don't spin a core
        self._writes.finish(self._agent)
        super()._post_bucket(write.slot, write.message)
