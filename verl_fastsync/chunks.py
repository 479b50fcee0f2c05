"""Chunk core: split named tensors into byte chunks packed into fixed-size buckets, and put them
back together on the receiver, one allocation per tensor.

This module is shared by every transport (engine and colocated). It imports torch and msgspec only;
no verl, no device runtime.

Public API
----------
Metadata
    :class:`ChunkMeta` - typed, versioned (``schema_version``) description of one chunk: tensor
    name, shape, dtype (torch name such as ``"bfloat16"``), ``total_bytes`` of the tensor,
    ``chunk_offset``/``chunk_size`` (bytes of this chunk inside the tensor), ``bucket_offset``
    (where the chunk's bytes start in its bucket), ``tensor_index`` (order of the tensor in the sync)
    and an optional xxhash ``checksum`` (``int | None``, the only optional field).
    :data:`CHUNK_SCHEMA_VERSION`, :func:`dtype_to_str`, :func:`str_to_dtype`.

Splitting (sender)
    :func:`byte_view` - a flat ``uint8`` view of any tensor; contiguous tensors are never copied,
    non-contiguous ones are made contiguous once.
    :func:`leading_slice_bytes` - the byte size of one slice along dim 0 (e.g. one MoE expert), the
    value to pass as alignment so that chunk boundaries fall on expert boundaries.
    :class:`BucketPlanner` - the incremental planner (``add`` / ``finish``);
    :func:`plan_buckets` (sync iterable -> ``Iterator[Bucket]``) and :func:`aplan_buckets`
    (sync or async iterable -> ``AsyncIterator[Bucket]``) wrap it.
    :class:`Bucket` - ``index``, ``chunks: list[tuple[ChunkMeta, torch.Tensor]]`` (metadata, source
    byte view) and ``nbytes`` (bytes used in the bucket buffer); iterating a bucket yields its chunks.
    :func:`pack_bucket` copies a bucket's chunks into a ``uint8`` buffer (the only sender copy);
    :func:`copy_bytes` is the byte copy used everywhere (memcpy on the host).

Assembling (receiver)
    :class:`Assembler` - ``feed(meta, data)`` returns the tensors completed by this chunk;
    ``finish()`` raises :class:`IncompleteTensorError` naming any tensor still missing bytes;
    :func:`assemble` / :func:`aassemble` wrap it for sync / async chunk streams.
    :func:`bucket_chunk_views` cuts a received bucket buffer into ``(meta, data)`` pairs.

Checksums
    :func:`chunk_checksum` (xxhash, imported lazily; only used when ``verify`` is on).

Errors (all :class:`ChunkError`, a ``ValueError``): :class:`DuplicateTensorError`,
:class:`EmptySyncError`, :class:`ChunkMismatchError`, :class:`ChunkCorruptedError`,
:class:`IncompleteTensorError`. Non-tensor values raise ``TypeError``.

Rules
-----
* Tensors are emitted in input order; each tensor's chunks are emitted consecutively and in byte
  order, filling every bucket up to ``bucket_size`` (a tensor larger than the space left is split).
* Every chunk starts at a bucket offset that is a multiple of :data:`BUCKET_ALIGN` (16 bytes, the
  largest itemsize), so a whole tensor inside a bucket can be viewed with its own dtype.
* Zero-size tensors produce one zero-size chunk; 0-dim tensors have shape ``()``.
* An **empty sync** (no tensor at all) is an error (:class:`EmptySyncError`) by default: an empty
  weight generator is almost always an exhausted generator or a wrong filter. Pass
  ``allow_empty=True`` to accept it (zero buckets).
* Duplicate names in one sync raise :class:`DuplicateTensorError` on both sides.
* ``bucket_size`` must be a positive ``int`` (``bool`` is rejected).
* Alignment (``align``) is best effort: when a chunk of a tensor must be split, its size is rounded
  down to a multiple of the tensor's alignment; if the current bucket has less than one aligned unit
  left the tensor starts in the next bucket; when one unit is larger than the whole bucket, the
  tensor is split on plain byte boundaries.
"""

from __future__ import annotations

import bisect
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias, Union

import msgspec
import torch

try:  # numpy ships with every verl install; without it host copies fall back to torch
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

