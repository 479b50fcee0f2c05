"""The one bucket planner of both paths (engine and colocated): it lays named tensors out in
fixed-size buckets and **copies each tensor's bytes into its bucket when the tensor is added**.

Rules
-----
* **Keep whole when it fits.** A tensor no larger than the bucket is never split: when the current
  bucket has no room for it, the bucket is closed and the tensor starts the next one.
* **Split anything larger than the bucket** into byte chunks. Its first chunk fills the room left in
  the current bucket, each following chunk fills a bucket, the tail starts the next bucket.
* **Cut on expert boundaries.** With ``align`` (e.g. :func:`expert_alignment` or
  :func:`~verl_fastsync.chunks.meta.leading_slice_bytes`), chunk sizes are multiples of the tensor's
  alignment unit; when the room left is less than one unit, the tensor starts in the next bucket;
  when one unit is larger than the bucket, the tensor is cut on plain bytes.
* **One chunked tensor at a time.** A split never starts in a bucket that holds another split's
  tail, so a receiver that assembles in bucket order has at most one chunked tensor in progress.
* Tensors keep their input order; every chunk starts at a multiple of :data:`BUCKET_ALIGN`;
  a zero-size tensor is one zero-size chunk; duplicate names raise
  :class:`~verl_fastsync.chunks.meta.DuplicateTensorError`; an empty sync raises
  :class:`~verl_fastsync.chunks.meta.EmptySyncError` unless ``allow_empty``.

Ownership of bytes
------------------
:meth:`BucketPlanner.add` copies the tensor's bytes into the bucket buffer (a memcpy on the host, or
a device copy recorded on a :class:`~verl_fastsync.io.fence.DeviceFence`) before it returns, and
keeps no reference to the tensor. A producer may therefore refill or restore the tensor as soon as
``add`` returns, i.e. before it is asked for the next one. A copy from a device source is issued on
the current stream, so work the producer queues later on that stream (a refill of the source) is
ordered after it; the fence is waited on before a bucket is handed to ``on_full`` (sent or
checksummed). A copy from a **host** source into device memory (e.g. a pinned host staging buffer)
is asynchronous with respect to the host, and a producer refills a host buffer from the host, which
no stream orders: for that copy ``add`` waits for the fence before it returns.

Where the bytes go: ``acquire(bucket_index)`` returns the flat ``uint8`` buffer of a new bucket (a
transport blocks there until the slot is free); without it, each bucket gets a fresh host buffer.
A full bucket goes to ``on_full(bucket)`` at once (a transport posts it there, before the planner
waits for the next slot), or, without ``on_full``, is returned by ``add``/``finish``.
:meth:`BucketPlanner.flush` closes the open bucket before it is full (a sending transport does so
for a :data:`FLUSH_BUCKET` item in its stream).
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias, Union

import torch

from verl_fastsync.chunks.meta import (
    BUCKET_ALIGN,
    ChunkMeta,
    DuplicateTensorError,
    EmptySyncError,
    byte_view,
    check_tensor,
    copy_bytes,
    dtype_to_str,
    leading_slice_bytes,
    validate_bucket_size,
)
from verl_fastsync.io.fence import DeviceFence

__all__ = [
    "FLUSH_BUCKET",
    "AlignSpec",
    "Bucket",
    "BucketPlanner",
    "FlushBucket",
    "aplan_buckets",
    "expert_alignment",
    "pack_bucket",
    "plan_buckets",
    "unpack_item",
]

AlignSpec: TypeAlias = Union[Callable[[str, torch.Tensor], "int | None"], Mapping[str, int], None]  # noqa: UP007
"""Per-tensor alignment in bytes: a callable ``(name, tensor) -> int | None``, a mapping name -> int,
or ``None`` (no alignment). :func:`expert_alignment` and ``leading_slice_bytes`` are the usual values."""


class FlushBucket:
    """The type of :data:`FLUSH_BUCKET`."""

    def __repr__(self) -> str:
        return "FLUSH_BUCKET"


FLUSH_BUCKET: Final = FlushBucket()
"""An item a sending transport's stream may carry between tensors: the open bucket goes out now,
without waiting to fill. A delta stream carries one after each bucket's worth of *model* bytes (its
deltas are a fraction of that), so receivers rebuild one part while the sender encodes the next."""

Acquire: TypeAlias = Callable[[int], torch.Tensor]
"""``acquire(bucket_index)`` -> flat ``uint8`` buffer of at least ``bucket_size`` bytes."""

_EXPERT_STACKED = re.compile(r"(^|\.)experts\.(?!\d+(\.|$))")


def expert_alignment(name: str, tensor: torch.Tensor) -> int | None:
    """Alignment for a tensor stacked along a leading expert dimension, else ``None``.

    A name with an ``experts.`` component not followed by an expert index (``...mlp.experts.w13_weight``,
    ``...experts.gate_up_proj``) and at least two dimensions is treated as ``[E, ...]``: chunks are
    cut on multiples of one expert's bytes. Per-expert names (``experts.3.up_proj.weight``) are not.
    """
    if tensor.dim() >= 2 and tensor.shape[0] > 1 and _EXPERT_STACKED.search(name):
        return leading_slice_bytes(tensor)
    return None


def _align_for(align: AlignSpec, name: str, tensor: torch.Tensor) -> int:
    if align is None:
        return 1
    value = align.get(name) if isinstance(align, Mapping) else align(name, tensor)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"alignment for {name!r} must be a positive int (bytes) or None, got {value!r}")
    return value


@dataclass
class Bucket:
    """One planned bucket: its chunks (metadata and a view of their bytes) and the bytes used.

    For buckets made by :class:`BucketPlanner`, ``buffer`` holds the bytes and each chunk's data is a
    view into it (the producer's tensors are not referenced).
    """

    index: int
    chunks: list[tuple[ChunkMeta, torch.Tensor]] = field(default_factory=list)
    nbytes: int = 0
    buffer: torch.Tensor | None = None

    def __iter__(self) -> Iterator[tuple[ChunkMeta, torch.Tensor]]:
        return iter(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def metas(self) -> list[ChunkMeta]:
        return [meta for meta, _ in self.chunks]


class BucketPlanner:
    """Incremental planner (see the module docstring for the layout rules and byte ownership).

    :param bucket_size: bytes per bucket (a positive int).
    :param align: per-tensor chunk alignment (:data:`AlignSpec`).
    :param allow_empty: accept a sync without any tensor.
    :param acquire: buffer of a new bucket (default: a fresh host buffer per bucket).
    :param on_full: receives each finished bucket (after the device fence); without it, ``add`` and
        ``finish`` return them.
    """

    def __init__(
        self,
        bucket_size: int,
        *,
        align: AlignSpec = None,
        allow_empty: bool = False,
        acquire: Acquire | None = None,
        on_full: Callable[[Bucket], None] | None = None,
    ) -> None:
        self.bucket_size = validate_bucket_size(bucket_size)
        self.align = align
        self.allow_empty = allow_empty
        self._acquire = acquire or self._fresh_buffer
        self._on_full = on_full
        self._fence = DeviceFence()
        self._names: set[str] = set()
        self._bucket = Bucket(index=0)
        self._offset = 0
        self._tail_here = False  # the current bucket holds the tail of a split tensor
        self._count = 0
        self._out: list[Bucket] = []
        self.total_bytes = 0
        self.largest_tensor_bytes = 0
        self.num_chunks = 0
        self.num_buckets = 0

    @property
    def num_tensors(self) -> int:
        return self._count

    def _fresh_buffer(self, index: int) -> torch.Tensor:
        return torch.empty(self.bucket_size, dtype=torch.uint8)

    def _close(self) -> None:
        bucket = self._bucket
        self._bucket = Bucket(index=bucket.index + 1)
        self._offset = 0
        self._tail_here = False
        if not bucket.chunks:
            self._bucket.index = bucket.index
            return
        self._fence.wait()  # every device copy into this bucket is complete
        self.num_buckets += 1
        if self._on_full is not None:
            self._on_full(bucket)
        else:
            self._out.append(bucket)

    def _place(self, fields: dict[str, Any], data: torch.Tensor, start: int, n: int, at: int) -> None:
        bucket = self._bucket
        if bucket.buffer is None:
            buffer = self._acquire(bucket.index)
            if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < self.bucket_size:
                raise ValueError(
                    f"bucket buffer for bucket {bucket.index} must be a flat uint8 tensor of at least "
                    f"{self.bucket_size} bytes, got {tuple(buffer.shape)} {buffer.dtype}"
                )
            bucket.buffer = buffer
        dst = bucket.buffer[at : at + n]
        if n:
            src = data[start : start + n]
            copy_bytes(dst, src)
            self._fence.note(src, dst)
            if src.device.type == "cpu" and dst.device.type != "cpu":
                # host -> device runs non_blocking: the producer may rewrite its host buffer as soon
                # as add returns (no stream orders that), so the copy must be done first
                self._fence.wait()
        meta = ChunkMeta(chunk_offset=start, chunk_size=n, bucket_offset=at, **fields)
        bucket.chunks.append((meta, dst))
        self.num_chunks += 1
        self._offset = at + n
        bucket.nbytes = self._offset

    def _take(self) -> list[Bucket]:
        out, self._out = self._out, []
        return out

    def add(self, name: str, tensor: torch.Tensor) -> list[Bucket]:
        """Copy one tensor into the buckets; return the buckets it completed (always ``[]`` with
        ``on_full``). No reference to ``tensor`` survives this call."""
        tensor = check_tensor(name, tensor)
        if name in self._names:
            raise DuplicateTensorError(f"tensor {name!r} appears twice in one weight sync")
        unit = _align_for(self.align, name, tensor)
        self._names.add(name)
        fields: dict[str, Any] = {
            "name": name,
            "shape": tuple(int(s) for s in tensor.shape),
            "dtype": dtype_to_str(tensor.dtype),
            "tensor_index": self._count,
        }
        data = byte_view(tensor)
        del tensor
        total = data.numel()
        fields["total_bytes"] = total
        self._count += 1
        self.total_bytes += total
        self.largest_tensor_bytes = max(self.largest_tensor_bytes, total)
        size = self.bucket_size
        at = -(-self._offset // BUCKET_ALIGN) * BUCKET_ALIGN
        if total <= size:
            if at + total > size:
                self._close()
                at = 0
            self._place(fields, data, 0, total, at)
            if self._offset >= size:
                self._close()
            return self._take()
        if unit > size:
            unit = 1  # one aligned unit does not fit in a bucket: cut on plain bytes
        if self._tail_here:
            self._close()  # never start a split beside another split's tail
        done = 0
        while done < total:
            at = -(-self._offset // BUCKET_ALIGN) * BUCKET_ALIGN
            n = min(total - done, ((size - at) // unit) * unit if at < size else 0)
            if n <= 0:
                self._close()
                continue
            self._place(fields, data, done, n, at)
            done += n
            if self._offset >= size:
                self._close()
        self._tail_here = bool(self._bucket.chunks)  # the tail sits in the open bucket
        return self._take()

    def flush(self) -> list[Bucket]:
        """Close the open bucket now if it holds anything (a split tensor's tail included); return the
        buckets not yet handed to ``on_full``."""
        self._close()
        return self._take()

    def finish(self) -> list[Bucket]:
        """Close the last bucket; return the buckets not yet handed to ``on_full``.

        Raises :class:`~verl_fastsync.chunks.meta.EmptySyncError` for an empty sync."""
        if self._count == 0 and not self.allow_empty:
            raise EmptySyncError(
                "the weight sync contained no tensor (an exhausted generator?); "
                "pass allow_empty=True to accept an empty sync"
            )
        self._close()
        return self._take()


def unpack_item(item: object) -> tuple[str, torch.Tensor]:
    """``(name, tensor)`` from one item of a weight iterable (``TypeError`` for anything else)."""
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise TypeError(f"a weight sync must yield (name, tensor) pairs, got {type(item).__name__}")
    name, tensor = item
    return name, tensor


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_size: int,
    *,
    align: AlignSpec = None,
    allow_empty: bool = False,
) -> Generator[Bucket, None, None]:
    """Buckets (each with its own fresh host buffer) for a synchronous iterable, tensor by tensor."""
    planner = BucketPlanner(bucket_size, align=align, allow_empty=allow_empty)
    for item in named_tensors:
        yield from planner.add(*unpack_item(item))
    yield from planner.finish()


async def aplan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
    bucket_size: int,
    *,
    align: AlignSpec = None,
    allow_empty: bool = False,
) -> AsyncGenerator[Bucket, None]:
    """Like :func:`plan_buckets`, for a sync or async iterable."""
    planner = BucketPlanner(bucket_size, align=align, allow_empty=allow_empty)
    if isinstance(named_tensors, AsyncIterable):
        async for item in named_tensors:
            for bucket in planner.add(*unpack_item(item)):
                yield bucket
    else:
        for item in named_tensors:
            for bucket in planner.add(*unpack_item(item)):
                yield bucket
    for bucket in planner.finish():
        yield bucket


def pack_bucket(bucket: Bucket, buffer: torch.Tensor) -> None:
    """Make ``buffer`` (a flat ``uint8`` tensor of at least ``nbytes``) hold the bucket's bytes.

    A no-op when the bucket was planned into ``buffer`` (the usual case); otherwise each chunk is
    copied (device copies are asynchronous: fence before handing ``buffer`` over)."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TypeError("bucket buffer must be a flat torch.uint8 tensor")
    if buffer.numel() < bucket.nbytes:
        raise ValueError(
            f"bucket buffer has {buffer.numel()} bytes, bucket {bucket.index} needs {bucket.nbytes}"
        )
    if bucket.buffer is not None and bucket.buffer.data_ptr() == buffer.data_ptr():
        return
    for meta, data in bucket.chunks:
        if meta.chunk_size:
            copy_bytes(buffer[meta.bucket_offset : meta.bucket_offset + meta.chunk_size], data)
