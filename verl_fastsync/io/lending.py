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

When the consumer lets go, the memory goes back at once, not at the next sync: a weak-reference
callback on the lent array settles the lease the moment its last view dies (in whichever thread
drops it, or in a garbage-collection pass), and a pool then keeps the buffer as a spare only up to
its bound and drops the rest. So a consumer that holds every tensor of a sync and then releases them
(verl's SGLang adapter batches before it loads) leaves the pool at its bound, not at the model's
size. The callback never blocks: it queues the ended lease and settles the queue only when it can
take the pool's lock without waiting; whoever holds the lock settles the queue before letting go.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import deque
from collections.abc import Callable

import torch

__all__ = ["DestinationPool", "Lease", "LendingPool", "lend"]


_NO_MEMORY = torch.empty(0, dtype=torch.uint8)


class Lease:
    """What the consumer was lent from one buffer: :attr:`active` while any of it is referenced."""

    __slots__ = ("__weakref__", "_ref", "buffer", "nbytes")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.nbytes = buffer.numel() * buffer.element_size()
        self._ref: weakref.ref[object] | None = None

    @property
    def active(self) -> bool:
        return self._ref is not None and self._ref() is not None

    def forget_buffer(self) -> None:
        """The lender lets go of the buffer: its memory is freed as soon as the consumer's last view
        dies, while :attr:`active` and :attr:`nbytes` still tell whether, and how much, it holds."""
        self.buffer = _NO_MEMORY


def lend(
    buffer: torch.Tensor, on_return: Callable[[Lease], None] | None = None
) -> tuple[torch.Tensor, Lease]:
    """A tensor over the same memory as the host tensor ``buffer`` and the :class:`Lease` that
    tracks every tensor derived from it. ``on_return(lease)`` runs once when the last of them dies
    (in the thread that dropped it; it must not block). The caller must not keep the returned tensor
    (or views of it) itself, or the lease never ends."""
    if buffer.device.type != "cpu":
        raise ValueError(f"only host buffers can be lent (got a {buffer.device} tensor)")
    array = buffer.detach().numpy()
    lent = torch.from_numpy(array)
    lease = Lease(buffer)
    if on_return is None:
        lease._ref = weakref.ref(array)
    else:
        lease_ref = weakref.ref(lease)  # the callback must not keep the lease (or the pool) alive

        def ended(_dead: object) -> None:
            ended_lease = lease_ref()
            if ended_lease is not None:
                on_return(ended_lease)

        lease._ref = weakref.ref(array, ended)
    del array
    return lent, lease


_NO_BUFFER = object()


class _LeasePool:
    """Leases of one pool, settled the moment they end (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._on_loan: dict[int, Lease] = {}  # id(lease) -> lease
        self._ended: deque[Lease] = deque()

    def _lend(self, buffer: torch.Tensor) -> tuple[torch.Tensor, Lease]:
        return lend(buffer, self._lease_ended)

    def _lease_ended(self, lease: Lease) -> None:
        self._ended.append(lease)  # deque.append is atomic: safe from any thread, never blocks
        if self._lock.acquire(blocking=False):
            try:
                self._settle_ended()
            finally:
                self._lock.release()

    def _settle_ended(self) -> None:
        """Lock held: every queued ended lease gives its buffer back (:meth:`_returned`)."""
        while True:
            while self._ended:
                lease = self._ended.popleft()
                if self._on_loan.pop(id(lease), None) is lease:
                    self._returned(lease.buffer)
            # a lease that ended while we settled queued itself but could not take the lock
            if not self._ended:
                return

    def _returned(self, buffer: torch.Tensor) -> None:
        """Lock held: ``buffer`` is free again."""
        raise NotImplementedError

    def _loan_locked(self, lease: Lease) -> None:
        if lease.active:
            self._on_loan[id(lease)] = lease
        else:
            self._returned(lease.buffer)

    def loan(self, lease: Lease) -> None:
        """``lease`` is still active where its buffer is needed again: the consumer keeps the
        buffer until the lease ends (then it comes back by itself)."""
        with self._lock:
            self._loan_locked(lease)
            self._settle_ended()

    def reclaim(self) -> None:
        """Settle leases that ended (the callbacks do it already; this covers a callback that could
        not take the lock)."""
        with self._lock:
            for key, lease in list(self._on_loan.items()):
                if not lease.active:
                    del self._on_loan[key]
                    self._returned(lease.buffer)
            self._settle_ended()

    @property
    def on_loan(self) -> int:
        """Buffers the consumer still references."""
        with self._lock:
            self._settle_ended()
            return len(self._on_loan)

    @property
    def loaned_bytes(self) -> int:
        """Bytes of the buffers the consumer still references."""
        with self._lock:
            self._settle_ended()
            return sum(lease.nbytes for lease in self._on_loan.values())


class LendingPool(_LeasePool):
    """Buffers of ``size`` bytes that a receiver lends: the ones on loan and at most ``keep_spares``
    spares. A buffer whose lease ends becomes a spare if there is room, else it is dropped at once,
    so memory falls back to the bound the moment the consumer lets go.

    :param make: ``make(size)`` allocates a new buffer (e.g. a pre-faulted bucket) when no spare is
        free.
    """

    def __init__(self, size: int, make: Callable[[int], torch.Tensor], keep_spares: int = 1) -> None:
        super().__init__()
        self.size = size
        self._make = make
        self.keep_spares = keep_spares
        self._spares: list[torch.Tensor] = []
        self.made = 0
        """Buffers :meth:`take` had to allocate (none while the rotation keeps up)."""

    @property
    def spares(self) -> int:
        """Free buffers kept for the next swap."""
        with self._lock:
            self._settle_ended()
            return len(self._spares)

    def _returned(self, buffer: torch.Tensor) -> None:
        if len(self._spares) < self.keep_spares:
            self._spares.append(buffer)

    def lend(self, buffer: torch.Tensor) -> tuple[torch.Tensor, Lease]:
        """:func:`lend` with this pool's return: once :meth:`loan`-ed, the buffer comes back to the
        pool the moment the consumer drops its last view."""
        return self._lend(buffer)

    def take(self) -> torch.Tensor:
        """A buffer nothing references: a spare, or a new one."""
        with self._lock:
            self._settle_ended()
            if self._spares:
                return self._spares.pop()
        self.made += 1
        return self._make(self.size)

    def clear(self) -> None:
        """Forget every buffer (the consumer's views keep their own memory alive)."""
        with self._lock:
            self._on_loan = {}
            self._spares = []
            self._ended.clear()


class DestinationPool(_LeasePool):
    """Host memory for tensors a receiver assembles from several chunks (tensors larger than a
    bucket), reused once the consumer let go of the tensor it held.

    Each such tensor used to be a fresh allocation, so every sync paid first-touch page faults on
    it (about a third of memcpy speed here) and the allocator returned it to the OS when the
    consumer dropped it. The pool hands out a tensor over a flat byte buffer it lends
    (:func:`lend`); when the lease ends the buffer goes back to the pool, already faulted in. A
    tensor the consumer keeps is never reused. At most ``keep`` free buffers are kept (the largest:
    two, because a consumer's loop variable still holds the previous tensor while the next one is
    assembled), so what stays between syncs is bounded by two of the largest split tensors, and a
    returned buffer beyond that is freed the moment the consumer drops it.
    """

    def __init__(self, keep: int = 2) -> None:
        super().__init__()
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self.made = 0
        """Buffers the pool had to allocate (constant once the rotation keeps up)."""

    @property
    def free_bytes(self) -> int:
        """Bytes of the free buffers kept for the next tensors."""
        with self._lock:
            self._settle_ended()
            return sum(buf.numel() for buf in self._free)

    def _returned(self, buffer: torch.Tensor) -> None:
        self._free.append(buffer)
        self._free.sort(key=lambda buf: buf.numel(), reverse=True)
        del self._free[self.keep :]

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor the consumer will own (:data:`verl_fastsync.chunks.Allocate`)."""
        if torch.device(device).type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        nbytes = math.prod(shape) * dtype.itemsize
        buffer: torch.Tensor | None = None
        with self._lock:
            self._settle_ended()
            fits = [i for i, buf in enumerate(self._free) if buf.numel() >= nbytes]
            if fits:
                buffer = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        if buffer is None:
            buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self.made += 1
        lent, lease = self._lend(buffer)
        del buffer
        with self._lock:
            self._on_loan[id(lease)] = lease  # active: ``lent`` is alive
        tensor = lent[:nbytes].view(dtype).view(shape)
        del lent
        return tensor

    def clear(self) -> None:
        """Forget every buffer (tensors the consumer holds keep their memory alive by themselves)."""
        with self._lock:
            self._on_loan = {}
            self._free = []
            self._ended.clear()