__all__ = [
    "BUCKET_ALIGN",
    "CHUNK_SCHEMA_VERSION",
    "AlignSpec",
    "Assembler",
    "Bucket",
    "BucketPlanner",
    "ChunkCorruptedError",
    "ChunkError",
    "ChunkMeta",
    "ChunkMismatchError",
    "DuplicateTensorError",
    "EmptySyncError",
    "IncompleteTensorError",
    "aassemble",
    "aplan_buckets",
    "assemble",
    "bucket_chunk_views",
    "byte_view",
    "chunk_checksum",
    "copy_bytes",
    "dtype_to_str",
    "leading_slice_bytes",
    "pack_bucket",
    "plan_buckets",
    "str_to_dtype",
    "validate_bucket_size",
]

CHUNK_SCHEMA_VERSION = 1
"""Version of :class:`ChunkMeta`; bump on any incompatible change."""

BUCKET_ALIGN = 16
"""Every chunk starts at a bucket offset that is a multiple of this (largest torch itemsize)."""


class ChunkError(ValueError):
    """Base class of chunking / assembling errors."""


class DuplicateTensorError(ChunkError):
    """The same tensor name appeared twice in one sync."""


class EmptySyncError(ChunkError):
    """A sync contained no tensor at all (and ``allow_empty`` was not set)."""


class ChunkMismatchError(ChunkError):
    """A chunk's metadata contradicts an earlier chunk of the same tensor, its data, or its range."""


class ChunkCorruptedError(ChunkError):
    """A chunk's bytes do not match the checksum computed by the sender."""


class IncompleteTensorError(ChunkError):
    """A sync ended while some tensor had not received all its bytes."""


class ChunkMeta(msgspec.Struct, frozen=True, kw_only=True):
    """Metadata of one chunk of one tensor (travels on the control channel)."""

    name: str
    """Tensor name."""
    shape: tuple[int, ...]
    """Full shape of the tensor (``()`` for 0-dim)."""
    dtype: str
    """torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``."""
    total_bytes: int
    """Byte size of the whole tensor (``numel * itemsize``)."""
    chunk_offset: int
    """Byte offset of this chunk inside the tensor."""
    chunk_size: int
    """Byte size of this chunk."""
    bucket_offset: int
    """Byte offset of this chunk inside its bucket buffer."""
    tensor_index: int
    """Position of the tensor in the sync (0-based; order is preserved end to end)."""
    checksum: int | None = None
    """xxh3-64 of the chunk's bytes, set by the sender only when ``verify`` is on."""
    schema_version: int = CHUNK_SCHEMA_VERSION

    @property
    def is_whole(self) -> bool:
        """True when this chunk carries the whole tensor."""
        return self.chunk_offset == 0 and self.chunk_size == self.total_bytes


# ---------------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------------

_QUANTIZED = {torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"expected a torch.dtype, got {type(dtype).__name__}")
    return str(dtype).removeprefix("torch.")


def str_to_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises :class:`ChunkMismatchError` for unknown names."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ChunkMismatchError(f"unknown torch dtype {name!r} in chunk metadata")
    return dtype


# ---------------------------------------------------------------------------------------------
# sender side
# ---------------------------------------------------------------------------------------------


