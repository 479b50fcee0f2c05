"""Delta sync of a named-tensor stream (``engine_kwargs.fastsync.delta=true``).

The sender keeps the bytes of every tensor it sent (the *base*) and sends each tensor as its difference
from them; each receiver keeps what it received and rebuilds the full tensor before yielding it, so the
consumer sees exactly what a full sync yields. Everything here works on named tensors, above any
transport: a transport moves what :class:`DeltaEncoder` yields like any other tensors.

What goes on the wire, per tensor:

* a tensor without a usable base (first sync, a tensor added, reshaped or retyped, or one whose delta is
  not at most ``max_ratio`` of its bytes) goes as itself, under its own name: no header, no copy;
* otherwise a ``uint8`` tensor named :data:`DELTA_PREFIX` + name: a header (dtype, shape, padded to 8
  bytes) and a :mod:`~verl_fastsync.delta.codec` encoding (sparse blocked index/value pairs at the
  element width, with the codec's digest of the new bytes). The receiver rebuilds the tensor from its
  base and checks that digest: a wrong base never yields wrong bytes, it fails the sync.

**Bases and epochs.** Both sides name their base with an *epoch* (the id of the sync it came from).
A sync diffs against a base only when the sender and every receiver hold the same epoch (the engine
compares them in ``build_topology``, the handshake verl already runs); otherwise the sync is *full*:
every tensor goes as itself and every side rebuilds its base. A side adopts the new epoch only when
its part of the sync ended cleanly. While a delta sync runs, each side keeps an undo journal of what
it changed in its base (the old values of the elements a delta rewrote: about the delta's size; the
entry a raw tensor replaced); a sync that fails puts the base back at the epoch it diffed against, so
the next sync diffs against it again. A journal that would pass :data:`UNDO_FRACTION` of the base's
bytes is dropped, and a full sync keeps none: such a sync that fails leaves that side with no epoch,
and the next sync is full (a half-updated base is never used). Tensors not sent in a sync leave the
base when the sync ends (a tensor removed from the model).

**Memory.** The base is the model's bytes in host memory on the sending rank (its share, with several
senders; page-locked for CUDA tensors of 1 MiB or more compared on the device,
:mod:`~verl_fastsync.delta.device`: each such base a registration of just its pages, counted at that and
returned to the host when the base is dropped, pageable where pinning is refused,
:mod:`~verl_fastsync.delta.hostmem`) and on every receiving rank, plus the undo journal during a delta
sync (at most :data:`UNDO_FRACTION` of it) and, on the sender, one staging buffer
(:class:`~verl_fastsync.delta.device.Staging`). A receiver
lends the consumer a view of the base it rebuilt; a base the consumer still holds is never
written again (the next sync rebuilds that tensor into new memory and drops the old one), a base it
let go of is rebuilt in place. So the consumer may hold what it was given for as long as it likes. A
consumer that writes into a yielded tensor changes the base; the next delta sync then fails its
digest check (naming the tensor) and the sync after it is full. A side whose host has no room for
more base bytes turns delta off for the run (:mod:`~verl_fastsync.delta.side`): from then on a tensor
passes through it as it is, and no base is kept.

Imports torch, numpy and the other ``verl_fastsync.delta`` modules only (no verl, no transport).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Final

import numpy as np
import torch

from verl_fastsync.delta.bases import UNDO_FRACTION, Base
from verl_fastsync.delta.codec import (
    DEFAULT_MAX_RATIO,
    HEADER,
    Delta,
    DeltaError,
    Kind,
    as_bytes,
    decode,
    decode_in_place,
    encode,
)
from verl_fastsync.delta.device import Staging, base_copy, encode_on_device, host_bytes
from verl_fastsync.delta.hostmem import PAGE_LOCK_MIN, footprint
from verl_fastsync.delta.room import Room
from verl_fastsync.delta.side import DeltaStats, DeltaSyncError, Side
from verl_fastsync.io.lending import lend
from verl_fastsync.io.views import byte_view

__all__ = [
    "DELTA_PREFIX",
    "UNDO_FRACTION",
    "DeltaDecoder",
    "DeltaEncoder",
    "DeltaStats",
    "DeltaSyncError",
]

_log = logging.getLogger(__name__)

DELTA_PREFIX: Final = "__fastsync_delta__/"
"""Name prefix of a tensor sent as a delta (a model tensor may not be named so)."""

_TENSOR_HEADER: Final = struct.Struct("<4sBBH")
"""magic, version, ndim, dtype name length; then the dtype name, ``ndim`` int64 dims, zero padding to 8."""
_MAGIC: Final = b"FSDT"
_VERSION: Final = 1
_WIDTHS: Final = (1, 2, 4, 8)
_SPARSE_COUNT: Final = struct.Struct("<Q")
"""A sparse encoding's payload starts with its count of changed elements."""


