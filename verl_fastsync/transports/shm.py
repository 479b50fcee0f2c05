"""``shm`` engine transport: POSIX shared-memory segments filled in turn (three slots by default),
plus the zmq control channel of :mod:`verl_fastsync.transports.controlled` on a private ``ipc://``
socket. Same host only (trainer rank 0 and every rollout rank).

* Segments (:class:`verl_fastsync.io.shm.Segment`): created by the sender, mode 0600, unguessable
  names. Receivers map them when the sender's ``Welcome`` names them and confirm ``Attached``; the
  sender then unlinks the names at once, so nothing is left in ``/dev/shm`` even if every process is
  killed afterwards (the mappings stay valid until each side closes them). A segment made mid-sync
  is unlinked once every receiver acked the bucket it first carried.
* **Segments live as long as the transport**, not one sync: ``finalize`` closes the control channel
  only. The next sync reuses both segments when every receiver reports (in its ``Hello``) that it
  still maps them; otherwise (a new receiver, another bucket size) the sender makes new ones.
  They are released when a sync fails, by :meth:`ShmTransport.release`, or at process exit (names
  are already gone, so exit leaks nothing). Cost between syncs: ``slots + 1`` buckets of shared
  memory (the slots and the spare), plus any the consumer still holds.
* Flow per bucket ``k``: the sender waits until every receiver acked the bucket last held in slot
  ``k % slots``, copies bucket ``k``'s tensors into a segment (one memcpy per byte) and sends
  ``BucketReady`` naming it; receivers hand the consumer views into the segment and ack once their
  consumer moved on. Copying bucket ``k+1`` in the sender overlaps the receivers reading bucket
  ``k``. Tensors split over several buckets are assembled into their own memory (one more copy).
* **Three slots by default** (``engine_kwargs.fastsync.slots``, 2 to 4): "keep a tensor whole where
  it fits" makes buckets of uneven size (a 184 MiB ``gate_up_proj`` alone, then 92 MiB ``down_proj``
  plus the small ones), and with two slots the sender waits for the receiver to finish every big
  bucket before it can pack the next one: a pipeline of alternating 184/109 MiB buckets costs about
  1.33 copy times against 1.09 with three (simulated; measured in ``verl-fastsync bench``). A slot is
  one bucket of host shared memory, mapped by both sides but resident once.
* **Lending (the safe default):** a receiver whose consumer still references a segment when it acks
  says so (``BucketAck.kept``); the sender never writes into that segment again until the receiver
  reports it back (``BucketAck.returned``, or ``Hello.lent`` no longer naming it) and packs the slot
  into a spare instead, or a new segment when there is none (announced by ``BucketReady.buffer``,
  mapped by receivers on first sight). A consumer iterating ``for name, t in weights`` still holds
  the last tensor of the bucket it just finished in its loop variable, so in steady state three
  segments rotate between the two slots: no copy out, and no byte changes under a consumer that
  keeps tensors. The sender keeps at most one spare; segments beyond it are dropped
  (``BucketReady.dropped``), and at the end of a sync it drops every segment that is neither a slot
  nor that spare, those a consumer still holds included (``SyncEnd.dropped``): receivers unmap
  them, so such a segment's memory is freed the moment the consumer lets go of its last view. What
  stays between syncs is ``slots + 1`` segments, whatever the consumer held during the sync.
  ``zero_copy=True`` skips the bookkeeping (views valid only until the next tensor is requested).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from verl_fastsync.io.lending import Lease, lend
from verl_fastsync.io.shm import SEGMENT_PREFIX, Segment, SegmentError
from verl_fastsync.transports.base import TransportError
from verl_fastsync.transports.controlled import MAX_SLOTS, ControlledTransport
from verl_fastsync.wire import BucketAck, BucketReady, Hello, Message, SyncEnd, Welcome

__all__ = ["DEFAULT_SLOTS", "ShmTransport", "segment_prefix", "validate_slots"]

DEFAULT_SLOTS = 3
"""Slots of the shm transport unless ``engine_kwargs.fastsync.slots`` says otherwise."""

_Segment = Segment  # the name tests and older code use

ABORT_GRACE_S = 1.0
"""A receiver that finds a segment gone waits this long for the sender's ``Abort`` (it precedes the
unlink, but may arrive after the message that named the segment)."""


def validate_slots(key: str, value: object) -> int:
    """``engine_kwargs.fastsync.slots``: how many shared-memory buckets the sender fills in turn."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= MAX_SLOTS:
        raise ValueError(
            f"{key}={value!r} is invalid; allowed: an integer from 2 to {MAX_SLOTS} (slots of shared "
            f"memory the shm sender fills in turn, one bucket each; default {DEFAULT_SLOTS})"
        )
    return value