def _check_tensor(name: object, tensor: object) -> torch.Tensor:
    if not isinstance(name, str):
        raise TypeError(f"tensor names must be str, got {type(name).__name__} ({name!r})")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor; "
            "a sync must yield (name, torch.Tensor) pairs"
        )
    if tensor.layout != torch.strided:
        raise TypeError(
            f"weight {name!r} has layout {tensor.layout}; only dense (strided) tensors are allowed"
        )
    if tensor.dtype in _QUANTIZED:
        raise TypeError(f"weight {name!r} has quantized dtype {tensor.dtype}; dequantize it first")
    if tensor.device.type == "meta":
        raise TypeError(f"weight {name!r} is on the meta device and has no data")
    return tensor


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of ``tensor``'s bytes, in row-major order.

    Contiguous tensors are viewed without a copy; a non-contiguous tensor (or one with a lazy
    conjugate/negative bit) is materialised once with ``.contiguous()``.
    """
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    flat = tensor.detach().reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        # 0/1-element tensors count as contiguous whatever their stride; give them a unit stride
        flat = flat.as_strided((flat.numel(),), (1,))
    if flat.dtype == torch.uint8:
        return flat
    return flat.view(torch.uint8)


def leading_slice_bytes(tensor: torch.Tensor) -> int:
    """Byte size of one slice along dim 0 (e.g. one expert of a stacked MoE weight).

    For a 0-dim or empty tensor this is the tensor's whole byte size (at least 1).
    """
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        return max(1, tensor.numel() * tensor.element_size())
    return (tensor.numel() // tensor.shape[0]) * tensor.element_size()


def validate_bucket_size(bucket_size: object) -> int:
    """Return ``bucket_size`` if it is a positive int, else raise ``ValueError``/``TypeError``."""
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int):
        raise TypeError(f"bucket_size must be a positive int (bytes), got {bucket_size!r}")
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be a positive number of bytes, got {bucket_size}")
    return bucket_size


AlignSpec: TypeAlias = Union[Callable[[str, torch.Tensor], "int | None"], Mapping[str, int], None]  # noqa: UP007
"""Per-tensor alignment in bytes: a callable ``(name, tensor) -> int | None``, a mapping name -> int,
or ``None`` (no alignment). ``leading_slice_bytes`` is the usual value."""


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
    """One bucket: the chunks to pack, in order, and the bytes they occupy in the buffer."""

    index: int
    chunks: list[tuple[ChunkMeta, torch.Tensor]] = field(default_factory=list)
    nbytes: int = 0

    def __iter__(self) -> Iterator[tuple[ChunkMeta, torch.Tensor]]:
        return iter(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def metas(self) -> list[ChunkMeta]:
        return [meta for meta, _ in self.chunks]


class BucketPlanner:
    """Incremental bucket planner: feed ``(name, tensor)`` with :meth:`add`, get full buckets back,
    and call :meth:`finish` at the end for the last partial bucket.

    Source views are kept, not copied (a bucket references the tensors it will pack).
    """

    def __init__(self, bucket_size: int, *, align: AlignSpec = None, allow_empty: bool = False) -> None:
        self.bucket_size = validate_bucket_size(bucket_size)
        self.align = align
        self.allow_empty = allow_empty
        self._names: set[str] = set()
        self._bucket = Bucket(index=0)
        self._offset = 0
        self._count = 0
        self.total_bytes = 0
        self.largest_tensor_bytes = 0
        self.num_chunks = 0

    @property
    def num_tensors(self) -> int:
        return self._count

    def _close(self, out: list[Bucket]) -> None:
        out.append(self._bucket)
        self._bucket = Bucket(index=self._bucket.index + 1)
        self._offset = 0

    def add(self, name: str, tensor: torch.Tensor) -> list[Bucket]:
        """Plan one tensor; return the buckets it completed (possibly none)."""
        tensor = _check_tensor(name, tensor)
        if name in self._names:
            raise DuplicateTensorError(f"tensor {name!r} appears twice in one weight sync")
        unit = _align_for(self.align, name, tensor)
        self._names.add(name)
        data = byte_view(tensor)
        total = data.numel()
        index = self._count
        self._count += 1
        self.total_bytes += total
        self.largest_tensor_bytes = max(self.largest_tensor_bytes, total)
        common: dict[str, Any] = {
            "name": name,
            "shape": tuple(int(s) for s in tensor.shape),
            "dtype": dtype_to_str(tensor.dtype),
            "total_bytes": total,
            "tensor_index": index,
        }
        out: list[Bucket] = []
        size = self.bucket_size
        if unit > size:
            unit = 1  # one aligned unit does not fit in a bucket: split on bytes
        if total == 0:
            meta = ChunkMeta(chunk_offset=0, chunk_size=0, bucket_offset=0, **common)
            self._bucket.chunks.append((meta, data))
            self.num_chunks += 1
            return out
        done = 0
        while done < total:
            start = -(-self._offset // BUCKET_ALIGN) * BUCKET_ALIGN
            room = size - start
            left = total - done
            if left <= room:
                n = left
            else:
                n = (room // unit) * unit
            if n <= 0:
                self._close(out)
                continue
            meta = ChunkMeta(chunk_offset=done, chunk_size=n, bucket_offset=start, **common)
            self._bucket.chunks.append((meta, data[done : done + n]))
            self.num_chunks += 1
            self._bucket.nbytes = start + n
            self._offset = start + n
            done += n
            if self._offset >= size:
                self._close(out)
        return out

    def finish(self) -> list[Bucket]:
        """The last partial bucket (if any). Raises :class:`EmptySyncError` for an empty sync."""
        if self._count == 0 and not self.allow_empty:
            raise EmptySyncError(
                "the weight sync contained no tensor (an exhausted generator?); "
                "pass allow_empty=True to accept an empty sync"
            )
        if self._bucket.chunks:
            bucket, self._bucket = self._bucket, Bucket(index=self._bucket.index + 1)
            self._offset = 0
            return [bucket]
        return []


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_size: int,
    *,
    align: AlignSpec = None,
    allow_empty: bool = False,
) -> Iterator[Bucket]:
    """Yield buckets for a synchronous iterable of ``(name, tensor)``; lazily, tensor by tensor."""
    planner = BucketPlanner(bucket_size, align=align, allow_empty=allow_empty)
    for item in named_tensors:
        name, tensor = _unpack_item(item)
        yield from planner.add(name, tensor)
    yield from planner.finish()


async def aplan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
    bucket_size: int,
    *,
    align: AlignSpec = None,
    allow_empty: bool = False,
) -> AsyncIterator[Bucket]:
    """Like :func:`plan_buckets`, for a sync or async iterable."""
    planner = BucketPlanner(bucket_size, align=align, allow_empty=allow_empty)
    if isinstance(named_tensors, AsyncIterable):
        async for item in named_tensors:
            name, tensor = _unpack_item(item)
            for bucket in planner.add(name, tensor):
                yield bucket
    else:
        for item in named_tensors:
            name, tensor = _unpack_item(item)
            for bucket in planner.add(name, tensor):
                yield bucket
    for bucket in planner.finish():
        yield bucket


def _unpack_item(item: object) -> tuple[str, torch.Tensor]:
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise TypeError(f"a weight sync must yield (name, tensor) pairs, got {type(item).__name__}")
    name, tensor = item
    return name, tensor


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy one flat ``uint8`` tensor into another of the same length.

    Host to host: a plain single-threaded ``memcpy`` (numpy ``copyto``, GIL released). torch's
    ``copy_`` splits large host copies over its OpenMP pool, which is several times slower than one
    memcpy as soon as other processes share the cores (measured 1.1 vs 7 GB/s on a busy 2-core host).
    Anything involving a device: ``copy_(non_blocking=True)``; callers synchronize before handing
    the destination over.
    """
    if np is not None and dst.device.type == "cpu" and src.device.type == "cpu":
        if dst.numel():
            np.copyto(dst.numpy(), src.numpy(), casting="no")
    else:
        dst.copy_(src, non_blocking=True)


