"""The double-buffered engine transport base class third parties extend, and its receiver half.

:class:`BufferedTransport` = :class:`~verl_fastsync.transports.lifecycle.TransportCore` (lifecycle)
+ :class:`~verl_fastsync.transports.sending.SendingTransport` (the sender) + the receiver here. It
implements the pipelining (bucket ``k+1`` is packed while bucket ``k`` moves; one bucket buffer
per slot, two slots unless the transport says otherwise), the timeouts, the verify checksums, the
abort path and the statistics once; a concrete transport only supplies the buffers and how a bucket
moves.

Receiver contract: by default (``TransportOptions.zero_copy=False``) every yielded tensor stays
valid, with the bytes the sender sent, for as long as the consumer holds it. A transport that sets
:attr:`BufferedTransport.lends` keeps that promise without a copy for tensors carried whole in one
chunk: it lends views into its host receive buffer (:mod:`verl_fastsync.io.lending`) and, when the
consumer still references a buffer where its slot is needed again, gives the slot another buffer
(:meth:`BufferedTransport._swap_receive_buffer`). Other transports, device buffers and tensors
assembled from several chunks get their own memory (one copy). With ``zero_copy=True`` a tensor
carried whole in one chunk is a view into the receive bucket, valid only until the consumer asks for
the next tensor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from abc import abstractmethod
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import torch

from verl_fastsync.chunks import Allocate, Assembler, bucket_chunk_views
from verl_fastsync.io.lending import DestinationPool, Lease, LendingPool
from verl_fastsync.transports.base import (
    PeerAbortedError,
    TransferStats,
    TransportError,
    allocate_bucket_buffers,
    failure_reason,
)
from verl_fastsync.transports.lifecycle import InFlight
from verl_fastsync.transports.sending import SendingTransport, abort_for
from verl_fastsync.wire import Abort, BucketReady, SyncEnd

__all__ = ["BufferedTransport"]


class BufferedTransport(SendingTransport):
    """Double-buffered engine transport: subclasses provide buffers and movement primitives.

    Sender primitives: :meth:`_sender_buffer`, :meth:`_wait_slot_free`, :meth:`_post_bucket`,
    :meth:`_post_end`, :meth:`_post_abort`. Receiver primitives: :meth:`_receiver_buffer`,
    :meth:`_recv_next` (blocking; runs in a worker thread), :meth:`_release_slot`. Plus
    :meth:`_connect` / :meth:`_close` for the lifecycle. Set ``prefetch = True`` when
    :meth:`_recv_next` itself moves the data (e.g. a collective) so bucket ``k+1`` arrives while the
    consumer handles bucket ``k``; it must then not share a non-thread-safe handle with
    :meth:`_release_slot`.
    """

    lends: bool = False
    """The receiver lends views into its host receive buffers instead of copying (the safe default,
    see the module docstring); the transport then implements :meth:`_swap_receive_buffer`."""

    _lending_pool: LendingPool | None = None
    _destinations: DestinationPool | None = None
    _open_stream: tuple[int, Lease | None] | None = None
    """The receive stream of the current sync until it ends: the slot and lease it has out now."""

    @abstractmethod
    def _receiver_buffer(self, slot: int) -> torch.Tensor: ...

    def _swap_receive_buffer(self, slot: int, buffer: torch.Tensor) -> None:
        """Receive into ``buffer`` from now on in ``slot``: the consumer still holds the slot's last
        buffer (tell the sender where it needs to know)."""
        raise NotImplementedError(f"{type(self).__name__} sets lends but cannot swap receive buffers")

    def _can_lend(self, slot: int) -> bool:
        """Whether the bucket now in ``slot`` may be lent (else its tensors are copied out)."""
        return True

    def _lends_now(self) -> bool:
        return self.lends and not self.options.zero_copy and torch.device(self.options.device).type == "cpu"

    def _spare_pool(self) -> LendingPool:
        pool = self._lending_pool
        if pool is None or pool.size != self.bucket_size:
            pool = LendingPool(self.bucket_size, lambda size: allocate_bucket_buffers(size, count=1)[0])
            self._lending_pool = pool
        return pool

    def _drop_lending_pool(self) -> None:
        """Forget spares and loans (the consumer's views keep their memory alive by themselves)."""
        pool, self._lending_pool = self._lending_pool, None
        if pool is not None:
            pool.clear()

    def _buffer_bytes(self) -> int:
        """The slots' buffers plus the spares kept for lending and the free destination buffers of
        split tensors (buffers on loan are the consumer's)."""
        pool, dest = self._lending_pool, self._destinations
        spares = pool.spares * pool.size if pool is not None else 0
        return super()._buffer_bytes() + spares + (dest.free_bytes if dest is not None else 0)

    def _settle(self, slot: int, lease: Lease) -> None:
        """Before ``slot`` is released: if the consumer still references its buffer, the buffer stays
        with the consumer and the slot receives into a spare from now on."""
        pool = self._spare_pool()
        if lease.active:
            pool.loan(lease)
            self._swap_receive_buffer(slot, pool.take())

    @abstractmethod
    def _recv_next(self) -> BucketReady | SyncEnd:
        """Block (at most ``timeout_s``) for the next bucket (data in its slot) or the end.
        Raises :class:`PeerAbortedError` on an :class:`Abort`."""

    @abstractmethod
    def _release_slot(self, slot: int, bucket_index: int) -> None:
        """The consumer is done with ``slot``; tell the sender if it needs to know."""

    def _receive_done(self) -> None:
        """Hook run after the end message (e.g. a final ack)."""

    def _interrupt_receive(self) -> bool:
        """Make a running :meth:`_recv_next` return promptly (it may raise); True when supported.
        Called on the receive error path so that no handle is closed while the worker thread uses it."""
        return False

    def _destination_allocator(self) -> Allocate | None:
        """Where tensors assembled from several chunks are allocated: on the host, a
        :class:`~verl_fastsync.io.lending.DestinationPool` that reuses the memory of such tensors
        once the consumer dropped them (it lives as long as the transport, like its buckets);
        elsewhere ``None`` (``torch.empty``)."""
        if torch.device(self.options.device).type != "cpu":
            return None
        if self._destinations is None:
            self._destinations = DestinationPool()
        return self._destinations.allocate

    def _safe_close(self) -> None:
        super()._safe_close()
        self._destinations = None  # a failed sync or release(): free everything

    def _lend_bucket(self, slot: int, buffer: torch.Tensor) -> tuple[torch.Tensor, Lease]:
        """Lend ``buffer`` (the bucket now in ``slot``). Default: through the spare pool, so that a
        buffer the consumer lets go of after its slot moved on returns to the pool at once."""
        return self._spare_pool().lend(buffer)

    def _held_bytes(self) -> int:
        """Bytes of this side's buffers the consumer references now (lent, not yet returned)."""
        pool, dest = self._lending_pool, self._destinations
        return (pool.loaned_bytes if pool is not None else 0) + (dest.loaned_bytes if dest is not None else 0)

    def _fence_bucket(self, assembler: Assembler, buffer: torch.Tensor) -> None:
        """Every copy out of ``buffer`` is complete: those into device destinations (issued
        non-blocking, see :attr:`Assembler.fence`) and any on the bucket's own device."""
        assembler.fence.wait()
        self._device_sync(buffer)

    def _check_generation(self, generation: int) -> None:
        if self.sync_generation != generation:
            raise TransportError(
                f"{self.me}: this receive stream belongs to a "
                "sync that has ended (finalize or a new init_process_group ran since it started); "
                "iterate the stream of the current sync"
            )

    def _end_open_stream(self) -> None:
        """A new sync starts, or this one is finalized, while the last receive stream never reached
        its end and nobody closed it: it failed. Keep what the consumer may still hold away from the
        next sync, tell the sender, free the per-sync state (a stream finalized later touches
        nothing: its generation is over)."""
        open_stream, self._open_stream = self._open_stream, None
        if open_stream is None:
            return
        slot, lease = open_stream
        if lease is not None and lease.active:
            try:
                self._settle(slot, lease)
            except Exception:  # pragma: no cover - best effort
                pass
        reason = "the rollout's receive stream was left open when the sync ended (nobody closed it)"
        self.abort_receive(reason)

    def abort_receive(self, reason: str) -> None:
        """Fail this rank's part of the current sync without a receive stream (e.g. the consumer
        failed before it asked for the first tensor): tell the sender ``reason`` at once."""
        try:
            self._post_abort(Abort(reason=reason, rank=self.rank))
        except Exception:  # pragma: no cover - best effort
            pass
        self._safe_close()

    async def receive(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        if self.rank is None or self.rank < 1:
            raise TransportError(
                f"{self.name} transport: receive() on rank {self.rank}; only rollout ranks receive "
                "(call init_process_group first)"
            )
        generation = self.sync_generation
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fastsync-{self.name}")
        loop = asyncio.get_running_loop()
        lending = self._lends_now()
        assembler = Assembler(
            self.options.device,
            zero_copy=self.options.zero_copy or lending,
            verify=self.options.verify,
            allocate=self._destination_allocator(),
        )
        stats = TransferStats(
            role="receiver", bucket_size=self.bucket_size, buffer_bytes=self._buffer_bytes()
        )
        self._stats = stats
        start = time.perf_counter()
        executor = self._executor
        pending: concurrent.futures.Future[BucketReady | SyncEnd] | None = None
        expected = 0
        yielded = 0
        lease: Lease | None = None  # the bucket lent now, until its slot is settled
        lent_slot = 0
        buffer: torch.Tensor | None = None
        self._open_stream = (0, None)
        try:
            self.inflight = InFlight(phase="wait-bucket", bucket=0)
            pending = executor.submit(self._recv_next)
            while True:
                message = await asyncio.wrap_future(pending, loop=loop)
                pending = None
                self._check_generation(generation)
                if isinstance(message, SyncEnd):
                    self.inflight.phase = "end"
                    assembler.finish()
                    if (message.num_buckets, message.num_tensors, message.total_bytes) != (
                        stats.buckets,
                        assembler.num_tensors,
                        stats.bytes,
                    ):
                        raise TransportError(
                            f"{self.me}: sender reports "
                            f"{message.num_buckets} buckets / {message.num_tensors} tensors / "
                            f"{message.total_bytes} bytes, received {stats.buckets} / "
                            f"{assembler.num_tensors} / {stats.bytes}"
                        )
                    self._receive_done()
                    break
                if message.bucket_index != expected:
                    raise TransportError(
                        f"{self.me}: expected bucket {expected}, got bucket {message.bucket_index}"
                    )
                expected += 1
                if self.prefetch:
                    self.inflight.bucket = message.bucket_index + 1
                    pending = executor.submit(self._recv_next)
                buffer = self._receiver_buffer(message.slot)
                self._device_sync(buffer)
                self.inflight.phase = "assemble"
                self.inflight.bucket = message.bucket_index
                if lending and buffer.device.type == "cpu" and self._can_lend(message.slot):
                    lent, lease = self._lend_bucket(message.slot, buffer)
                    lent_slot = message.slot
                    self._open_stream = (lent_slot, lease)
                    view = lent[: message.nbytes]
                    del lent
                else:
                    view = buffer[: message.nbytes]
                # views only of a lent buffer (or with the zero_copy opt-in), copies otherwise
                assembler.zero_copy = self.options.zero_copy or lease is not None
                data = view
                for meta, data in bucket_chunk_views(view, message.chunks):
                    self.inflight.tensor = meta.name
                    stats.chunks += 1
                    stats.bytes += meta.chunk_size
                    completed = assembler.feed(meta, data)
                    while completed:
                        item = completed.pop()
                        self.inflight.tensor = None
                        self.inflight.last_tensor = item[0]
                        self.inflight.phase = "consumer"
                        yield item
                        # drop our reference: the consumer alone decides how long a tensor lives
                        del item
                        yielded += 1
                        self._check_generation(generation)
                        self.inflight.phase = "assemble"
                    if assembler.incomplete:
                        self.inflight.tensor = assembler.incomplete[0]
                del view, data  # only the consumer may keep a lent view alive
                stats.buckets += 1
                stats.buffer_bytes = max(stats.buffer_bytes, self._buffer_bytes())
                stats.peak_extra_bytes = stats.buffer_bytes + assembler.peak_in_progress_bytes
                self._fence_bucket(assembler, buffer)  # before the slot can be refilled or reused
                buffer = None
                if lease is not None:
                    self._settle(message.slot, lease)
                    lease = None
                    self._open_stream = (0, None)
                self._release_slot(message.slot, message.bucket_index)
                if pending is None:
                    self.inflight.phase = "wait-bucket"
                    self.inflight.bucket = expected
                    pending = executor.submit(self._recv_next)
                else:
                    self.inflight.phase = "wait-bucket"
        except BaseException as exc:
            if self.sync_generation != generation:
                # a stream of an ended sync (closed or garbage-collected late): the transport now
                # belongs to another sync; whatever this one held was settled when it ended
                raise
            self._open_stream = None
            if buffer is not None:
                try:
                    self._fence_bucket(assembler, buffer)
                except Exception:  # pragma: no cover - best effort
                    pass
            if lease is not None and lease.active:
                # the consumer may keep what it got before the failure, and a transport may keep its
                # buffers for the next sync (nixl, when a WRITE can still land): never refill this one
                try:
                    self._settle(lent_slot, lease)
                except Exception:  # pragma: no cover - best effort
                    pass
            if not (isinstance(exc, PeerAbortedError) and exc.cause is not None):  # else the sender told us
                try:
                    self._post_abort(abort_for(exc, self.rank, failure_reason(exc, yielded)))
                except Exception:  # pragma: no cover - best effort
                    pass
            if pending is not None and not pending.cancel():
                # _recv_next is running on the worker thread: stop it before its handles close
                if self._interrupt_receive():
                    concurrent.futures.wait([pending], timeout=self.options.timeout_s)
            self._safe_close()
            raise
        self._open_stream = None
        stats.tensors = assembler.num_tensors
        stats.copied_bytes = assembler.allocated_bytes
        stats.seconds = time.perf_counter() - start
        stats.peak_extra_bytes = stats.buffer_bytes + assembler.peak_in_progress_bytes
        stats.held_bytes = self._held_bytes()
        self.inflight = InFlight()
