"""Chunk metadata, errors and byte helpers shared by the planner and the assembler.

:class:`ChunkMeta` is the typed, versioned (``schema_version``) description of one chunk: tensor name,
shape, dtype (torch name such as ``"bfloat16"``), ``total_bytes`` of the tensor,
``chunk_offset``/``chunk_size`` (bytes of this chunk inside the tensor), ``bucket_offset`` (where the
chunk's bytes start in its bucket), ``tensor_index`` (order of the tensor in the sync) and an optional
xxhash ``checksum`` (``int | None``, the only optional field).

Errors are :class:`ChunkError` (a ``ValueError``) subclasses; non-tensor values raise ``TypeError``.
Imports torch, numpy and msgspec only (no verl, no device runtime); :func:`validate_bucket_size` is
:func:`verl_fastsync.limits.validate_bucket_size` (the one bucket-size rule, torch-free) and
:func:`byte_view` is :func:`verl_fastsync.io.views.byte_view` (the one byte view of a tensor, shared
with delta sync); nothing here knows the config or the plugin registry.
"""

from __future__ import annotations

import msgspec
import torch

# the one byte view of a tensor lives below the delta layer (a delta sync views tensors as the
# transports do); the one bucket-size rule with the other torch-free rules (the config parser needs it)
from verl_fastsync.io.views import byte_view
from verl_fastsync.limits import validate_bucket_size

try:  # numpy ships with every verl install; without it host copies fall back to torch
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

__all__ = [
    "BUCKET_ALIGN",
    "CHUNK_SCHEMA_VERSION",
    "ChunkCorruptedError",
    "ChunkError",
    "ChunkMeta",
    "ChunkMismatchError",
    "DuplicateTensorError",
    "EmptySyncError",
    "IncompleteTensorError",
    "byte_view",
    "check_tensor",
    "chunk_checksum",
    "copy_bytes",
    "dtype_to_str",
    "leading_slice_bytes",
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


def check_tensor(name: object, tensor: object) -> torch.Tensor:
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


def leading_slice_bytes(tensor: torch.Tensor) -> int:
    """Byte size of one slice along dim 0 (e.g. one expert of a stacked MoE weight).

    For a 0-dim or empty tensor this is the tensor's whole byte size (at least 1).
    """
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        return max(1, tensor.numel() * tensor.element_size())
    return (tensor.numel() // tensor.shape[0]) * tensor.element_size()


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


def chunk_checksum(data: torch.Tensor) -> int:
    """xxh3-64 of a ``uint8`` tensor's bytes (copied to CPU first if on a device)."""
    import xxhash

    if data.device.type != "cpu":
        data = data.cpu()
    if data.numel() == 0:
        return int(xxhash.xxh3_64_intdigest(b""))
    return int(xxhash.xxh3_64_intdigest(data.contiguous().numpy().data))
