"""The delta codec over one bucket's bytes: :func:`encode` turns the new bytes into their difference from
the previous bytes of the same length (the *base*), :func:`decode` rebuilds the new bytes from the base
and that encoding, bit-exactly, or raises :class:`DeltaError`.

An encoding is a fixed header (:data:`HEADER`: magic, kind, element width, size, payload length, the
xxh3-64 digest of the new bytes) and a payload of one :class:`Kind`:

* ``SPARSE``: the changed elements at the element width (1, 2, 4 or 8 bytes; a bucket of bf16 values
  uses 2). Indices are stored blocked: for every block of :data:`BLOCK` elements the count of changed
  ones (``uint32``), then each changed element's index inside its block (``uint16``), then the new
  values (``uint<width>``), then the bytes past the last whole element. At ``f`` changed, that is about
  ``f * (2 + width) / width`` of the raw size: 4% of a bf16 bucket at 2% changed.
* ``RAW``: the new bytes themselves, when the sparse form is not at most ``max_ratio`` of them (a delta
  that saves little costs more to build and apply than the bytes it saves; see
  :data:`DEFAULT_MAX_RATIO`).

:func:`decode` checks the header against the base it was given, the payload's structure before it
writes anything, and the rebuilt bytes' digest after; a corrupted or truncated encoding, or one built
against another base, raises and never yields wrong bytes. Decoding in place (``out`` is the base) puts
the base back as it was when it raises, so a failed decode never leaves a half-updated base.

Buffers are flat ``uint8`` numpy arrays; :func:`as_bytes` views bytes-like objects, C-contiguous numpy
arrays and contiguous CPU torch tensors as one without copying. Everything is vectorised numpy: the
cost is a compare of base and new (on :data:`THREADS` threads for a large tensor, skipped when an
evenly spaced sample already shows the delta would not pay), a digest and work proportional to the
changed elements. Imports numpy, torch, xxhash and the standard library only.
"""

from __future__ import annotations

import math
import os
import struct
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

import numpy as np
import numpy.typing as npt
import torch
import xxhash

__all__ = [
    "BLOCK",
    "DEFAULT_MAX_RATIO",
    "HEADER",
    "MAGIC",
    "Delta",
    "DeltaCorruptedError",
    "DeltaDigestError",
    "DeltaError",
    "Kind",
    "as_bytes",
    "decode",
    "element_width",
    "encode",
    "sparse_size",
]

Bytes = npt.NDArray[np.uint8]

MAGIC: Final = b"FSD1"
"""First bytes of every encoding; the digit is the format version."""

HEADER: Final = struct.Struct("<4sBBHQQQ")
"""magic, kind, element width, reserved (0), size of the new bytes, payload bytes, xxh3-64 of the new
bytes: 32 bytes, little-endian."""

BLOCK_BITS: Final = 16
BLOCK: Final = 1 << BLOCK_BITS
"""Elements per index block: an index inside a block fits ``uint16``."""

DEFAULT_MAX_RATIO: Final = 0.5
"""The sparse form is used when it is at most this fraction of the raw bytes (at 0.5: a quarter of the
bf16 values changed, a third of the fp32 ones), else the bucket goes raw. It is a bound on bytes; time
depends on the link: on one core the sparse encode runs at ~2-3 GB/s at 1-2% of bf16 values changed and
~1 GB/s at 6-12% (``benchmarks/delta_codec.py``), so on a 10 Gbit/s link delta saves time up to about
8% changed and bytes beyond; a caller that knows its link passes its own ``max_ratio``."""

