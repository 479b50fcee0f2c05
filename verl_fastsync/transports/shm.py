"""``shm`` engine transport: two POSIX shared-memory segments used ping-pong, plus the zmq control
channel of :mod:`verl_fastsync.transports.controlled` on a private ``ipc://`` socket. Same host only
(trainer rank 0 and every rollout rank).

* Segments (:class:`verl_fastsync.io.shm.Segment`): created by the sender, mode 0600, unguessable
  names. Receivers map them when the sender's ``Welcome`` names them and confirm ``Attached``; the
  sender then unlinks the names at once, so nothing is left in ``/dev/shm`` even if every process is
  killed afterwards (the mappings stay valid until each side closes them).
* **Segments live as long as the transport**, not one sync: ``finalize`` closes the control channel
  only. The next sync reuses both segments when every receiver reports (in its ``Hello``) that it
  still maps them; otherwise (a new receiver, another bucket size) the sender makes two new ones.
  They are released when a sync fails, by :meth:`ShmTransport.release`, or at process exit (names
  are already gone, so exit leaks nothing). Cost between syncs: two buckets of shared memory.
* Flow per bucket ``k``: the sender waits until every receiver acked the bucket last held in slot
  ``k % 2``, copies bucket ``k``'s tensors into it (one memcpy per byte) and sends ``BucketReady``;
  receivers copy each tensor out into its own memory (one memcpy per byte; ``zero_copy=True`` hands
  out views instead) and ack once their consumer moved on. Copying bucket ``k+1`` in the sender
  overlaps the receivers reading bucket ``k``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from verl_fastsync.io.shm import SEGMENT_PREFIX, Segment, SegmentError
from verl_fastsync.transports.base import TransportError
from verl_fastsync.transports.controlled import ControlledTransport
from verl_fastsync.wire import Hello, Message, Welcome

__all__ = ["ShmTransport", "segment_prefix"]

_Segment = Segment  # the name tests and older code use


def segment_prefix() -> str:
    """Prefix of every segment name this transport creates (for leak checks)."""
    return SEGMENT_PREFIX


class ShmTransport(ControlledTransport):
    """Shared-memory engine transport (see module docstring)."""

    name: ClassVar[str] = "shm"

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._segments: list[Segment] = []
        self._peer_mapped: dict[bytes, list[str]] = {}

    @property
    def segment_names(self) -> list[str]:
        return [seg.name for seg in self._segments]

    # -- lifecycle ---------------------------------------------------------------------------

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

    def _end_sync(self) -> None:
        self._close_channel()  # the segments stay for the next sync

    def _release_buffers(self) -> None:
        segments, self._segments = self._segments, []
        for seg in segments:
            seg.unlink()
            seg.close()

    # -- sender ------------------------------------------------------------------------------

    def _sender_setup(self) -> None:
        if self._segments and all(seg.size == self.bucket_size for seg in self._segments):
            return
        self._release_buffers()
        self._create_segments()

    def _create_segments(self) -> None:
        for _ in range(2):
            self._segments.append(Segment.create(self.bucket_size))

    def _on_hello(self, ident: bytes, message: Message) -> bool:
        if isinstance(message, Hello):
            self._peers[ident] = message.rank
            self._peer_mapped[ident] = list(message.mapped)
            return True
        return False

    def _before_welcome(self) -> None:
        names = self.segment_names
        everyone = all(self._peer_mapped.get(ident) == names for ident in self._peers)
        if not everyone and not all(seg.linked for seg in self._segments):
            # some receiver lacks the (already unlinked) segments: make two new ones for everybody
            self._release_buffers()
            self._create_segments()
        self._peer_mapped = {}

    def _welcome_buffers(self) -> list[str]:
        return self.segment_names

    def _all_attached(self) -> None:
        for seg in self._segments:
            seg.unlink()  # every receiver mapped it: nothing can leak from here on
        super()._all_attached()

    def _sender_buffer(self, slot: int) -> torch.Tensor:
        tensor = self._segments[slot].tensor
        assert tensor is not None
        return tensor

    # -- receiver ----------------------------------------------------------------------------

    def _hello_message(self) -> Message:
        hello = super()._hello_message()
        assert isinstance(hello, Hello)
        hello.mapped = self.segment_names
        return hello

    def _attach(self, welcome: Welcome) -> None:
        if list(welcome.buffers) == self.segment_names and all(
            seg.size >= self.bucket_size for seg in self._segments
        ):
            return  # the same segments as last sync
        self._release_buffers()
        if len(welcome.buffers) != 2:
            raise TransportError(
                f"shm transport: the sender named {len(welcome.buffers)} segments, expected 2"
            )
        try:
            for name in welcome.buffers:
                self._segments.append(Segment.attach(name, self.bucket_size))
        except SegmentError as exc:
            raise TransportError(f"shm transport: {exc}") from exc

    def _receiver_buffer(self, slot: int) -> torch.Tensor:
        self._check_slot(slot)
        tensor = self._segments[slot].tensor
        assert tensor is not None
        return tensor
