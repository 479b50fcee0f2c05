"""Receiver side of the chunk core: cut received buckets into chunks and assemble tensors.

:class:`Assembler` - ``feed(meta, data)`` returns the tensors completed by this chunk; ``finish()``
raises :class:`~verl_fastsync.chunks.meta.IncompleteTensorError` naming any tensor still missing
bytes. :func:`assemble` / :func:`aassemble` wrap it for sync / async chunk streams;
:func:`bucket_chunk_views` cuts a received bucket buffer into ``(meta, data)`` pairs.

Destination lifetime (the receiver contract)
--------------------------------------------
* default (``zero_copy=False``): every returned tensor is its own memory, allocated for it (or taken
  from ``allocate``); it stays valid for as long as the consumer holds it, whatever happens to the
  bucket it came from.
* ``zero_copy=True``: a tensor carried whole in one chunk that already lives on the destination
  device is returned as a **view into the bucket**; it is valid only until the consumer asks for the
  next tensor (the transport then refills the bucket). Tensors assembled from several chunks are
  always their own memory.
"""

from __future__ import annotations

import bisect
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Generator, Iterable

import torch

from verl_fastsync.chunks.meta import (
    CHUNK_SCHEMA_VERSION,
    ChunkCorruptedError,
    ChunkMeta,
    ChunkMismatchError,
    DuplicateTensorError,
    IncompleteTensorError,
    byte_view,
    chunk_checksum,
    copy_bytes,
    str_to_dtype,
)
from verl_fastsync.io.fence import DeviceFence

__all__ = ["Allocate", "Assembler", "aassemble", "assemble", "bucket_chunk_views"]

Allocate = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
"""``allocate(shape, dtype, device)`` -> an uninitialised tensor the consumer will own."""


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def bucket_chunk_views(
    buffer: torch.Tensor, metas: Iterable[ChunkMeta]
) -> Generator[tuple[ChunkMeta, torch.Tensor], None, None]:
    """Cut a received bucket buffer into ``(meta, data)`` pairs (views, no copy)."""
    size = buffer.numel()
    for meta in metas:
        end = meta.bucket_offset + meta.chunk_size
        if meta.bucket_offset < 0 or meta.chunk_size < 0 or end > size:
            raise ChunkMismatchError(
                f"chunk of tensor {meta.name!r} claims bucket bytes [{meta.bucket_offset}, {end}) "
                f"outside the {size}-byte bucket"
            )
        yield meta, buffer[meta.bucket_offset : end]


class _Pending:
    __slots__ = ("buffer", "first", "intervals", "received", "tensor")

    def __init__(self, first: ChunkMeta, tensor: torch.Tensor) -> None:
        self.first = first
        self.tensor = tensor
        self.buffer = byte_view(tensor)
        self.intervals: list[tuple[int, int]] = []  # sorted, non-overlapping [start, end)
        self.received = 0


