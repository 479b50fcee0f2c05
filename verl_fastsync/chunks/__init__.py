"""Chunk core: lay named tensors out in fixed-size buckets (splitting what does not fit) and put them
back together on the receiver, one allocation per tensor.

Shared by every transport (engine and colocated). Imports torch, numpy and msgspec only; no verl, no
device runtime.

* :mod:`~verl_fastsync.chunks.meta` - :class:`ChunkMeta` (typed, versioned chunk metadata), the
  errors, dtype names, :func:`byte_view`, :func:`copy_bytes`, :func:`chunk_checksum`.
* :mod:`~verl_fastsync.chunks.plan` - :class:`BucketPlanner`, the one planner of both paths (keep
  whole when it fits, split what does not, cut on expert boundaries, one chunked tensor at a time);
  it copies each tensor's bytes into its bucket when the tensor is added.
* :mod:`~verl_fastsync.chunks.assemble` - :class:`Assembler` and the receiver contract (how long a
  returned tensor stays valid).
"""

from verl_fastsync.chunks.assemble import Allocate, Assembler, aassemble, assemble, bucket_chunk_views
from verl_fastsync.chunks.meta import (
    BUCKET_ALIGN,
    CHUNK_SCHEMA_VERSION,
    ChunkCorruptedError,
    ChunkError,
    ChunkMeta,
    ChunkMismatchError,
    DuplicateTensorError,
    EmptySyncError,
    IncompleteTensorError,
    byte_view,
    check_tensor,
    chunk_checksum,
    copy_bytes,
    dtype_to_str,
    leading_slice_bytes,
    str_to_dtype,
    validate_bucket_size,
)
from verl_fastsync.chunks.plan import (
    FLUSH_BUCKET,
    AlignSpec,
    Bucket,
    BucketPlanner,
    FlushBucket,
    aplan_buckets,
    expert_alignment,
    pack_bucket,
    plan_buckets,
    unpack_item,
)

__all__ = [
    "BUCKET_ALIGN",
    "CHUNK_SCHEMA_VERSION",
    "FLUSH_BUCKET",
    "AlignSpec",
    "Allocate",
    "Assembler",
    "Bucket",
    "BucketPlanner",
    "ChunkCorruptedError",
    "ChunkError",
    "ChunkMeta",
    "ChunkMismatchError",
    "DuplicateTensorError",
    "EmptySyncError",
    "FlushBucket",
    "IncompleteTensorError",
    "aassemble",
    "aplan_buckets",
    "assemble",
    "bucket_chunk_views",
    "byte_view",
    "check_tensor",
    "chunk_checksum",
    "copy_bytes",
    "dtype_to_str",
    "expert_alignment",
    "leading_slice_bytes",
    "pack_bucket",
    "plan_buckets",
    "str_to_dtype",
    "unpack_item",
    "validate_bucket_size",
]
