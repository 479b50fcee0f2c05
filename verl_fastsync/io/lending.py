"""Lending a host receive buffer to the consumer without a copy, and knowing when it comes back.

A receiver that copies every tensor out of its bucket (the safe default) pays one more pass over
every byte, into fresh memory (first-touch page faults: 1.8-2.2 GB/s on the 2-core bench host,
against 11 GB/s into warm memory). Lending removes that pass without the aliasing hazard of
``zero_copy``: the consumer gets views into the bucket buffer, and the buffer is refilled only once
nothing the consumer holds points into it. A buffer still referenced when its slot is needed again
stays with the consumer ("on loan"); the slot takes a spare buffer instead, and the loaned buffer
becomes a spare when its last view dies. So a consumer holding tensors keeps exactly the bytes it
was given, and a consumer that drops them (vLLM's ``load_weights``, which copies each tensor into
its parameters) costs no copy at all.

How liveness is known (public APIs only): :func:`lend` makes a NumPy array over the buffer and a
tensor over that array (``torch.from_numpy``), so every tensor, view or storage the consumer derives
from it keeps that one array alive, and a weak reference to the array says whether any does. The
probe is exact: it cannot miss a view (a view shares the storage that holds the array), and a
tensor the consumer copied (``clone``) does not count.

A consumer iterating ``for name, tensor in weights`` still holds the last tensor of a bucket in its
loop variable when it asks for the next one, so the bucket just finished is usually still on loan
when its slot is released: :class:`LendingPool` therefore keeps one spare, and in steady state three
buffers rotate between the two slots (one bucket more than copying, no copy per byte).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch

__all__ = ["DestinationPool", "Lease", "LendingPool", "lend"]


class Lease:
    """What the consumer was lent from one buffer: :attr:`active` while any of it is referenced."""

    __slots__ = ("_ref", "buffer")

    def __init__(self, buffer: torch.Tensor, ref: weakref.ref[object]) -> None:
        self.buffer = buffer
        self._ref = ref

    @property
    def active(self) -> bool:
        return self._ref() is not None


def lend(buffer: torch.Tensor) -> tuple[torch.Tensor, Lease]:
    """A tensor over the same memory as the host tensor ``buffer`` and the :class:`Lease` that
    tracks every tensor derived from it. The caller must not keep the returned tensor (or views of
    it) itself, or the lease never ends."""
    if buffer.device.type != "cpu":
        raise ValueError(f"only host buffers can be lent (got a {buffer.device} tensor)")
    array = buffer.detach().numpy()
    lent = torch.from_numpy(array)
    lease = Lease(buffer, weakref.ref(array))
    del array
    return lent, lease


def _partition(leases: list[Lease]) -> tuple[list[Lease], list[torch.Tensor]]:
    """The leases still active, and the buffers of those that ended (each lease asked once: a
    garbage collection in between must not put one buffer on both sides)."""
    active: list[Lease] = []
    ended: list[torch.Tensor] = []
    for lease in leases:
        if lease.active:
            active.append(lease)
        else:
            ended.append(lease.buffer)
    return active, ended


class LendingPool:
    """Buffers of ``size`` bytes that a receiver lends: the ones on loan and at most ``keep_spares``
    spares (more returned buffers are dropped, so memory falls back once the consumer lets go).

    :param make: ``make(size)`` allocates a new buffer (e.g. a pre-faulted bucket) when no spare is
        free.
    """

    def __init__(self, size: int, make: Callable[[int], torch.Tensor], keep_spares: int = 1) -> None:
        self.size = size
        self._make = make
        self.keep_spares = keep_spares
        self._on_loan: list[Lease] = []
        self._spares: list[torch.Tensor] = []
        self.made = 0
        """Buffers :meth:`take` had to allocate (none while the rotation keeps up)."""

    @property
    def on_loan(self) -> int:
        """Buffers the consumer still references (after the last :meth:`reclaim`)."""
        return len(self._on_loan)

    @property
    def spares(self) -> int:
        """Free buffers kept for the next swap."""
        return len(self._spares)

    @property
    def loaned_bytes(self) -> int:
        return sum(lease.buffer.numel() * lease.buffer.element_size() for lease in self._on_loan)

    def reclaim(self) -> None:
        """Buffers whose lease ended become spares (up to ``keep_spares``; the rest are dropped)."""
        self._on_loan, returned = _partition(self._on_loan)
        self._spares.extend(returned[: max(0, self.keep_spares - len(self._spares))])

    def loan(self, lease: Lease) -> None:
        """``lease`` is still active where its slot is needed again: the consumer keeps the buffer."""
        self._on_loan.append(lease)

    def take(self) -> torch.Tensor:
        """A buffer nothing references: a spare, or a new one."""
        self.reclaim()
        if self._spares:
            return self._spares.pop()
        self.made += 1
        return self._make(self.size)

    def clear(self) -> None:
        """Forget every buffer (the consumer's views keep their own memory alive)."""
        self._on_loan = []
        self._spares = []


class DestinationPool:
    """Host memory for tensors a receiver assembles from several chunks (tensors larger than a
    bucket), reused once the consumer let go of the tensor it held.

    Each such tensor used to be a fresh allocation, so every sync paid first-touch page faults on
    it (about a third of memcpy speed here) and the allocator returned it to the OS when the
    consumer dropped it. The pool hands out a tensor over a flat byte buffer it lends
    (:func:`lend`); when the lease ends the buffer goes back to the pool, already faulted in. A
    tensor the consumer keeps is never reused. At most ``keep`` free buffers are kept (the largest:
    two, because a consumer's loop variable still holds the previous tensor while the next one is
    assembled), so what stays between syncs is bounded by two of the largest split tensors.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._on_loan: list[Lease] = []
        self._free: list[torch.Tensor] = []
        self.made = 0
        """Buffers the pool had to allocate (constant once the rotation keeps up)."""

    @property
    def free_bytes(self) -> int:
        """Bytes of the free buffers kept for the next tensors."""
        return sum(buf.numel() for buf in self._free)

    def reclaim(self) -> None:
        """Buffers whose tensor is gone become free; the largest ``keep`` are kept."""
        self._on_loan, returned = _partition(self._on_loan)
        self._free.extend(returned)
        self._free.sort(key=lambda buf: buf.numel(), reverse=True)
        del self._free[self.keep :]

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor the consumer will own (:data:`verl_fastsync.chunks.Allocate`)."""
        if torch.device(device).type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        nbytes = math.prod(shape) * dtype.itemsize
        self.reclaim()
        fits = [i for i, buf in enumerate(self._free) if buf.numel() >= nbytes]
        if fits:
            buffer = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        else:
            buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self.made += 1
        lent, lease = lend(buffer)
        self._on_loan.append(lease)
        tensor = lent[:nbytes].view(dtype).view(shape)
        del lent
        return tensor

    def clear(self) -> None:
        """Forget every buffer (tensors the consumer holds keep their memory alive by themselves)."""
        self._on_loan = []
        self._free = []
