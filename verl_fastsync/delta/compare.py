"""The compare at the heart of a delta encode (:mod:`verl_fastsync.delta.codec`): which elements of a
tensor's new bytes differ from its base, in index blocks of :data:`BLOCK` elements.

A tensor is compared :data:`SCAN` elements at a time (a slice's mask stays in cache), on
:data:`THREADS` threads for a large one (numpy releases the GIL), counting as it goes so that every
thread stops once the delta cannot pay; an evenly spaced sample decides first whether a tensor that
mostly changed is worth scanning at all. With ``update_base`` the changed values are written into
the base as they are found; with ``undo`` their old values are kept, and a compare that stops early
puts back what it wrote. Imports numpy and the standard library only.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Final, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = [
    "BLOCK",
    "BLOCK_BITS",
    "PIECE",
    "SAMPLE",
    "SCAN",
    "THREADS",
    "Changes",
    "apply_changes",
    "blocks",
    "changes",
    "changes_in",
    "on_threads",
    "positions",
    "sample_changed_says_raw",
    "sample_says_raw",
    "sample_stride",
]

T = TypeVar("T")

BLOCK_BITS: Final = 16
BLOCK: Final = 1 << BLOCK_BITS
"""Elements per index block: an index inside a block fits ``uint16``."""


def blocks(elements: int) -> int:
    return -(-elements // BLOCK)


def positions(
    counts: npt.NDArray[np.uint32], low: npt.NDArray[np.uint16], start: int = 0
) -> npt.NDArray[np.int64]:
    """The element indices that blocked ``counts`` and in-block ``low`` indices name, from ``start``."""
    starts = (np.arange(counts.size, dtype=np.int64) << BLOCK_BITS) + start
    return np.repeat(starts, counts.astype(np.int64)) + low.astype(np.int64)


SCAN: Final = 1 << 20
"""Elements compared at a time: the changed-mask of one slice stays in cache and is reused, so a
bucket costs no mask of its own size, and counting stops at the slice where the delta stops paying."""

_CPUS: Final = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
THREADS: Final = max(1, min(4, _CPUS))
"""Threads comparing one tensor's slices (numpy releases the GIL while it compares): the compare is
most of a sparse encode's time, and a sending trainer rank's cores are idle while it syncs. The CPUs
this process may run on, at most 4: on a 16-core H200 host 256 MiB at 4% changed encoded in 0.32 /
0.19 / 0.14 / 0.16 / 0.28 s on 1 / 2 / 4 / 8 / 16 threads (the parts that hold the GIL and memory
bandwidth cap it)."""

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
class Changes:
    """The changed elements of one range of whole index blocks."""

    counts: npt.NDArray[np.uint32]
    """Changed elements per block of the range."""
    low: npt.NDArray[np.uint16]
    """Each changed element's index inside its block, ascending."""
    values: npt.NDArray[np.unsignedinteger]
    """The new values of the changed elements."""
    start: int
    """The range's first element."""
    before: npt.NDArray[np.unsignedinteger] | None
    """With ``undo``: the values the base held there before they were written."""

    def put_back(self, old: npt.NDArray[np.unsignedinteger]) -> None:
        """Writes :attr:`before` back into the base ``old``."""
        if self.before is not None and self.low.size:
            old[positions(self.counts, self.low, self.start)] = self.before


def changes_in(
    old: npt.NDArray[np.unsignedinteger],
    new: npt.NDArray[np.unsignedinteger],
    start: int,
    stop: int,
    scan: int,
    budget: _Budget,
    update_base: bool,
    undo: bool = False,
) -> Changes | None:
    """The changed elements in ``[start, stop)`` (``start`` a multiple of :data:`BLOCK`), compared
    ``scan`` elements at a time; None once the budget is spent (here or by another range).
    ``update_base``: ``old`` takes the new values; with ``undo`` the old values are kept too, and a
    range that stops early puts back what it wrote. Each slice's indices live only while that slice
    is handled: what stays is 2 + width bytes per changed element (2 + 2 * width with ``undo``)."""
    mask = np.empty(min(scan, stop - start), dtype=np.bool_)
    counts = np.zeros(blocks(stop - start), dtype=np.uint32)
    low: list[npt.NDArray[np.uint16]] = []
    values: list[npt.NDArray[np.unsignedinteger]] = []
    before: list[npt.NDArray[np.unsignedinteger]] = []

    def joined() -> Changes:
        return Changes(
            counts,
            np.concatenate(low) if low else np.empty(0, dtype=np.uint16),
            np.concatenate(values) if values else np.empty(0, dtype=new.dtype),
            start,
            (np.concatenate(before) if before else np.empty(0, dtype=new.dtype)) if undo else None,
        )

    for at in range(start, stop, scan):
        end = min(at + scan, stop)
        if not budget.over:
            np.not_equal(old[at:end], new[at:end], out=mask[: end - at])
            # (counted before the indices are built: a fully changed slice costs no index)
            if budget.add(int(np.count_nonzero(mask[: end - at]))):
                index = np.flatnonzero(mask[: end - at])
                if not index.size:
                    continue
                changed = new[at:end][index]
                if update_base:
                    if undo:
                        before.append(old[at:end][index])
                    old[at:end][index] = changed
                values.append(changed)
                index += at - start  # from here: the index inside this range (which starts on a block)
                low.append(index.astype(np.uint16))
                first, last = int(index[0]) >> BLOCK_BITS, int(index[-1]) >> BLOCK_BITS
                counts[first : last + 1] += np.bincount((index >> BLOCK_BITS) - first).astype(np.uint32)
                del index, changed
                continue
        if update_base and undo:  # the delta does not pay: the base is left as it was
            joined().put_back(old)
        return None
    return joined()