_DTYPES: Final[dict[int, type[np.unsignedinteger]]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_COUNT: Final = struct.Struct("<Q")


class Kind(IntEnum):
    """How a payload encodes the new bytes."""

    RAW = 0
    SPARSE = 1


class DeltaError(ValueError):
    """A delta cannot be built or rebuilt."""


class DeltaCorruptedError(DeltaError):
    """An encoding is truncated, corrupted, or does not fit the base it was given."""


class DeltaDigestError(DeltaCorruptedError):
    """The rebuilt bytes differ from the sender's: a corrupted payload, or a base other than the
    sender's."""


@dataclass(frozen=True)
class Delta:
    """One encoded bucket: :attr:`header` then :attr:`parts`, to be sent in that order (or joined by
    :meth:`tobytes`). A ``RAW`` part is a view of the new bytes given to :func:`encode`: send it before
    they change."""

    kind: Kind
    width: int
    size: int
    """Bytes of the bucket (the new bytes)."""
    digest: int
    """xxh3-64 of the new bytes."""
    changed: int | None
    """Elements (of ``width`` bytes) that differ from the base; None for ``RAW`` (counting stops as soon
    as the sparse form is too large)."""
    parts: tuple[Bytes, ...]

    @property
    def payload_bytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole encoding: what goes on the wire."""
        return HEADER.size + self.payload_bytes

    @property
    def header(self) -> bytes:
        return HEADER.pack(MAGIC, self.kind, self.width, 0, self.size, self.payload_bytes, self.digest)

    def tobytes(self) -> bytes:
        return b"".join([self.header, *(part.data for part in self.parts)])


def as_bytes(buffer: object) -> Bytes:
    """``buffer`` as a flat ``uint8`` numpy array sharing its memory: a contiguous CPU torch tensor (any
    dtype, 0-d and empty included), a C-contiguous numpy array or a bytes-like object (read-only)."""
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise DeltaError(f"need a contiguous CPU tensor, got one on {buffer.device}")
        return buffer.detach().reshape(-1).view(torch.uint8).numpy()
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise DeltaError("need a C-contiguous array")
        return buffer.reshape(-1).view(np.uint8)
    return np.frombuffer(buffer, dtype=np.uint8)  # type: ignore[call-overload]


def element_width(itemsizes: Iterable[int]) -> int:
    """The element width to diff a bucket holding tensors of these itemsizes (bytes) at: the largest
    width that divides every itemsize, at most 8 (a bucket of bf16 and fp32 tensors: 2). Any width
    is bit-exact; this one makes one changed value one changed element."""
    width = 8
    for itemsize in itemsizes:
        width = math.gcd(width, itemsize)
    return width


def _elements(buf: Bytes, width: int) -> tuple[npt.NDArray[np.unsignedinteger], Bytes]:
    """``buf`` as whole elements of ``width`` bytes, and the bytes past the last whole one."""
    whole = buf.size - buf.size % width
    return buf[:whole].view(_DTYPES[width]), buf[whole:]


def _blocks(elements: int) -> int:
    return -(-elements // BLOCK)


def _pad8(nbytes: int) -> int:
    return -nbytes % 8


def sparse_size(size: int, width: int, changed: int) -> int:
    """Payload bytes of the sparse form of a ``size``-byte bucket with ``changed`` elements changed."""
    counts = _COUNT.size + 4 * _blocks(size // width)
    indices = 2 * changed
    return counts + _pad8(counts) + indices + _pad8(indices) + width * changed + size % width


SCAN: Final = 1 << 20
"""Elements compared at a time: the changed-mask of one slice stays in cache and is reused, so a
bucket costs no mask of its own size, and counting stops at the slice where the delta stops paying."""

_CPUS: Final = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
THREADS: Final = max(1, min(8, _CPUS))
"""Threads comparing one tensor's slices (numpy releases the GIL while it compares): the compare is
most of a sparse encode's time, and a sending trainer rank's cores are idle while it syncs. The CPUs
this process may run on, at most 8: the compare is bound by memory bandwidth long before that."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="fastsync-delta")
        return _pool


def _forget_threads() -> None:
    """In a forked child: the parent's threads do not exist here (work given to them would never run)."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_threads)


class _Budget:
    """The changed elements found so far by every slice of one compare, and the most that may be."""

    def __init__(self, most: float) -> None:
        self.most = most
        self.found = 0
        self._lock = threading.Lock()

    def add(self, count: int) -> bool:
        """Count ``count`` more; False once the total is past the most."""
        with self._lock:
            self.found += count
            return self.found <= self.most

    @property
    def over(self) -> bool:
        return self.found > self.most


@dataclass
class _Changes:
    """The changed elements of one range of whole index blocks."""

    counts: npt.NDArray[np.uint32]
    """Changed elements per block of the range."""
    low: npt.NDArray[np.uint16]
    """Each changed element's index inside its block, ascending."""
    values: npt.NDArray[np.unsignedinteger]
    """The new values of the changed elements."""


def _changes_in(
    old: npt.NDArray[np.unsignedinteger],
    new: npt.NDArray[np.unsignedinteger],
    start: int,
    stop: int,
    scan: int,
    budget: _Budget,
    update_base: bool,
) -> _Changes | None:
    """The changed elements in ``[start, stop)`` (``start`` a multiple of :data:`BLOCK`), compared
    ``scan`` elements at a time; None once the budget is spent (here or by another range).
    ``update_base``: ``old`` takes the new values. Each slice's indices live only while that slice
    is handled: what stays is 2 + width bytes per changed element."""
    mask = np.empty(min(scan, stop - start), dtype=np.bool_)
    counts = np.zeros(_blocks(stop - start), dtype=np.uint32)
    low: list[npt.NDArray[np.uint16]] = []
    values: list[npt.NDArray[np.unsignedinteger]] = []
    for at in range(start, stop, scan):
        if budget.over:
            return None
        end = min(at + scan, stop)
        np.not_equal(old[at:end], new[at:end], out=mask[: end - at])
        if not budget.add(int(np.count_nonzero(mask[: end - at]))):
            return None  # (counted before the indices are built: a fully changed slice costs no index)
        index = np.flatnonzero(mask[: end - at])
        if not index.size:
            continue
        changed = new[at:end][index]
        if update_base:
            old[at:end][index] = changed
        values.append(changed)
        index += at - start  # from here: the index inside this range (which starts on a block)
        low.append(index.astype(np.uint16))
        first, last = int(index[0]) >> BLOCK_BITS, int(index[-1]) >> BLOCK_BITS
        counts[first : last + 1] += np.bincount((index >> BLOCK_BITS) - first).astype(np.uint32)
        del index, changed
    return _Changes(
        counts,
        np.concatenate(low) if low else np.empty(0, dtype=np.uint16),
        np.concatenate(values) if values else np.empty(0, dtype=new.dtype),
    )


def _changes(
    old: npt.NDArray[np.unsignedinteger],
    new: npt.NDArray[np.unsignedinteger],
    most: float,
    update_base: bool,
) -> list[_Changes] | None:
    """The changed elements of ``old`` and ``new``, by ranges in order; None once there are more than
    ``most``. Tensors of several :data:`SCAN` slices are compared by :data:`THREADS` threads, each a
    range of whole index blocks compared ``SCAN / ranges`` elements at a time (the threads' masks
    together are one slice's, whatever the thread count); the count is shared, so every range stops
    once the delta stops paying."""
    if most < 0:
        return None
    budget = _Budget(most)
    slices = -(-old.size // SCAN)
    ranges = min(THREADS, slices)
    if ranges <= 1:
        one = _changes_in(old, new, 0, old.size, SCAN, budget, update_base)
        return None if one is None else [one]
    scan = max(1, SCAN // ranges)  # the threads' masks together are one SCAN slice's
    step = -(-slices // ranges) * SCAN
    step = -(-step // BLOCK) * BLOCK  # ranges of whole index blocks: their counts join in order
    pool = _threads()
    parts = [
        pool.submit(_changes_in, old, new, start, min(start + step, old.size), scan, budget, update_base)
        for start in range(0, old.size, step)
    ]
    wait(parts)  # every range is done with the base before anything is returned or raised
    results = [part.result() for part in parts]
    return None if any(r is None for r in results) else [r for r in results if r is not None]


SAMPLE: Final = 16384
"""Evenly spaced elements compared before a tensor of at least 4x as many is scanned."""


def _sample_says_raw(
    old: npt.NDArray[np.unsignedinteger], new: npt.NDArray[np.unsignedinteger], most: float
) -> bool:
    """A sample changed at 1.25x the fraction the sparse form can afford (re-initialised or heavily
    trained weights): send raw without scanning, which would build a large index before its count
    stops it. Only speed depends on it: a sample that errs either way still yields exact bytes."""
    if old.size < 4 * SAMPLE:
        return False
    stride = old.size // SAMPLE
    changed = int(np.count_nonzero(old[::stride] != new[::stride]))
    return changed / -(-old.size // stride) > 1.25 * most / old.size


def encode(
    base: object,
    new: object,
    width: int,
    *,
    max_ratio: float = DEFAULT_MAX_RATIO,
    update_base: bool = False,
) -> Delta:
    """The delta of ``new`` from ``base`` (equal lengths), comparing elements of ``width`` bytes: sparse
    when that payload is at most ``max_ratio`` of ``new``'s bytes, else raw. ``update_base``: ``base``
    (writable) holds ``new``'s bytes afterwards, written only where they changed when the delta is
    sparse."""
    if width not in _DTYPES:
        raise DeltaError(f"element width must be one of {sorted(_DTYPES)}, got {width}")
    if not 0.0 <= max_ratio <= 1.0:
        raise DeltaError(f"max_ratio must be in [0, 1], got {max_ratio}")
    old, now = as_bytes(base), as_bytes(new)
    if old.size != now.size:
        raise DeltaError(f"base has {old.size} bytes, new has {now.size}: a delta needs equal lengths")
    if update_base and not old.flags.writeable:
        raise DeltaError("update_base needs a writable base")
    digest = xxhash.xxh3_64_intdigest(now.data)
    old_el, old_tail = _elements(old, width)
    now_el, now_tail = _elements(now, width)
    most = (max_ratio * now.size - sparse_size(now.size, width, 0)) / (2 + width)
    found = None if _sample_says_raw(old_el, now_el, most) else _changes(old_el, now_el, most, update_base)
    changed = 0 if found is None else sum(part.low.size for part in found)
    if found is None or now.size == 0 or sparse_size(now.size, width, changed) > max_ratio * now.size:
        if update_base:  # (the first test is the early stop; the last adds index padding to it)
            old[:] = now  # (also where a range already wrote its changed values)
        return Delta(Kind.RAW, width, now.size, digest, None, (now,))
    counts = np.concatenate([part.counts for part in found])
    head = np.frombuffer(_COUNT.pack(changed), dtype=np.uint8)
    low = np.concatenate([part.low for part in found])
    values = np.concatenate([part.values for part in found])
    pad = np.zeros(8, dtype=np.uint8)
    parts = (
        head,
        counts.view(np.uint8),
        pad[: _pad8(head.nbytes + counts.nbytes)],
        low.view(np.uint8),
        pad[: _pad8(low.nbytes)],
        values.view(np.uint8),
        now_tail.copy(),
    )
    if update_base:
        old_tail[:] = now_tail
    return Delta(Kind.SPARSE, width, now.size, digest, changed, parts)


def _parse(encoded: Bytes, base_size: int) -> tuple[Kind, int, int, Bytes]:
    """kind, width, digest and payload of ``encoded``, checked against a base of ``base_size`` bytes."""
    if encoded.size < HEADER.size:
        raise DeltaCorruptedError(f"delta truncated: {encoded.size} bytes, the header alone is {HEADER.size}")
    magic, kind, width, reserved, size, payload, digest = HEADER.unpack_from(encoded.data)
    if magic != MAGIC:
        raise DeltaCorruptedError(f"not a delta encoding (magic {magic!r}, expected {MAGIC!r})")
    if reserved:
        raise DeltaCorruptedError(f"delta header's reserved field is {reserved}, not 0")
    if kind not in Kind.__members__.values():
        raise DeltaCorruptedError(f"unknown delta kind {kind}")
    if width not in _DTYPES:
        raise DeltaCorruptedError(f"delta element width {width} is not one of {sorted(_DTYPES)}")
    if size != base_size:
        raise DeltaCorruptedError(f"delta is for {size} bytes but the base has {base_size}")
    if payload != encoded.size - HEADER.size:
        raise DeltaCorruptedError(
            f"delta payload is {encoded.size - HEADER.size} bytes, its header says {payload} (truncated?)"
        )
    return Kind(kind), width, digest, encoded[HEADER.size :]


def _sparse_parts(payload: Bytes, size: int, width: int) -> tuple[npt.NDArray[np.int64], Bytes, Bytes]:
    """Indices (checked in range), values and tail bytes of a sparse payload, before anything is
    written."""
    elements = size // width
    if payload.size < _COUNT.size:
        raise DeltaCorruptedError("sparse delta truncated before its count")
    (changed,) = _COUNT.unpack_from(payload.data)
    if changed > elements or payload.size != sparse_size(size, width, changed):
        raise DeltaCorruptedError(
            f"sparse delta of {payload.size} bytes does not fit {changed} changed of {elements} elements"
        )
    blocks = _blocks(elements)
    at = _COUNT.size
    counts = payload[at : at + 4 * blocks].view(np.uint32)
    at += 4 * blocks
    padding = [payload[at : at + _pad8(at)]]
    at += _pad8(at)
    low = payload[at : at + 2 * changed].view(np.uint16)
    at += 2 * changed
    padding.append(payload[at : at + _pad8(2 * changed)])
    at += _pad8(2 * changed)
    if any(pad.any() for pad in padding):
        raise DeltaCorruptedError("sparse delta's padding is not zero")
    values = payload[at : at + width * changed]
    tail = payload[at + width * changed :]
    if int(counts.sum(dtype=np.uint64)) != changed or (blocks and int(counts.max()) > BLOCK):
        raise DeltaCorruptedError("sparse delta's block counts do not add up to its changed elements")
    starts = np.arange(blocks, dtype=np.int64) << BLOCK_BITS
    index = np.repeat(starts, counts.astype(np.int64)) + low.astype(np.int64)
    if changed and int(index.max()) >= elements:
        raise DeltaCorruptedError(f"sparse delta names element {int(index.max())} of {elements}")
    return index, values, tail


def decode(base: object, encoded: object, out: object = None) -> Bytes:
    """The new bytes rebuilt from ``base`` and ``encoded`` (an encoding's bytes, as :meth:`Delta.tobytes`
    joins them), written to ``out`` (a new array when None; ``out`` may be ``base`` itself: then the base
    is updated in place, and is left unchanged when this raises). Raises :class:`DeltaCorruptedError`
    for an encoding that is truncated, corrupted or made for another size, and
    :class:`DeltaDigestError` when the rebuilt bytes are not the sender's."""
    old, enc = as_bytes(base), as_bytes(encoded)
    kind, width, digest, payload = _parse(enc, old.size)
    target = np.empty(old.size, dtype=np.uint8) if out is None else as_bytes(out)
    if target.size != old.size or not target.flags.writeable:
        raise DeltaError(f"out must be writable and hold {old.size} bytes")
    in_place = target.size > 0 and target.__array_interface__["data"][0] == old.__array_interface__["data"][0]
    if not in_place and np.shares_memory(target, old):
        raise DeltaError("out overlaps the base without being it")
    if kind is Kind.RAW:
        if payload.size != old.size:
            raise DeltaCorruptedError(f"raw delta carries {payload.size} bytes for a {old.size}-byte base")
        _check_digest(payload, digest)
        target[:] = payload
        return target
    index, values, tail = _sparse_parts(payload, old.size, width)
    if not in_place:
        target[:] = old
    target_el, target_tail = _elements(target, width)
    saved, saved_tail = target_el[index], target_tail.copy()
    target_el[index] = values.view(_DTYPES[width])
    target_tail[:] = tail
    try:
        _check_digest(target, digest)
    except DeltaDigestError:
        if in_place:
            target_el[index] = saved
            target_tail[:] = saved_tail
        raise
    return target


def _check_digest(data: Bytes, digest: int) -> None:
    got = xxhash.xxh3_64_intdigest(data.data)
    if got != digest:
        raise DeltaDigestError(
            f"rebuilt bytes have digest {got:#018x}, the sender's are {digest:#018x}: "
            "the delta is corrupted or was made against another base"
        )
