"""Bucket planning of the colocated path: whole tensors stay whole, oversize ones are chunked."""

from __future__ import annotations

import re
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


class WholeTensorPlanner:
    """Bucket planner of the colocated path: a tensor that fits in a bucket is never split (it
    starts a new bucket when the current one has no room for it), so the receiver hands it over as
    a view into the slot with no merge copy; only a tensor larger than a bucket is chunked, on
    expert boundaries for stacked MoE tensors (:func:`expert_alignment`). Its first chunk fills the
    room left in the current bucket. Emits :class:`~verl_fastsync.chunks.Bucket` objects of
    :class:`~verl_fastsync.chunks.ChunkMeta` like the chunk core's planner.
    """

    def __init__(self, bucket_size: int) -> None:
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0:
            raise ValueError(f"bucket_size must be a positive int (bytes), got {bucket_size!r}")
        self.bucket_size = bucket_size
        self._bucket = Bucket(index=0)
        self._offset = 0
        self._names: set[str] = set()
        self.num_tensors = 0
        self.total_bytes = 0

    def _close(self, out: list[Bucket]) -> None:
        if self._bucket.chunks:
            out.append(self._bucket)
            self._bucket = Bucket(index=self._bucket.index + 1)
        self._offset = 0

    def _place(self, meta_fields: dict[str, Any], data: torch.Tensor, start: int, n: int, at: int) -> None:
        meta = ChunkMeta(chunk_offset=start, chunk_size=n, bucket_offset=at, **meta_fields)
        self._bucket.chunks.append((meta, data[start : start + n]))
        self._offset = at + n
        self._bucket.nbytes = self._offset

    def add(self, name: str, tensor: torch.Tensor) -> list[Bucket]:
        """Plan one tensor; return the buckets it completed."""
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
        out: list[Bucket] = []
        at = -(-self._offset // BUCKET_ALIGN) * BUCKET_ALIGN
        if total <= size:
            if at + total > size:
                self._close(out)
                at = 0
            self._place(fields, data, 0, total, at)
            return out
        unit = expert_alignment(name, tensor) or 1
        if unit > size:
            unit = 1  # one expert does not fit in a bucket: plain byte chunks
        done = 0
        while done < total:
            at = -(-self._offset // BUCKET_ALIGN) * BUCKET_ALIGN
            n = min(total - done, ((size - at) // unit) * unit if at < size else 0)
            if n <= 0:
                self._close(out)
                continue
            self._place(fields, data, done, n, at)
            done += n
            if self._offset >= size:
                self._close(out)
        return out

    def finish(self) -> list[Bucket]:
        """The last partial bucket, if any."""
        out: list[Bucket] = []
        self._close(out)
        return out