class Assembler:
    """Receiver-side reassembly of chunk streams into tensors.

    Each tensor split over several chunks is allocated once, on ``device``, and every chunk is copied
    straight into it (a device destination is written from the bucket directly, no CPU round trip).
    A tensor is returned only when all its bytes have arrived.

    :param device: where destination tensors are allocated.
    :param zero_copy: when a chunk carries a whole tensor and already lives on ``device``, return a
        view into the bucket instead of a copy. **Lifetime:** such a view aliases the transport's
        bucket buffer and is valid only until the consumer asks the receive iterator for the next
        item; a consumer that keeps tensors must ``clone()`` them. Default ``False``: every returned
        tensor is its own memory and stays valid as long as the consumer holds it.
    :param allocate: where destination tensors come from (default ``torch.empty``).
    :param verify: check each chunk's xxhash ``checksum`` (set by a sender with ``verify``); a
        mismatch or a missing checksum raises :class:`ChunkCorruptedError` naming the tensor.

    Attributes ``in_progress_bytes`` / ``peak_in_progress_bytes`` account for destination buffers of
    tensors not yet complete (the receiver's extra memory beyond its buckets); ``allocated_bytes``
    counts every destination allocated (including ones handed to the consumer).
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        zero_copy: bool = False,
        verify: bool = False,
        allocate: Allocate | None = None,
    ) -> None:
        self.device = torch.device(device)
        self._allocate = allocate or _empty
        self.zero_copy = zero_copy
        self.verify = verify
        self._pending: dict[str, _Pending] = {}
        self._done: set[str] = set()
        self._next_index = 0
        self.in_progress_bytes = 0
        self.peak_in_progress_bytes = 0
        self.allocated_bytes = 0
        self.num_tensors = 0
        self.num_chunks = 0
        self.total_bytes = 0
        self.fence = DeviceFence()
        """Every device a copy out of a received chunk touched (copies involving a device are
        issued non-blocking): ``fence.wait()`` before the bucket they read is refilled or reused."""

    def _validate(self, meta: ChunkMeta, data: torch.Tensor) -> torch.dtype:
        # ``schema_version`` defaults to the current version for a ChunkMeta built in this process, so
        # this check alone cannot see a *missing* version; a chunk from a peer is decoded only after
        # verl_fastsync.wire.check_chunk_versions, which refuses it as version 0 (the wire rule)
        if meta.schema_version != CHUNK_SCHEMA_VERSION:
            raise ChunkMismatchError(
                f"chunk of tensor {meta.name!r} has chunk schema version {meta.schema_version}, "
                f"this receiver speaks version {CHUNK_SCHEMA_VERSION}"
            )
        dtype = str_to_dtype(meta.dtype)
        numel = 1
        for dim in meta.shape:
            if dim < 0:
                raise ChunkMismatchError(f"tensor {meta.name!r}: negative dimension in shape {meta.shape}")
            numel *= dim
        if numel * dtype.itemsize != meta.total_bytes:
            raise ChunkMismatchError(
                f"tensor {meta.name!r}: total_bytes={meta.total_bytes} but shape {meta.shape} of "
                f"{meta.dtype} needs {numel * dtype.itemsize}"
            )
        start, end = meta.chunk_offset, meta.chunk_offset + meta.chunk_size
        if start < 0 or meta.chunk_size < 0 or end > meta.total_bytes:
            raise ChunkMismatchError(
                f"tensor {meta.name!r}: chunk [{start}, {end}) out of range for {meta.total_bytes} bytes"
            )
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
            raise ChunkMismatchError(f"tensor {meta.name!r}: chunk data must be a flat uint8 tensor")
        if data.numel() != meta.chunk_size:
            raise ChunkMismatchError(
                f"tensor {meta.name!r}: chunk claims {meta.chunk_size} bytes, data has {data.numel()}"
            )
        if self.verify:
            if meta.checksum is None:
                raise ChunkCorruptedError(
                    f"tensor {meta.name!r}: verify is on but the sender sent no checksum "
                    "(enable verify on both sides)"
                )
            actual = chunk_checksum(data)
            if actual != meta.checksum:
                raise ChunkCorruptedError(
                    f"tensor {meta.name!r}: chunk [{start}, {end}) is corrupted "
                    f"(checksum {actual:#x} != sent {meta.checksum:#x})"
                )
        return dtype

    def feed(self, meta: ChunkMeta, data: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Accept one chunk; return the tensors it completed (0 or 1), in order."""
        dtype = self._validate(meta, data)
        name = meta.name
        if name in self._done:
            raise DuplicateTensorError(f"tensor {name!r} received twice in one weight sync")
        self.num_chunks += 1
        pending = self._pending.get(name)
        if pending is None:
            if meta.chunk_size == meta.total_bytes:
                # the whole tensor in one chunk
                self._done.add(name)
                self.num_tensors += 1
                self.total_bytes += meta.total_bytes
                if (
                    self.zero_copy
                    and meta.total_bytes
                    and data.device == self.device
                    and data.storage_offset() % dtype.itemsize == 0
                ):
                    return [(name, data.view(dtype).view(meta.shape))]
                out = self._allocate(tuple(meta.shape), dtype, self.device)
                self.allocated_bytes += meta.total_bytes
                if meta.total_bytes:
                    copy_bytes(byte_view(out), data)
                    self.fence.note(out, data)
                return [(name, out)]
            tensor = self._allocate(tuple(meta.shape), dtype, self.device)
            self.allocated_bytes += meta.total_bytes
            pending = _Pending(meta, tensor)
            self._pending[name] = pending
            self.in_progress_bytes += meta.total_bytes
            self.peak_in_progress_bytes = max(self.peak_in_progress_bytes, self.in_progress_bytes)
        else:
            first = pending.first
            if (meta.shape, meta.dtype, meta.total_bytes, meta.tensor_index) != (
                first.shape,
                first.dtype,
                first.total_bytes,
                first.tensor_index,
            ):
                raise ChunkMismatchError(
                    f"tensor {name!r}: chunk metadata (shape={meta.shape}, dtype={meta.dtype}, "
                    f"total_bytes={meta.total_bytes}) differs from its first chunk (shape={first.shape}, "
                    f"dtype={first.dtype}, total_bytes={first.total_bytes})"
                )
        start, end = meta.chunk_offset, meta.chunk_offset + meta.chunk_size
        if start == end:
            return []
        pos = bisect.bisect_left(pending.intervals, (start, end))
        if (pos > 0 and pending.intervals[pos - 1][1] > start) or (
            pos < len(pending.intervals) and pending.intervals[pos][0] < end
        ):
            raise ChunkMismatchError(
                f"tensor {name!r}: chunk [{start}, {end}) overlaps bytes already received"
            )
        pending.intervals.insert(pos, (start, end))
        copy_bytes(pending.buffer[start:end], data)
        self.fence.note(pending.buffer, data)
        pending.received += end - start
        if pending.received < meta.total_bytes:
            return []
        del self._pending[name]
        self._done.add(name)
        self.num_tensors += 1
        self.total_bytes += meta.total_bytes
        self.in_progress_bytes -= meta.total_bytes
        return [(name, pending.tensor)]

    @property
    def incomplete(self) -> list[str]:
        """Names of tensors that have received some but not all of their bytes."""
        return list(self._pending)

    def finish(self) -> None:
        """End of sync: raise :class:`IncompleteTensorError` if a tensor is still missing bytes."""
        if self._pending:
            details = ", ".join(
                f"{name!r} ({p.received}/{p.first.total_bytes} bytes)" for name, p in self._pending.items()
            )
            raise IncompleteTensorError(f"weight sync ended with incomplete tensor(s): {details}")


def assemble(
    chunks: Iterable[tuple[ChunkMeta, torch.Tensor]],
    device: torch.device | str = "cpu",
    *,
    zero_copy: bool = False,
    verify: bool = False,
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Reassemble a synchronous chunk stream; see :class:`Assembler`."""
    assembler = Assembler(device, zero_copy=zero_copy, verify=verify)
    for meta, data in chunks:
        yield from assembler.feed(meta, data)
    assembler.finish()


async def aassemble(
    chunks: Iterable[tuple[ChunkMeta, torch.Tensor]] | AsyncIterable[tuple[ChunkMeta, torch.Tensor]],
    device: torch.device | str = "cpu",
    *,
    zero_copy: bool = False,
    verify: bool = False,
) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
    """Reassemble a sync or async chunk stream; see :class:`Assembler`."""
    assembler = Assembler(device, zero_copy=zero_copy, verify=verify)
    if isinstance(chunks, AsyncIterable):
        async for meta, data in chunks:
            for item in assembler.feed(meta, data):
                yield item
    else:
        for meta, data in chunks:
            for item in assembler.feed(meta, data):
                yield item
    assembler.finish()
