"""The sender half of :class:`~verl_fastsync.transports.buffered.BufferedTransport`.

:meth:`SendingTransport.send` plans with :class:`~verl_fastsync.chunks.BucketPlanner` straight into
the transport's slot buffers: each tensor's bytes are in a bucket (or on a fenced device copy) before
the producer is asked for the next tensor, and no reference to a produced tensor is kept. Every
device that took part in the copies into a bucket is synchronized before the bucket is checksummed
or posted. A concrete transport supplies the primitives: :meth:`_sender_buffer`,
:meth:`_wait_slot_free`, :meth:`_post_bucket`, :meth:`_post_end`, :meth:`_post_abort`.
"""

from __future__ import annotations

import time
import uuid
from abc import abstractmethod
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Iterable
from typing import Any

import msgspec
import torch

from verl_fastsync.chunks import (
    FLUSH_BUCKET,
    AlignSpec,
    Bucket,
    BucketPlanner,
    ChunkMeta,
    FlushBucket,
    chunk_checksum,
    unpack_item,
)
from verl_fastsync.io.fence import synchronize_device
from verl_fastsync.transports.base import SENDER_RANK, PeerAbortedError, TransferStats, TransportError
from verl_fastsync.transports.lifecycle import InFlight, TransportCore
from verl_fastsync.wire import Abort, BucketReady, SyncEnd

__all__ = [
    "SendingTransport",
    "abort_for",
    "aiter_items",
    "delta_flush_bytes",
    "flush_every",
]

Item = tuple[str, torch.Tensor]


def abort_for(exc: BaseException, rank: int | None, reason: str) -> Abort:
    """The ``Abort`` a side sends when it fails with ``exc``: the first failure's origin and cause
    when ``exc`` relays another rank's, else ``reason`` from ``rank`` (this side)."""
    if isinstance(exc, PeerAbortedError) and exc.cause is not None:
        return Abort(reason=exc.cause, rank=exc.origin)
    return Abort(reason=reason, rank=rank)


