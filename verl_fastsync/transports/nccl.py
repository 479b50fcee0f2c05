"""``nccl`` engine transport: a cupy NCCL communicator between trainer rank 0 and every rollout rank,
buckets in device memory, broadcast from rank 0; a pyzmq channel carries the control messages.

Importable without a GPU or NCCL (cupy is imported when a process group is built); using it without
CUDA fails in :meth:`init_process_group` with a clear error.

* Handshake: receivers say ``Hello`` to the sender's ZMQ ROUTER (``tcp://``); the sender creates the
  NCCL unique id and sends it in ``Welcome``; after every ``Attached`` all ranks create the
  communicator (world = 1 + rollout ranks) and allocate two device bucket buffers.
* Per bucket: the sender packs into the slot's buffer on the current stream, synchronizes the device
  (a bucket is only handed over once its bytes are in place), sends ``BucketReady`` and enqueues the
  broadcast; an event marks when the slot may be packed again. Receivers prefetch: bucket ``k+1`` is
  received into the other buffer while their consumer handles bucket ``k``; the collective itself
  guarantees a receive buffer is only written once the receiver posted it.
* Every wait polls with the ``timeout_s`` deadline; on expiry the communicator is aborted and the
  error names the peer, phase, bucket and tensor.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import torch

from verl_fastsync.transports.base import TransportError
from verl_fastsync.transports.tcp import TcpControlledTransport
from verl_fastsync.wire import BucketReady, SyncEnd, Welcome

__all__ = ["NcclTransport", "new_communicator"]


def new_communicator(nccl: Any, world_size: int, uid: bytes, rank: int) -> Any:
    """``nccl.NcclCommunicator`` (cupy's) for the 128-byte unique id ``uid``, in the form this cupy
    takes: cupy 14 takes ``bytes``, earlier releases a tuple of signed chars; either refuses the other
    with a ``TypeError`` before NCCL is called (seen on an H200 with cupy 14.2: "Argument 'commId'
    has incorrect type (expected bytes, got tuple)")."""
    try:
        return nccl.NcclCommunicator(world_size, uid, rank)
    except TypeError:
        return nccl.NcclCommunicator(world_size, tuple(b if b < 128 else b - 256 for b in uid), rank)


class NcclTransport(TcpControlledTransport):
    """NCCL broadcast engine transport (see module docstring)."""

    name: ClassVar[str] = "nccl"
    prefetch: ClassVar[bool] = True

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._comm: Any = None
        self._uid: bytes | None = None
        self._bufs: list[torch.Tensor] = []
        self._events: list[Any] = [None, None]
        self._device: torch.device | None = None

    # -- setup -------------------------------------------------------------------------------

    def _cuda_device(self) -> torch.device:
        if not torch.cuda.is_available():
            raise TransportError(
                "nccl transport needs a CUDA device on every participating rank; use shm, gloo or nixl on CPU"
            )
        device = torch.device(self.options.device)
        if device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def buffer_device(self) -> str:
        """Bucket buffers live on the current CUDA device (``bucket_bytes=auto`` sizes against it)."""
        device = torch.device(self.options.device)
        if device.type == "cuda":
            return str(device)
        return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"

    def _connect(self, **kwargs: Any) -> None:
        self._device = self._cuda_device()
        super()._connect(**kwargs)
        if self.rank != 0:
            self._init_comm()

    def _sender_setup(self) -> None:
        from cupy.cuda import nccl

        self._uid = bytes(bytearray(x & 0xFF for x in nccl.get_unique_id()))

    def _welcome_buffers(self) -> list[str]:
        assert self._uid is not None
        return [self._uid.hex()]

    def _attach(self, welcome: Welcome) -> None:
        if len(welcome.buffers) != 1:
            raise TransportError(f"{self.me}: the sender's welcome carries no NCCL unique id")
        self._uid = bytes.fromhex(welcome.buffers[0])

    def _all_attached(self) -> None:
        self._init_comm()

    def _init_comm(self) -> None:
        import cupy
        from cupy.cuda import nccl

        assert self._uid is not None and self._device is not None
        self.inflight.phase = "nccl-init"
        with cupy.cuda.Device(self._device.index or 0):
            self._comm = new_communicator(nccl, self.world_size, self._uid, int(self.rank or 0))
        self._bufs = [torch.empty(self.bucket_size, dtype=torch.uint8, device=self._device) for _ in range(2)]

    def _release_buffers(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.destroy()
            except Exception:  # pragma: no cover - best effort
                pass
        self._bufs = []
        self._events = [None, None]
        self._uid = None

    def _abort_comm(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.abort()
            except Exception:  # pragma: no cover - best effort
                pass

    # -- data path ---------------------------------------------------------------------------

    def _bcast(self, buffer: torch.Tensor) -> Any:
        from cupy.cuda import nccl

        stream = torch.cuda.current_stream(buffer.device)
        self._comm.bcast(buffer.data_ptr(), buffer.numel(), nccl.NCCL_UINT8, 0, stream.cuda_stream)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _wait_event(self, event: Any, peer: str, detail: str) -> None:
        deadline = self._deadline()
        while not event.query():
            if time.monotonic() > deadline:
                self._abort_comm()
                raise self._timeout_error(peer, detail)
            time.sleep(0.0005)

    def _sender_buffer(self, slot: int) -> torch.Tensor:
        return self._bufs[slot]

    def _receiver_buffer(self, slot: int) -> torch.Tensor:
        if slot not in (0, 1):
            raise TransportError(f"{self.me}: the sender named slot {slot}; only 0 and 1 exist")
        return self._bufs[slot]

    def _wait_slot_free(self, slot: int) -> None:
        event, self._events[slot] = self._events[slot], None
        if event is not None:
            self._wait_event(event, self._labels(self._peers.values()), f"broadcast from slot {slot}")

    def _post_bucket(self, slot: int, message: BucketReady) -> None:
        for ident in self._peers:
            self._send_to(ident, message)
        if message.nbytes:
            self._events[slot] = self._bcast(self._bufs[slot][: message.nbytes])

    def _recv_next(self) -> BucketReady | SyncEnd:
        message = super()._recv_next()
        if isinstance(message, BucketReady) and message.nbytes:
            if not 0 < message.nbytes <= self.bucket_size:
                raise TransportError(
                    f"{self.me}: bucket {message.bucket_index} claims {message.nbytes} bytes"
                )
            buffer = self._receiver_buffer(message.slot)[: message.nbytes]
            self._wait_event(self._bcast(buffer), f"{self.label(0)} at {self._endpoint}", "broadcast")
        return message

    def _release_slot(self, slot: int, bucket_index: int) -> None:
        """Nothing to tell: the next broadcast into this slot is only posted after this call."""

    def _post_abort(self, message: Any) -> None:
        if self.rank == 0:
            super()._post_abort(message)
        # receivers: the prefetch thread may own the control socket; aborting the communicator on
        # close makes the sender's next wait fail instead
        else:
            self._abort_comm()
