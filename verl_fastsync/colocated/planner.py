"""The colocated path's use of the one bucket planner (:class:`verl_fastsync.chunks.BucketPlanner`):
whole tensors stay whole, larger ones are chunked on expert boundaries, one chunked tensor at a time,
and every tensor's bytes are copied into its slot when it is added."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import torch

from verl_fastsync.chunks import Bucket, BucketPlanner, ChunkMeta, chunk_checksum, expert_alignment

__all__ = ["WholeTensorPlanner", "colocated_planner", "expert_alignment", "is_expert_slice", "with_checksums"]


def colocated_planner(
    bucket_size: int,
    *,
    acquire: Callable[[int], torch.Tensor] | None = None,
    on_full: Callable[[Bucket], None] | None = None,
) -> BucketPlanner:
    """The planner of one colocated sync (an empty sync is allowed: verl sends those)."""
    return BucketPlanner(
        bucket_size, align=expert_alignment, allow_empty=True, acquire=acquire, on_full=on_full
    )


WholeTensorPlanner = colocated_planner
"""0.1.0's name: ``WholeTensorPlanner(bucket_size).add(name, tensor)`` / ``.finish()`` plan into
fresh host buffers (what the fault tests use to compute where a sync can be interrupted)."""


def is_expert_slice(meta: ChunkMeta) -> bool:
    """Whether a chunk is a whole number of experts of a stacked ``[E, ...]`` MoE tensor."""
    if len(meta.shape) < 2 or meta.shape[0] <= 1:
        return False
    if expert_alignment(meta.name, torch.empty(meta.shape, device="meta")) is None:
        return False
    row = meta.total_bytes // meta.shape[0]
    return row > 0 and meta.chunk_offset % row == 0 and meta.chunk_size % row == 0


def with_checksums(metas: list[ChunkMeta], slot: torch.Tensor) -> list[ChunkMeta]:
    """``metas`` with the xxhash of each chunk's packed bytes (``verify``: a debugging aid that reads
    every byte once more; a device slot is read back to the host for it)."""
    out: list[Any] = []
    for meta in metas:
        data = slot[meta.bucket_offset : meta.bucket_offset + meta.chunk_size]
        out.append(msgspec.structs.replace(meta, checksum=chunk_checksum(data.cpu())))
    return out