class SendingTransport(TransportCore):
    """The sender side of a double-buffered engine transport (see the module docstring)."""

    @abstractmethod
    def _sender_buffer(self, slot: int) -> torch.Tensor: ...

    @abstractmethod
    def _wait_slot_free(self, slot: int) -> None:
        """Block (at most ``timeout_s``) until every receiver is done with ``slot``."""

    @abstractmethod
    def _post_bucket(self, slot: int, message: BucketReady) -> None:
        """Start moving the packed bucket in ``slot`` to every receiver."""

    @abstractmethod
    def _post_end(self, message: SyncEnd) -> None: ...

    @abstractmethod
    def _post_abort(self, message: Abort) -> None:
        """Best effort: tell the receivers this sync failed (must not block past the timeout)."""

    def _between_tensors(self) -> None:
        """Called after each tensor is packed (hook, e.g. to notice a transfer in flight completed)."""

    def _device_sync(self, buffer: torch.Tensor) -> None:
        """Make device copies into/out of ``buffer`` complete before it is handed over."""
        synchronize_device(buffer.device)

    async def send(
        self,
        named_tensors: Iterable[Item | FlushBucket] | AsyncIterable[Item | FlushBucket],
        *,
        align: AlignSpec = None,
    ) -> TransferStats:
        """Sends ``named_tensors`` (a :data:`~verl_fastsync.chunks.FLUSH_BUCKET` among them closes the
        open bucket: it goes out without waiting to fill)."""
        if self.rank is None or self.rank != SENDER_RANK:
            raise TransportError(
                f"{self.name} transport: send() on rank {self.rank}; only trainer rank 0 sends "
                "(call init_process_group first)"
            )
        stats = TransferStats(role="sender", bucket_size=self.bucket_size, buffer_bytes=self._buffer_bytes())
        stats.peak_extra_bytes = stats.buffer_bytes
        self._stats = stats
        sync_id = uuid.uuid4().hex
        tensors: set[int] = set()
        start = time.perf_counter()

        def acquire(index: int) -> torch.Tensor:
            slot = index % self.slots
            self.inflight.phase = "wait-slot-free"
            self.inflight.bucket = index
            self._wait_slot_free(slot)
            self.inflight.phase = "pack"
            return self._sender_buffer(slot)

        def ship(bucket: Bucket) -> None:
            assert bucket.buffer is not None
            buffer = bucket.buffer
            metas: list[ChunkMeta] = bucket.metas
            if self.options.verify:
                metas = [
                    msgspec.structs.replace(
                        m,
                        checksum=chunk_checksum(buffer[m.bucket_offset : m.bucket_offset + m.chunk_size]),
                    )
                    for m in metas
                ]
            self.inflight.phase = "post-bucket"
            self.inflight.bucket = bucket.index
            self._post_bucket(
                bucket.index % self.slots,
                BucketReady(
                    sync_id=sync_id,
                    bucket_index=bucket.index,
                    slot=bucket.index % self.slots,
                    nbytes=bucket.nbytes,
                    chunks=metas,
                ),
            )
            stats.buckets += 1
            stats.chunks += len(metas)
            stats.bytes += sum(m.chunk_size for m in metas)
            tensors.update(m.tensor_index for m in metas)
            if metas:
                self.inflight.last_tensor = metas[-1].name
            self.inflight.phase = "pack"

        planner = BucketPlanner(self.bucket_size, align=align, acquire=acquire, on_full=ship)
        self.inflight = InFlight(phase="pack", bucket=0)
        try:
            async for item in aiter_items(named_tensors):
                if item is FLUSH_BUCKET:
                    planner.flush()
                    continue
                name, tensor = unpack_item(item)
                del item
                self.inflight.tensor = name if isinstance(name, str) else None
                planner.add(name, tensor)
                del tensor  # the bytes are ours now: keep nothing of the producer's
                self._between_tensors()
                self.inflight.last_tensor, self.inflight.tensor = self.inflight.tensor, None
            planner.finish()
            self.inflight = InFlight(phase="drain", last_tensor=self.inflight.last_tensor)
            for slot in range(self.slots):
                self._wait_slot_free(slot)
            stats.tensors = len(tensors)
            self.inflight.phase = "end"
            self._post_end(
                SyncEnd(
                    sync_id=sync_id,
                    num_buckets=stats.buckets,
                    num_tensors=stats.tensors,
                    total_bytes=stats.bytes,
                )
            )
        except BaseException as exc:
            try:
                self._post_abort(abort_for(exc, self.rank, f"{type(exc).__name__}: {exc}"))
            finally:
                self._safe_close()
            raise
        stats.seconds = time.perf_counter() - start
        stats.buffer_bytes = max(stats.buffer_bytes, self._buffer_bytes())  # e.g. a segment made mid-sync
        stats.peak_extra_bytes = max(stats.peak_extra_bytes, stats.buffer_bytes)
        self.inflight = InFlight()
        return stats


async def aiter_items(items: Iterable[Any] | AsyncIterable[Any]) -> AsyncGenerator[Any, None]:
    """One async iterator over a sync or async iterable that holds no reference to an item once the
    consumer asks for the next one."""
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
            del item
    else:
        for item in items:
            yield item
            del item


def delta_flush_bytes(bucket_size: int) -> int:
    """Model bytes after which a delta stream posts its open bucket: a quarter of the bucket. A delta
    sync's sender encodes (and copies raw tensors into its base) before the link starts, and each
    receiver rebuilds (and copies into its base) after the last bytes arrive, so the first and last
    posts are on the sync's critical path; smaller posts shorten both. ``delta_bench --pin`` at
    10 Gbit/s, 32 MiB buckets, 8 re-initialised steps each (every value changed: the raw fallback):
    0.87-0.96x a full sync's speed posting per bucket, 0.96-1.03x per quarter (per half bucket
    0.90-0.98x, per eighth 0.89-1.00x); 1% changed: 1.62-1.77x and 1.72-1.98x. A full sync gains
    nothing measurable from finer posts (it only packs into the bucket), so it posts full buckets."""
    return max(1, bucket_size // 4)


async def flush_every(
    items: AsyncIterable[Item], every: int, stands_for: Callable[[], int]
) -> AsyncGenerator[Item | FlushBucket, None]:
    """``items``, with a :data:`~verl_fastsync.chunks.FLUSH_BUCKET` after each ``every`` bytes of what
    they stand for (``stands_for()``: the bytes so far, e.g. the model bytes a delta stream encoded:
    its buckets then go out as often as a full sync's would, though they hold a fraction of that)."""
    flushed = 0
    async for item in items:
        yield item
        del item
        if stands_for() - flushed >= every:
            flushed = stands_for()
            yield FLUSH_BUCKET