def changes(
    old: npt.NDArray[np.unsignedinteger],
    new: npt.NDArray[np.unsignedinteger],
    most: float,
    update_base: bool,
    undo: bool = False,
) -> list[Changes] | None:
    """The changed elements of ``old`` and ``new``, by ranges in order; None once there are more than
    ``most``. Tensors of several :data:`SCAN` slices are compared by :data:`THREADS` threads, each a
    range of whole index blocks compared ``SCAN / ranges`` elements at a time (the threads' masks
    together are one slice's, whatever the thread count); the count is shared, so every range stops
    once the delta stops paying. With ``undo``, None leaves ``old`` as it was."""
    if most < 0:
        return None
    budget = _Budget(most)
    slices = -(-old.size // SCAN)
    ranges = min(THREADS, slices)
    if ranges <= 1:
        one = changes_in(old, new, 0, old.size, SCAN, budget, update_base, undo)
        return None if one is None else [one]
    scan = max(1, SCAN // ranges)  # the threads' masks together are one SCAN slice's
    step = -(-slices // ranges) * SCAN
    step = -(-step // BLOCK) * BLOCK  # ranges of whole index blocks: their counts join in order
    pool = _threads()
    parts = [
        pool.submit(changes_in, old, new, start, min(start + step, old.size), scan, budget, update_base, undo)
        for start in range(0, old.size, step)
    ]
    wait(parts)  # every range is done with the base before anything is returned or raised
    results = [part.result() for part in parts]
    done = [r for r in results if r is not None]
    if len(done) == len(results):
        return done
    if update_base and undo:
        for part in done:  # (the ranges that stopped early put theirs back themselves)
            part.put_back(old)
    return None


PIECE: Final = 1 << 18
"""Changed elements written at a time by :func:`apply_changes` (their ``int64`` indices, 2 MiB, stay in
cache instead of one index array as large as the delta's)."""


def apply_changes(
    target: npt.NDArray[np.unsignedinteger],
    counts: npt.NDArray[np.uint32],
    low: npt.NDArray[np.uint16],
    values: npt.NDArray[np.unsignedinteger],
    saved: npt.NDArray[np.unsignedinteger] | None = None,
) -> None:
    """Writes ``values`` where blocked ``counts`` and ``low`` name (checked by the caller), whole
    blocks of about :data:`PIECE` changed elements at a time, on :data:`THREADS` threads when there
    are several pieces; ``saved`` (as long as ``values``) takes the values written over first."""
    total = low.size
    if not total:
        return
    cumulative = np.cumsum(counts, dtype=np.int64)
    # the first block of each piece: where the running count passes the next multiple of PIECE
    cuts = np.searchsorted(cumulative, np.arange(PIECE, total, PIECE, dtype=np.int64), side="left") + 1
    edges = [0, *sorted(set(int(c) for c in cuts if 0 < c < counts.size)), counts.size]

    def piece(first: int, stop: int) -> None:
        lo = int(cumulative[first - 1]) if first else 0
        hi = int(cumulative[stop - 1])
        if hi == lo:
            return
        index = positions(counts[first:stop], low[lo:hi], first << BLOCK_BITS)
        if saved is not None:
            saved[lo:hi] = target[index]
        target[index] = values[lo:hi]

    on_threads([functools.partial(piece, a, b) for a, b in itertools.pairwise(edges)])


def on_threads(calls: Sequence[Callable[[], T]]) -> list[T]:
    """The results of ``calls``, run on the :data:`THREADS` threads when there are several (each
    done before anything is returned or raised), else here."""
    if len(calls) <= 1 or THREADS == 1:
        return [call() for call in calls]
    pool = _threads()
    parts = [pool.submit(call) for call in calls]
    wait(parts)
    return [part.result() for part in parts]


SAMPLE: Final = 16384
"""Evenly spaced elements compared before a tensor of at least 4x as many is scanned."""


def sample_stride(elements: int) -> int | None:
    """The stride of the evenly spaced sample taken of a tensor of ``elements``; None: too small to
    sample (it is scanned whatever it holds)."""
    return None if elements < 4 * SAMPLE else elements // SAMPLE


def sample_changed_says_raw(changed: int, elements: int, stride: int, most: float) -> bool:
    """``changed`` of the sample taken at ``stride`` differ at 1.25x the fraction the sparse form can
    afford (re-initialised or heavily trained weights): send raw without scanning, which would build
    a large index before its count stops it. Only speed depends on it: a sample that errs either way
    still yields exact bytes."""
    return changed / -(-elements // stride) > 1.25 * most / elements


def sample_says_raw(
    old: npt.NDArray[np.unsignedinteger], new: npt.NDArray[np.unsignedinteger], most: float
) -> bool:
    """:func:`sample_changed_says_raw` for two host arrays."""
    stride = sample_stride(old.size)
    if stride is None:
        return False
    changed = int(np.count_nonzero(old[::stride] != new[::stride]))
    return sample_changed_says_raw(changed, old.size, stride, most)