def pack_bucket(bucket: Bucket, buffer: torch.Tensor) -> None:
    """Copy the bucket's chunks into ``buffer`` (a flat ``uint8`` tensor of at least ``nbytes``)."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TypeError("bucket buffer must be a flat torch.uint8 tensor")
    if buffer.numel() < bucket.nbytes:
        raise ValueError(
            f"bucket buffer has {buffer.numel()} bytes, bucket {bucket.index} needs {bucket.nbytes}"
        )
    for meta, data in bucket.chunks:
        if meta.chunk_size:
            copy_bytes(buffer[meta.bucket_offset : meta.bucket_offset + meta.chunk_size], data)


def bucket_chunk_views(
    buffer: torch.Tensor, metas: Iterable[ChunkMeta]
) -> Iterator[tuple[ChunkMeta, torch.Tensor]]:
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


def chunk_checksum(data: torch.Tensor) -> int:
    """xxh3-64 of a ``uint8`` tensor's bytes (copied to CPU first if on a device)."""
    import xxhash

    if data.device.type != "cpu":
        data = data.cpu()
    if data.numel() == 0:
        return int(xxhash.xxh3_64_intdigest(b""))
    return int(xxhash.xxh3_64_intdigest(data.contiguous().numpy().data))


# ---------------------------------------------------------------------------------------------
# receiver side
# ---------------------------------------------------------------------------------------------


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
        item; a consumer that keeps tensors must ``clone()`` them.
    :param verify: check each chunk's xxhash ``checksum`` (set by a sender with ``verify``); a
        mismatch or a missing checksum raises :class:`ChunkCorruptedError` naming the tensor.

    Attributes ``in_progress_bytes`` / ``peak_in_progress_bytes`` account for destination buffers of
    tensors not yet complete (the receiver's extra memory beyond its buckets); ``allocated_bytes``
    counts every destination allocated (including ones handed to the consumer).
    """

    def __init__(
        self, device: torch.device | str = "cpu", *, zero_copy: bool = False, verify: bool = False
    ) -> None:
        self.device = torch.device(device)
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

    def _validate(self, meta: ChunkMeta, data: torch.Tensor) -> torch.dtype:
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
                out = torch.empty(meta.shape, dtype=dtype, device=self.device)
                self.allocated_bytes += meta.total_bytes
                if meta.total_bytes:
                    copy_bytes(byte_view(out), data)
                return [(name, out)]
            tensor = torch.empty(meta.shape, dtype=dtype, device=self.device)
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
) -> Iterator[tuple[str, torch.Tensor]]:
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
) -> AsyncIterator[tuple[str, torch.Tensor]]:
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
