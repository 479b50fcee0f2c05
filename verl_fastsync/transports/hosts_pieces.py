"""Pieces: how a tensor larger than the bucket travels the chain of hosts
(:mod:`verl_fastsync.transports.hosts`) one bucket at a time.

A transport assembles a tensor split over several buckets before it yields it, so a leader that
relayed what its stream yields would pass such a tensor on only once all of it had arrived: every
hop would add that tensor's whole link time (a fused MoE ``gate_up_proj`` of several GiB, several
seconds per host). So the sending trainer rank cuts every tensor larger than the bucket into
bucket-sized *pieces* (:func:`split_pieces`), each an item of its own whose reserved name says which
bytes of which tensor it carries; every hop moves pieces like any other item (each one bucket,
checked by ``verify`` like any other) and a leader passes each piece on as soon as it arrived.
Only where a consumer needs the tensor are its pieces put back together (:class:`Pieces`): on each
leader (for its own consumer and delta's decode), on each of its host's ranks (the leader hands them
pieces as they arrived, or a delta's decoded tensors whole) and on a rank receiving directly. A
hop then costs one bucket of latency, whatever the size of the tensors.

Pieces of one tensor travel in order and together (one sender per chain); anything else is a
broken stream and fails the sync naming the tensor.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncGenerator, AsyncIterable, Iterable

import torch

from verl_fastsync.chunks import (
    FLUSH_BUCKET,
    Allocate,
    DuplicateTensorError,
    FlushBucket,
    byte_view,
    check_tensor,
    copy_bytes,
    dtype_to_str,
    str_to_dtype,
    unpack_item,
)
from verl_fastsync.transports.base import TransferStats, TransportError
from verl_fastsync.transports.sending import aiter_items

__all__ = ["PIECE_PREFIX", "Pieces", "count_of", "is_piece", "piece_name", "split_pieces"]

Item = tuple[str, torch.Tensor]

PIECE_PREFIX = "[fastsync: bytes "
"""Reserved start of a piece's name; the rest reads as what it carries, e.g.
``[fastsync: bytes 0-8388608 of 25165824, bfloat16[3072, 4096]] model.layers.0.mlp.up_proj.weight``
(a transport's error about the item in flight names the tensor and the bytes)."""

_PIECE = re.compile(r"\[fastsync: bytes (\d+)-(\d+) of (\d+), (\w+)\[([\d, ]*)\]\] (.*)", re.DOTALL)


def is_piece(name: str) -> bool:
    """Whether ``name`` is a piece's (reserved: no tensor's name may start so)."""
    return name.startswith(PIECE_PREFIX)


def piece_name(
    name: str, start: int, end: int, total: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> str:
    dims = ", ".join(str(d) for d in shape)
    return f"{PIECE_PREFIX}{start}-{end} of {total}, {dtype_to_str(dtype)}[{dims}]] {name}"


async def split_pieces(
    items: Iterable[Item | FlushBucket] | AsyncIterable[Item | FlushBucket],
    piece_bytes: int,
    counts: list[int],
) -> AsyncGenerator[Item | FlushBucket, None]:
    """``items`` with every tensor larger than ``piece_bytes`` cut into pieces of at most
    ``piece_bytes`` (views of its bytes, no copy: the sender copies each into its bucket before it
    asks for the next, so the producer's tensor is read before the producer is asked for another).
    ``counts[0]`` counts the items as the producer yielded them (the sender's ``tensors``)."""
    if piece_bytes < 1:
        raise ValueError(f"pieces need a positive size, got {piece_bytes}")
    names: set[str] = set()
    async for item in aiter_items(items):
        if item is FLUSH_BUCKET:
            yield FLUSH_BUCKET
            continue
        name, tensor = unpack_item(item)
        del item
        tensor = check_tensor(name, tensor)
        if name.startswith(PIECE_PREFIX):
            raise TransportError(
                f"fastsync hosts: the tensor name {name!r} starts with {PIECE_PREFIX!r}, which is reserved"
            )
        if name in names:
            raise DuplicateTensorError(f"tensor {name!r} appears twice in one weight sync")
        names.add(name)
        counts[0] += 1
        total = tensor.numel() * tensor.element_size()
        if total <= piece_bytes:
            yield name, tensor
            del tensor
            continue
        data = byte_view(tensor)
        shape, dtype = tuple(int(d) for d in tensor.shape), tensor.dtype
        del tensor
        for start in range(0, total, piece_bytes):
            end = min(total, start + piece_bytes)
            yield piece_name(name, start, end, total, dtype, shape), data[start:end]
        del data


class _Open:
    __slots__ = ("dtype", "filled", "name", "shape", "target", "tensor", "total")

    def __init__(
        self, who: str, name: str, total: int, dtype: torch.dtype, shape: tuple[int, ...], allocate: Allocate
    ) -> None:
        self.name, self.total, self.dtype, self.shape = name, total, dtype, shape
        self.tensor = allocate(shape, dtype, torch.device("cpu"))
        self.target = byte_view(self.tensor)
        if self.target.numel() != total:
            raise TransportError(
                f"{who}: the pieces of {name!r} say {total} bytes, but a {dtype_to_str(dtype)} "
                f"tensor of shape {list(shape)} has {self.target.numel()}"
            )
        self.filled = 0


class Pieces:
    """Puts pieces back together on a receiving rank: :meth:`feed` each item as it arrived; it
    returns the item to hand on (a whole tensor, or one completed by its last piece, in host memory
    of its own, from ``allocate``: a transport's :class:`~verl_fastsync.io.lending.DestinationPool`
    reuses the memory of such tensors once the consumer dropped them) or ``None`` while a tensor
    still misses pieces."""

    def __init__(self, who: str, allocate: Allocate | None = None) -> None:
        self.who = who
        self._allocate: Allocate = allocate or (lambda shape, dtype, device: torch.empty(shape, dtype=dtype))
        self.tensors = 0
        """Items handed on (the tensors of the sync as the sender's producer yielded them)."""
        self._open: _Open | None = None

    def feed(self, name: str, tensor: torch.Tensor) -> Item | None:
        match = _PIECE.fullmatch(name) if is_piece(name) else None
        if match is None:
            if self._open is not None:
                raise self._broken(f"{name!r} arrived")
            self.tensors += 1
            return name, tensor
        start, end, total = int(match[1]), int(match[2]), int(match[3])
        dtype_name, dims, real = match[4], match[5], match[6]
        piece = self._open
        if piece is None:
            if start != 0:
                raise TransportError(
                    f"{self.who}: the first piece of {real!r} to arrive carries bytes {start}-{end}, "
                    "not its first bytes (the stream is broken)"
                )
            shape = tuple(int(d) for d in dims.split(",")) if dims.strip() else ()
            try:
                dtype = str_to_dtype(dtype_name)
            except (KeyError, ValueError, TypeError) as exc:
                raise TransportError(
                    f"{self.who}: the pieces of {real!r} name an unknown dtype {dtype_name!r}"
                ) from exc
            piece = self._open = _Open(self.who, real, total, dtype, shape, self._allocate)
        elif real != piece.name or start != piece.filled or total != piece.total:
            raise self._broken(f"bytes {start}-{end} of {total} of {real!r} arrived")
        data = tensor if tensor.dtype == torch.uint8 else byte_view(tensor)
        if data.dim() != 1 or data.numel() != end - start or not 0 <= start < end <= total:
            raise TransportError(
                f"{self.who}: a piece of {real!r} says bytes {start}-{end} of {total} but carries "
                f"{data.numel()} bytes"
            )
        copy_bytes(piece.target[start:end], data)
        piece.filled = end
        if end < total:
            return None
        self._open = None
        self.tensors += 1
        return piece.name, piece.tensor

    def _broken(self, what: str) -> TransportError:
        piece = self._open
        assert piece is not None
        return TransportError(
            f"{self.who}: {what} while {piece.name!r} still missed bytes {piece.filled}-{piece.total} "
            "(the pieces of a tensor arrive in order, one tensor at a time: the stream is broken)"
        )

    def finish(self) -> None:
        """The stream ended: no tensor may still miss pieces."""
        if self._open is not None:
            piece, self._open = self._open, None
            raise TransportError(
                f"{self.who}: the sync ended while {piece.name!r} still missed bytes "
                f"{piece.filled}-{piece.total}"
            )


def count_of(stats: TransferStats | None, pieces: Pieces | None) -> TransferStats | None:
    """``stats`` of a receive that went through ``pieces``, counting tensors, not pieces."""
    if stats is None or pieces is None:
        return stats
    return dataclasses.replace(stats, tensors=pieces.tensors)