def _width(tensor: torch.Tensor) -> int:
    size = tensor.element_size()
    return size if size in _WIDTHS else 1


def _pack_header(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    name = str(dtype).removeprefix("torch.").encode()
    head = _TENSOR_HEADER.pack(_MAGIC, _VERSION, len(shape), len(name)) + name
    head += struct.pack(f"<{len(shape)}q", *shape)
    return head + b"\0" * (-len(head) % 8)


def _unpack_header(data: np.ndarray, peer: str) -> tuple[torch.dtype, tuple[int, ...], int]:
    """dtype, shape and the header's length of a delta tensor's bytes."""
    if data.size < _TENSOR_HEADER.size:
        raise DeltaSyncError(f"{peer}: a delta tensor of {data.size} bytes is shorter than its header")
    magic, version, ndim, name_len = _TENSOR_HEADER.unpack_from(data.data)
    if magic != _MAGIC or version != _VERSION:
        raise DeltaSyncError(
            f"{peer}: not a verl-fastsync delta tensor (magic {magic!r}, version {version}; this side "
            f"speaks {_MAGIC!r} version {_VERSION}): install the same verl-fastsync on both sides"
        )
    at = _TENSOR_HEADER.size
    name = bytes(data[at : at + name_len]).decode()
    at += name_len
    shape = struct.unpack_from(f"<{ndim}q", data.data, at)
    at += 8 * ndim
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise DeltaSyncError(f"{peer}: a delta tensor names dtype {name!r}, which this torch does not know")
    return dtype, tuple(int(d) for d in shape), at + (-at % 8)


class DeltaEncoder(Side):
    """The sender's side: its base and epoch. Per sync: :meth:`begin`, :meth:`encode` for each tensor
    (or :meth:`stream`), then :meth:`commit` when the sync ended cleanly (else nothing: it stays
    without an epoch and the next sync is full)."""

    role = "sender"

    def __init__(
        self,
        max_ratio: float = DEFAULT_MAX_RATIO,
        compare_on_device: bool | None = None,
        room: Room | None = None,
        page_locked: bool | None = None,
    ) -> None:
        super().__init__(room)
        self.max_ratio = max_ratio
        self.compare_on_device = compare_on_device
        """Compare a tensor with its base on the tensor's device (:func:`encode_on_device`) rather than
        on the host; None: for a tensor that is not on the CPU (the tests force it on CPU tensors)."""
        self.page_locked = page_locked
        """Keep bases (and stage copies) in page-locked host memory where the host allows it; None:
        the base of a CUDA tensor of at least 1 MiB compared on its device, and the staging buffer when
        CUDA is available (the tests force it on CPU tensors)."""
        self.device_fallbacks = 0
        """Tensors compared on the host because the compare on their device ran out of device memory
        (the first one is logged)."""
        self._staging = Staging(page_locked)

    def encode(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """What to send for ``name`` (see the module docstring); the base holds ``tensor``'s bytes after."""
        with self._timed(), self._journaled():
            return self._encode(name, tensor)

    def _encode(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        if name.startswith(DELTA_PREFIX):
            raise DeltaSyncError(f"{self.who}: tensor name {name!r} starts with reserved {DELTA_PREFIX!r}")
        self._take(name)
        shape = tuple(tensor.shape)
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.model_bytes += nbytes
        held = self.base.get(name)
        if self.passing:
            self._staging.release()  # (delta is off: nothing is staged any more)
            return self._raw(name, tensor)
        if (
            self._against is None
            or held is None
            or held.dtype != tensor.dtype
            or held.shape != shape
            or held.data.numel() != nbytes
        ):
            self._journal_replaced(name, held)
            pinned = self._pins(tensor)
            if not self.make_room(name, footprint(nbytes, pinned) - (0 if held is None else held.taken)):
                self.base.pop(name, None)  # (delta is off: no base is kept from here)
                return self._raw(name, tensor)
            self.base[name] = Base(tensor.dtype, shape, base_copy(tensor, pinned), page_locked=pinned)
            return self._raw(name, tensor)
        width = _width(tensor)
        delta = self._sparse_delta(name, tensor, held, width)
        if delta is None:
            return self._raw(name, tensor)
        if delta.undo is not None:
            self._journal_patch(name, delta.undo)
        head = _pack_header(tensor.dtype, shape)
        wire = np.empty(len(head) + delta.nbytes, dtype=np.uint8)
        wire[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        at = len(head)
        header = delta.header
        wire[at : at + len(header)] = np.frombuffer(header, dtype=np.uint8)
        at += len(header)
        for part in delta.parts:
            wire[at : at + part.nbytes] = part
            at += part.nbytes
        stats = self.stats
        stats.delta_tensors += 1
        stats.wire_bytes += wire.nbytes
        stats.changed_elements += int(delta.changed or 0)
        stats.compared_elements += nbytes // width
        return DELTA_PREFIX + name, torch.from_numpy(wire)

    def _sparse_delta(self, name: str, tensor: torch.Tensor, held: Base, width: int) -> Delta | None:
        """The sparse delta of ``tensor`` from its base ``held`` (which then holds ``tensor``'s bytes,
        its old values journaled); None: ``tensor`` goes as itself, its new base already in place."""
        undo = self._journal is not None
        if self._on_device(tensor):
            try:
                delta = encode_on_device(held.data, tensor, width, max_ratio=self.max_ratio, undo=undo)
            except torch.OutOfMemoryError as exc:  # (nothing written yet): the host compare does it
                self.device_fallbacks += 1
                if self.device_fallbacks == 1:
                    _log.warning("%s: comparing %r on its device ran out of memory (%s); compared on "
                                 "the host instead", self.who, name, str(exc).splitlines()[0])  # fmt: skip
            else:
                if delta is None:  # the base is as it was: keep it in the journal, or copy the new bytes in
                    if undo and self._journal_replaced(name, held):
                        pinned = held.page_locked
                        self.base[name] = Base(
                            tensor.dtype, held.shape, base_copy(tensor, pinned), page_locked=pinned
                        )
                    elif held.data.numel():
                        held.data.copy_(byte_view(tensor.detach()))
                return delta
        new, copied = self._staging.host_bytes(tensor)
        found = encode(held.data, new, width, max_ratio=self.max_ratio, update_base=True, undo=undo)
        if found.kind is not Kind.RAW:
            return found
        if undo:  # the base is as it was: keep it in the journal, or write the new bytes into it
            if self._journal_replaced(name, held):
                pinned = held.page_locked  # (fresh memory is the new base as it is, where it may be)
                data = new if copied and not pinned else base_copy(new, pinned)
                self.base[name] = Base(tensor.dtype, held.shape, data, page_locked=pinned)
            else:
                held.data.copy_(new)
        return None

    def _on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type != "cpu" if self.compare_on_device is None else self.compare_on_device

    def _pins(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s base is page-locked: the base of a CUDA tensor of at least
        :data:`~verl_fastsync.delta.hostmem.PAGE_LOCK_MIN` bytes compared on its device crosses to the
        device every sync (:attr:`page_locked` decides when set)."""
        if self.page_locked is not None:
            return self.page_locked
        big = tensor.numel() * tensor.element_size() >= PAGE_LOCK_MIN
        return big and tensor.device.type == "cuda" and self._on_device(tensor)

    def _raw(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """``tensor`` goes as itself (its base was set by the caller)."""
        self.stats.raw_tensors += 1
        self.stats.wire_bytes += tensor.numel() * tensor.element_size()
        return name, tensor

    async def stream(
        self, weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]]
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """``weights`` encoded one by one (the producer's tensor is released before the next)."""
        if isinstance(weights, AsyncIterable):
            async for name, tensor in weights:
                item = self.encode(name, tensor)
                del tensor
                yield item
                del item
        else:
            for name, tensor in weights:
                item = self.encode(name, tensor)
                del tensor
                yield item
                del item


class DeltaDecoder(Side):
    """A receiver's side: its base and epoch. Per sync: :meth:`begin`, :meth:`decode` for each
    received tensor, :meth:`commit` when the stream ended cleanly."""

    role = "receiver"

    def decode(self, name: str, received: torch.Tensor) -> tuple[str, torch.Tensor]:
        """The full tensor for what arrived under ``name``; it becomes this side's base (a new tensor
        each sync: what the consumer holds from an earlier sync is never written)."""
        with self._timed(), self._journaled():
            return self._decode(name, received)

    def _decode(self, name: str, received: torch.Tensor) -> tuple[str, torch.Tensor]:
        stats = self.stats
        stats.wire_bytes += received.numel() * received.element_size()
        if not name.startswith(DELTA_PREFIX):
            self._take(name)
            if self.passing:
                return self._pass(name, received)
            data, copied = host_bytes(received)
            held = self.base.get(name)
            reuse = held is not None and held.writable() and held.data.numel() == data.numel()
            if self._journal is not None and self._journal_replaced(name, held):
                reuse = False  # the journal keeps the old entry: the new bytes go to new memory
            grows = data.numel() - (0 if held is None else held.data.numel())
            if not reuse and not self.make_room(name, grows):
                return self._pass(name, received)
            if reuse and held is not None:
                held.data.copy_(data)  # the consumer let go of the last one: reuse its memory
                data = held.data
            elif not copied:
                data = data.clone()  # never the transport's (possibly lent) memory
            stats.raw_tensors += 1
            stats.model_bytes += data.numel()
            return name, self._keep(name, received.dtype, tuple(received.shape), data)
        name = name[len(DELTA_PREFIX) :]
        self._take(name)
        if self._against is None:
            raise DeltaSyncError(f"{self.who}: {name!r} arrived as a delta in a full sync")
        wire = as_bytes(host_bytes(received)[0])
        dtype, shape, at = _unpack_header(wire, self.who)
        held = self.base.get(name)
        if held is None or held.dtype != dtype or held.shape != shape:
            raise DeltaSyncError(
                f"{self.who}: {name!r} arrived as a delta of a {dtype} {list(shape)} tensor, this "
                f"receiver's base holds {'nothing' if held is None else f'{held.dtype} {list(held.shape)}'} "
                "under that name"
            )
        # in place when the consumer let go of the last one (the codec restores it if it fails)
        in_place = held.writable()
        out = held.data if in_place else torch.empty(held.data.numel(), dtype=torch.uint8)
        try:
            if in_place and self._journal is not None:
                self._journal_patch(name, decode_in_place(held.data, wire[at:]))
            else:
                decode(held.data, wire[at:], out=out)
                if not in_place:
                    self._journal_replaced(name, held)
        except DeltaError as exc:
            raise DeltaSyncError(
                f"{self.who}: tensor {name!r}: {exc} (did the consumer write into a tensor it was given "
                "in the last sync? the next sync is full)"
            ) from exc
        width = _width(torch.empty(0, dtype=dtype))
        stats.delta_tensors += 1
        stats.model_bytes += out.numel()
        stats.compared_elements += out.numel() // width
        stats.changed_elements += int(_SPARSE_COUNT.unpack_from(wire.data, at + HEADER.size)[0])
        return name, self._keep(name, dtype, shape, out)

    def _pass(self, name: str, received: torch.Tensor) -> tuple[str, torch.Tensor]:
        """Delta is off: ``received`` goes on as it came (a plain receive's tensor) and no base is kept."""
        self.base.pop(name, None)
        self.stats.raw_tensors += 1
        self.stats.model_bytes += received.numel() * received.element_size()
        return name, received

    def _keep(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...], data: torch.Tensor
    ) -> torch.Tensor:
        """``data`` becomes the base of ``name``; the consumer gets a lent view of it (the lease says
        when it let go, so that the next sync can rebuild it in place)."""
        if data.numel() == 0:
            self.base[name] = Base(dtype, shape, data)
            return torch.empty(shape, dtype=dtype)
        lent, lease = lend(data)
        self.base[name] = Base(dtype, shape, data, lease)
        return _as_tensor(lent, dtype, shape)


def _as_tensor(data: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Flat bytes ``data`` as a ``dtype`` tensor of ``shape`` (sharing its memory)."""
    if data.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    return data.view(dtype).reshape(shape)