def segment_prefix() -> str:
    """Prefix of every segment name this transport creates (for leak checks)."""
    return SEGMENT_PREFIX


class ShmTransport(ControlledTransport):
    """Shared-memory engine transport (see module docstring)."""

    name: ClassVar[str] = "shm"
    lends = True
    engine_options: ClassVar[dict[str, Any]] = {"slots": validate_slots}
    keep_spares: ClassVar[int] = 1
    """Free segments the sender keeps beside the two slots (the rotation a lending receiver needs)."""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        # both sides: every segment of the pool by name (the sender owns them, receivers map them)
        self._pool: dict[str, Segment] = {}
        self._slot_names: list[str] = [""] * self.slots
        # sender: receivers' ranks holding each segment on loan; names to announce as dropped
        self._loaned: dict[str, set[int]] = {}
        self._dropped: list[str] = []
        self._peer_mapped: dict[bytes, list[str]] = {}
        self._peer_lent: dict[bytes, list[str]] = {}
        # receiver: segments its consumer still references, and those that came back since the last ack
        self._kept: dict[str, Lease] = {}
        self._returned: list[str] = []
        self._keep_this: bool = False
        self._let_go: list[Lease] = []  # leases of segments the sender dropped while still lent
        self.segments_made = 0
        """Segments this sender created (constant while the rotation keeps up)."""

    @property
    def segment_names(self) -> list[str]:
        """The pool: the slots' segments first."""
        first = [n for n in self._slot_names if n in self._pool]
        return first + [n for n in self._pool if n not in first]

    def _buffer_bytes(self) -> int:
        """Every segment of the pool this side maps (the slots, the spare, the ones on loan)."""
        return max(self.slots, len(self._pool)) * self.bucket_size

    def _configured_slots(self) -> int:
        slots = self.options.extra.get("slots", DEFAULT_SLOTS)
        return validate_slots("engine_kwargs.fastsync.slots", slots)

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def _topology_extra(
        cls, actor_metadata: list[dict[str, Any]], rollout_metadata: list[dict[str, Any]]
    ) -> dict[str, Any]:
        master = actor_metadata[0]
        # the sender's name: a lane's sender says which trainer rank it is (``label`` in its
        # metadata); a single-sender group's sender is trainer rank 0
        sender = str(master.get("label") or "trainer rank 0")
        endpoint = master.get("endpoint")
        if not endpoint:
            raise TransportError(
                f"shm transport: {sender} reported no control endpoint (was it created with is_master=True?)"
            )
        elsewhere = [
            f"rollout rank {j} on {m.get('host')!r}"
            for j, m in enumerate(rollout_metadata)
            if m.get("host") != master.get("host")
        ]
        if elsewhere:
            raise TransportError(
                f"shm transport needs its sender and every rollout rank on one host: {sender} is on "
                f"{master.get('host')!r}, {', '.join(elsewhere)}; use gloo or nixl across hosts"
            )
        return {"endpoint": endpoint}

    def _end_sync(self) -> None:
        self._close_channel()  # the segments stay for the next sync

    def _release_buffers(self) -> None:
        pool, self._pool = self._pool, {}
        for seg in pool.values():
            seg.unlink()
            seg.close()  # a view the consumer still holds keeps its mapping until it goes
        self._slot_names = [""] * self.slots
        self._loaned = {}
        self._dropped = []
        self._kept = {}
        self._returned = []

    # -- sender ------------------------------------------------------------------------------

    def _new_segment(self) -> str:
        seg = Segment.create(self.bucket_size)
        self._pool[seg.name] = seg
        self.segments_made += 1
        return seg.name

    def _sender_setup(self) -> None:
        if self._pool and all(seg.size == self.bucket_size for seg in self._pool.values()):
            return
        self._release_buffers()
        self._create_segments()

    def _create_segments(self) -> None:
        self._slot_names = [self._new_segment() for _ in range(self.slots)]

    def _on_hello(self, ident: bytes, message: Message) -> bool:
        if isinstance(message, Hello):
            self._peers[ident] = message.rank
            self._peer_mapped[ident] = list(message.mapped)
            self._peer_lent[ident] = list(message.lent)
            return True
        return False

    def _before_welcome(self) -> None:
        names = set(self._pool)
        everyone = all(set(self._peer_mapped.get(ident, ())) == names for ident in self._peers)
        if not everyone and not all(seg.linked for seg in self._pool.values()):
            # some receiver lacks the (already unlinked) segments: make new ones for everybody
            self._release_buffers()
            self._create_segments()
        else:
            self._loaned = {}
            for ident, lent in self._peer_lent.items():
                for name in lent:
                    if name in self._pool:
                        self._loaned.setdefault(name, set()).add(self._peers[ident])
        self._peer_mapped = {}
        self._peer_lent = {}

    def _welcome_buffers(self) -> list[str]:
        return self.segment_names

    def _all_attached(self) -> None:
        for seg in self._pool.values():
            seg.unlink()  # every receiver mapped it: nothing can leak from here on
        super()._all_attached()

    def _on_ack(self, message: BucketAck) -> None:
        rank = message.rank
        if message.kept:
            self._loaned.setdefault(self._slot_names[message.slot], set()).add(rank)
        for name in message.returned:
            self._loaned.get(name, set()).discard(rank)

    def _wait_slot_free(self, slot: int) -> None:
        super()._wait_slot_free(slot)
        seg = self._pool.get(self._slot_names[slot])
        if seg is not None and seg.linked:
            seg.unlink()  # every receiver acked a bucket in it, so every receiver mapped it

    def _free_names(self) -> list[str]:
        return [n for n in self._pool if not self._loaned.get(n) and n not in self._slot_names]

    def _sender_buffer(self, slot: int) -> torch.Tensor:
        name = self._slot_names[slot]
        if self._loaned.get(name):
            free = self._free_names()
            self._slot_names[slot] = free[0] if free else self._new_segment()
        for name in self._free_names()[self.keep_spares :]:
            seg = self._pool.pop(name)
            seg.unlink()
            seg.close()
            self._loaned.pop(name, None)
            self._dropped.append(name)
        tensor = self._pool[self._slot_names[slot]].tensor
        assert tensor is not None
        return tensor

    def _post_end(self, message: SyncEnd) -> None:
        keep = set(self._slot_names) | set(self._free_names()[: self.keep_spares])
        for name in [n for n in self._pool if n not in keep]:
            seg = self._pool.pop(name)
            seg.unlink()
            seg.close()
            self._loaned.pop(name, None)
            self._dropped.append(name)
        message.dropped, self._dropped = self._dropped, []
        super()._post_end(message)

    def _post_bucket(self, slot: int, message: BucketReady) -> None:
        message.buffer = self._slot_names[slot]
        message.dropped, self._dropped = self._dropped, []
        super()._post_bucket(slot, message)

    # -- receiver ----------------------------------------------------------------------------

    def _reclaim(self) -> None:
        for name, lease in list(self._kept.items()):
            if not lease.active:
                del self._kept[name]
                self._returned.append(name)

    def _hello_message(self) -> Message:
        hello = super()._hello_message()
        assert isinstance(hello, Hello)
        self._reclaim()
        self._returned = []  # the Hello's lent list says it all
        hello.mapped = list(self._pool)
        hello.lent = list(self._kept)
        return hello

    def _attach(self, welcome: Welcome) -> None:
        if len(self._slot_names) != self.slots:  # the sender's count, adopted at the handshake
            self._slot_names = [""] * self.slots
        if set(welcome.buffers) == set(self._pool) and all(
            seg.size >= self.bucket_size for seg in self._pool.values()
        ):
            return  # the same segments as last sync
        self._release_buffers()
        if len(welcome.buffers) < self.slots:
            raise TransportError(
                f"{self.me}: the sender named {len(welcome.buffers)} segments, expected at least "
                f"{self.slots} (one per slot)"
            )
        for name in welcome.buffers:
            self._map(name)

    def _map(self, name: str) -> Segment:
        seg = self._pool.get(name)
        if seg is None:
            try:
                seg = Segment.attach(name, self.bucket_size)
            except SegmentError as exc:
                # the sender unlinks its segments when its sync fails, right after it sent the Abort
                # that says why: that reason is the failure, a missing segment only its symptom
                self._raise_pending_abort(grace_s=ABORT_GRACE_S)
                raise TransportError(
                    f"{self.me}: {exc}; {self.label(0)} released it before this rank mapped it and "
                    f"sent no reason within {ABORT_GRACE_S:g}s (it died, or its sync failed); "
                    f"{self.inflight.describe()}"
                ) from exc
            self._pool[name] = seg
        return seg

    def _forget(self, names: list[str]) -> None:
        """Unmap segments the sender dropped (a view the consumer holds keeps its own mapping)."""
        for name in names:
            seg = self._pool.pop(name, None)
            lease = self._kept.pop(name, None)
            if lease is not None:  # the consumer's: counted as held until it lets go
                lease.forget_buffer()  # without keeping the segment mapped for it
                self._let_go.append(lease)
            if seg is not None:
                seg.close()

    def _recv_next(self) -> BucketReady | SyncEnd:
        message = super()._recv_next()
        self._forget(message.dropped)
        if isinstance(message, BucketReady):
            self._check_slot(message.slot)
            if message.buffer:
                self._map(message.buffer)
                self._slot_names[message.slot] = message.buffer
        return message

    def _receiver_buffer(self, slot: int) -> torch.Tensor:
        self._check_slot(slot)
        seg = self._pool.get(self._slot_names[slot])
        if seg is None or seg.tensor is None:
            raise TransportError(f"{self.me}: no segment is mapped for slot {slot}")
        return seg.tensor

    def _lend_bucket(self, slot: int, buffer: torch.Tensor) -> tuple[torch.Tensor, Lease]:
        return lend(buffer)  # kept segments are tracked here (the sender must hear of their return)

    def _held_bytes(self) -> int:
        self._reclaim()
        self._let_go = [lease for lease in self._let_go if lease.active]
        held = sum(lease.nbytes for lease in [*self._kept.values(), *self._let_go])
        return held + super()._held_bytes()

    def _settle(self, slot: int, lease: Lease) -> None:
        self._reclaim()
        if lease.active:
            self._kept[self._slot_names[slot]] = lease
            self._keep_this = True

    def _release_slot(self, slot: int, bucket_index: int) -> None:
        kept, self._keep_this = self._keep_this, False
        returned, self._returned = self._returned, []
        rank = self.rank or 0
        ack = BucketAck(rank=rank, bucket_index=bucket_index, slot=slot, kept=kept, returned=returned)
        self._send_to(None, ack)
