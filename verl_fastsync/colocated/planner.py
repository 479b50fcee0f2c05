"""Bucket planning of the colocated path: whole tensors stay whole, oversize ones are chunked."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from verl_fastsync.chunks import (
    BUCKET_ALIGN,
    Bucket,
    ChunkMeta,
    DuplicateTensorError,
    byte_view,
    chunk_checksum,
    dtype_to_str,
    leading_slice_bytes,
)


def _with_checksums(metas: list[ChunkMeta], slot: torch.Tensor) -> list[ChunkMeta]:
    """``metas`` with the xxhash of each chunk's packed bytes (``verify``: a debugging aid that reads
    every byte once more; a device slot is read back to the host for it)."""
    out = []
    for meta in metas:
        data = slot[meta.bucket_offset : meta.bucket_offset + meta.chunk_size]
        out.append(msgspec.structs.replace(meta, checksum=chunk_checksum(data.cpu())))
    return out


_EXPERT_STACKED = re.compile(r"(^|\.)experts\.(?!\d+(\.|$))")


def expert_alignment(name: str, tensor: torch.Tensor) -> int | None:
    """Chunk alignment for a tensor stacked along a leading expert dimension, else ``None``.

    A name with an ``experts.`` component not followed by an expert index (``...mlp.experts.w13_weight``,
    ``...experts.gate_up_proj``) and at least two dimensions is treated as ``[E, ...]``: chunks are
    cut on multiples of one expert's bytes. Per-expert names (``experts.3.up_proj.weight``) are not.
    """
    if tensor.dim() >= 2 and tensor.shape[0] > 1 and _EXPERT_STACKED.search(name):
        return leading_slice_bytes(tensor)
    return None


@dataclass(frozen=True)
class Placement:
    """Where one chunk of a tensor goes: bucket ``bucket`` at ``meta.bucket_offset``.

    ``data`` is a flat ``uint8`` view of the producer's tensor; the sender copies it into the slot at
    once and drops it. ``closes`` is true when the bucket is full after this chunk.
    """

    bucket: int
    meta: ChunkMeta
    data: torch.Tensor
    closes: bool


class WholeTensorPlanner:
    """Bucket planner of the colocated path.

    * A tensor that fits in a bucket is never split: it starts a new bucket when the current one has
      no room for it, so the receiver hands it over with no merge copy.
    * A tensor larger than a bucket is chunked, on expert boundaries for stacked MoE tensors
      (:func:`expert_alignment`). Its first chunk fills the room left in the current bucket, unless
      that bucket holds the last chunk of the previous chunked tensor: then it starts a new bucket,
      so the receiver never assembles two chunked tensors at a time (its merge peak is the largest
      chunked tensor, not two).

    :meth:`place` returns the placements of one tensor and keeps no reference to it; the sender
    copies each placement's bytes before it asks the producer for the next tensor. :meth:`add` and
    :meth:`finish` give the same plan as :class:`~verl_fastsync.chunks.Bucket` objects (planning only:
    those hold views of the tensors).
    """

    def __init__(self, bucket_size: int) -> None:
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0:
            raise ValueError(f"bucket_size must be a positive int (bytes), got {bucket_size!r}")
        self.bucket_size = bucket_size
        self.bucket = 0
        """Index of the bucket being filled."""
        self._offset = 0
        self._chunked_tail = False  # the open bucket holds the last chunk of a chunked tensor
        self._names: set[str] = set()
        self._open: Bucket | None = None  # add()/finish() only
        self.num_tensors = 0
        self.total_bytes = 0

    def _next_bucket(self) -> None:
        if self._offset > 0:
            self.bucket += 1
        self._offset = 0
        self._chunked_tail = False

    def place(self, name: str, tensor: torch.Tensor) -> list[Placement]:
        """Plan one tensor; the placements of its bytes, in order."""
        if name in self._names:
            raise DuplicateTensorError(f"tensor {name!r} appears twice in one weight sync")
        self._names.add(name)
        data = byte_view(tensor)
        total = data.numel()
        fields: dict[str, Any] = {
            "name": name,
            "shape": tuple(int(s) for s in tensor.shape),
            "dtype": dtype_to_str(tensor.dtype),
            "total_bytes": total,
            "tensor_index": self.num_tensors,
        }
        self.num_tensors += 1
        self.total_bytes += total
        size = self.bucket_size
        out: list[Placement] = []

        def put(start: int, n: int, at: int) -> None:
            meta = ChunkMeta(chunk_offset=start, chunk_size=n, bucket_offset=at, **fields)
            self._offset = at + n
            closes = self._offset >= size
            out.append(Placement(self.bucket, meta, data[start : start + n], closes))
            if closes:
                self._next_bucket()

        if total <= size:
            at = -(-self._offset // BUCKET_ALIGN) * BUCKET_ALIGN
            if at + total > size:
                self._next_bucket()
                at = 0
            put(0, total, at)
            return out
        unit = expert_alignment(name, tensor) or 1
        if unit > size:
            unit = 1  # one expert does not fit in a bucket: plain byte chunks
        if self._chunked_tail:
            self._next_bucket()
        done = 0
        while done < total:
            at = -(-self._offset // BUCKET_ALIGN) * BUCKET_ALIGN
            n = min(total - done, ((size - at) // unit) * unit if at < size else 0)
            if n <= 0:
                self._next_bucket()
                continue
            put(done, n, at)
            done += n
        self._chunked_tail = self._offset > 0
        return out

    def add(self, name: str, tensor: torch.Tensor) -> list[Bucket]:
        """Plan one tensor; return the buckets it completed (planning only: they hold views)."""
        out: list[Bucket] = []
        for p in self.place(name, tensor):
            if self._open is not None and self._open.index != p.bucket:
                out.append(self._open)
                self._open = None
            if self._open is None:
                self._open = Bucket(index=p.bucket)
            self._open.chunks.append((p.meta, p.data))
            self._open.nbytes = p.meta.bucket_offset + p.meta.chunk_size
            if p.closes:
                out.append(self._open)
                self._open = None
        return out

    def finish(self) -> list[Bucket]:
        """The last partial bucket, if any."""
        out = [self._open] if self._open is not None and self._open.chunks else []
        self._open = None
        return out
